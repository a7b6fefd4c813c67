"""The routing simulation's sweep (policies x replica counts, then one-knob variations at one replica count)
and its outputs: a markdown table per replica count, the rows as JSON, and a plot.

Weak scaling: the corpus and the request count grow with the replica count (`docs_per_replica`,
`requests_per_replica`) and each replica keeps the same memory tier, so every replica count faces the
same memory pressure; the ideal reference is one tier of the total size.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable

from .costs import CostModel, from_results
from .simulate import POLICIES, SimConfig, arrival_times, simulate
from .tier import LRU
from .trace import TraceConfig, make_trace

HIT_TARGET, IMBALANCE_TARGET = 0.9, 1.2  # chunk-affinity hit / ideal hit, max / mean requests per replica


@dataclass(frozen=True)
class Sweep:
    replicas: tuple[int, ...] = (8, 64, 256)
    tier_tokens: int = 65_536
    docs_per_replica: int = 50
    requests_per_replica: int = 400
    utilization: float = 0.7
    seed: int = 0
    trace: dict = field(default_factory=dict)  # TraceConfig overrides (k, mix, novel_share, zipf_s, ...)
    router_options: dict = field(default_factory=dict)  # per policy name
    sensitivity_replicas: int = 64  # 0: no variations


# one knob changed at a time: (label, Sweep field or trace / router override, policies run)
VARIANTS = [
    ("lam=0", {"router_options": {"chunk-affinity": {"lam": 0.0}}}, ("chunk-affinity",)),
    ("lam=0.25", {"router_options": {"chunk-affinity": {"lam": 0.25}}}, ("chunk-affinity",)),
    ("lam=1", {"router_options": {"chunk-affinity": {"lam": 1.0}}}, ("chunk-affinity",)),
    ("lam=0, no load cap", {"router_options": {"chunk-affinity": {"lam": 0.0, "slack": None}}}, ("chunk-affinity",)),
    ("mix=0", {"trace": {"mix": 0.0}}, ("ideal", "prefix-affinity", "chunk-affinity")),
    ("mix=0.4", {"trace": {"mix": 0.4}}, ("ideal", "prefix-affinity", "chunk-affinity")),
    ("tier/4", {"tier_tokens": 0.25}, ("ideal", "chunk-affinity")),
    ("tier x4", {"tier_tokens": 4.0}, ("ideal", "chunk-affinity")),
    ("digest (key sets)", {"report": "digest"}, ("chunk-affinity",)),
    ("digest (Bloom)", {"report": "bloom"}, ("chunk-affinity",)),
    ("seed=1", {"seed": 1}, ("ideal", "chunk-affinity")),
    ("seed=2", {"seed": 2}, ("ideal", "chunk-affinity")),
]


def run_point(n: int, sweep: Sweep, costs: CostModel, policies=POLICIES, report: str = "events",
              make_policy: Callable = LRU) -> list[dict]:
    """One row per policy at `n` replicas, each with its hit rate over the ideal's (when the ideal ran)."""
    tcfg = TraceConfig(n_requests=sweep.requests_per_replica * n, n_docs=sweep.docs_per_replica * n,
                       seed=sweep.seed, **sweep.trace)
    trace = make_trace(tcfg)
    cfg = SimConfig(n_replicas=n, tier_tokens=sweep.tier_tokens, utilization=sweep.utilization, report=report,
                    seed=sweep.seed, router_options=sweep.router_options)
    times = arrival_times(trace, cfg, costs)
    rows = []
    for p in policies:
        t = time.process_time()
        row = {"replicas": n, **simulate(p, trace, times, cfg, costs, make_policy)}
        rows.append({**row, "cpu_s": round(time.process_time() - t, 2)})
    ideal = next((r["local_hit"] for r in rows if r["policy"] == "ideal"), None)
    for r in rows:
        r["hit_vs_ideal"] = r["local_hit"] / ideal if ideal else None
    return rows


def _variant(sweep: Sweep, change: dict) -> tuple[Sweep, str]:
    change = dict(change)
    report = change.pop("report", "events")
    if "trace" in change:
        change["trace"] = {**sweep.trace, **change["trace"]}
    if "router_options" in change:
        change["router_options"] = {**sweep.router_options, **change["router_options"]}
    if "tier_tokens" in change:
        change["tier_tokens"] = int(sweep.tier_tokens * change["tier_tokens"])
    return replace(sweep, **change), report


def run(sweep: Sweep, costs: CostModel, make_policy: Callable = LRU, log: Callable = print) -> dict:
    """The main table (every policy at every replica count) and the variations at `sensitivity_replicas`."""
    main = []
    for n in sweep.replicas:
        main += run_point(n, sweep, costs, make_policy=make_policy)
        log(f"{n} replicas done")
    variations = []
    n = sweep.sensitivity_replicas
    base = [r for r in main if r["replicas"] == n] or (run_point(n, sweep, costs, make_policy=make_policy) if n else [])
    ideal = next((r["local_hit"] for r in base if r["policy"] == "ideal"), None)
    for label, change, policies in VARIANTS if n else []:
        vs, report = _variant(sweep, change)
        rows = run_point(n, vs, costs, policies, report, make_policy)
        own = next((r["local_hit"] for r in rows if r["policy"] == "ideal"), ideal)
        for r in rows:
            r["hit_vs_ideal"] = r["local_hit"] / own if own else None
            variations.append({"variant": label, **r})
        log(f"variant {label} done")
    return {"sweep": asdict(sweep), "costs": {**asdict(costs)}, "main": main, "variations": variations}


def targets(main: list[dict]) -> list[dict]:
    """Chunk affinity against the targets, with two bounds on what routing alone could reach: its hit if its
    own-document chunks hit as in the ideal (other documents' chunks as measured), and what some replica held."""
    out = []
    for n in sorted({r["replicas"] for r in main}):
        a = next(r for r in main if r["replicas"] == n and r["policy"] == "chunk-affinity")
        i = next(r for r in main if r["replicas"] == n and r["policy"] == "ideal")
        own_bound = a["own_doc_share"] * i["own_doc_hit"] + a["other_doc_share"] * a["other_doc_hit"]
        out.append({"replicas": n, "hit_vs_ideal": a["hit_vs_ideal"], "imbalance": a["imbalance"],
                    "own_doc_at_ideal_vs_ideal": own_bound / i["local_hit"],
                    "held_anywhere_vs_ideal": a["held_anywhere"] / i["local_hit"],
                    "hit_met": bool(a["hit_vs_ideal"] is not None and a["hit_vs_ideal"] >= HIT_TARGET),
                    "imbalance_met": bool(a["imbalance"] <= IMBALANCE_TARGET)})
    return out


def _f(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


COLUMNS = ("| policy | local hit | vs ideal | own-doc hit | other-doc hit | held anywhere | MB fetched / request | "
           "TTFT p50 s | TTFT p95 s | imbalance |")
RULE = "|" + "---|" * COLUMNS.count(" | ") + "---|"


def _row(r: dict, label: str | None = None) -> str:
    return (f"| {label or r['policy']} | {r['local_hit']:.3f} | {_f(r['hit_vs_ideal'], '.2f')} | "
            f"{_f(r['own_doc_hit'], '.3f')} | {_f(r['other_doc_hit'], '.3f')} | {_f(r['held_anywhere'], '.3f')} | "
            f"{r['fetched_mb_per_request']:.2f} | {_f(r['ttft_p50_s'], '.2f')} | {_f(r['ttft_p95_s'], '.2f')} | "
            f"{_f(r['imbalance'], '.2f')} |")


def markdown(results: dict, command: str) -> str:
    s, c = results["sweep"], results["costs"]
    lines = ["# Routing by chunk affinity: simulated replicas", "", f"Written by `{command}`.", "",
             f"Per replica: memory tier {s['tier_tokens']} tokens ({s['tier_tokens'] * c['bytes_per_token'] / 2**30:.2f} "
             f"GiB of K/V), {s['docs_per_replica']} popular documents and {s['requests_per_replica']} requests (the "
             f"first quarter not measured); utilization {s['utilization']}; seed {s['seed']}; trace "
             f"{s['trace'] or 'defaults'}; router options {s['router_options'] or 'defaults'}; "
             f"{results.get('cpu_s', '?')} s of CPU.", "",
             "Columns: local hit = share of the requested context tokens found in the chosen replica's memory "
             "tier; own-doc / other-doc hit = the same over the stored chunks of the request's main document / of "
             "the other documents it retrieved; held anywhere = share held by some replica's tier when the request "
             "arrived (what fetching from a peer's memory could reach); recomputed: "
             f"{results['main'][0]['recomputed_share']:.3f} of the tokens (novel documents) for every policy; "
             "imbalance = max / mean requests per replica.", "",
             "Costs per context token:", ""]
    lines += [f"- {k}: {c[k]:.3g} ({c['sources'].get(k, 'given')})" for k in
              ("bytes_per_token", "fetch_s_per_token", "recompute_s_per_token", "base_s_per_token")]
    for n in s["replicas"]:
        lines += ["", f"## {n} replicas", "", COLUMNS, RULE]
        lines += [_row(r) for r in results["main"] if r["replicas"] == n]
    lines += ["", "## Targets (chunk-affinity)", "",
              f"| replicas | local hit / ideal (target >= {HIT_TARGET}) | imbalance (target <= {IMBALANCE_TARGET}) | "
              "/ ideal if own-doc chunks hit as in the ideal | held anywhere / ideal |", "|---|---|---|---|---|"]
    lines += [f"| {t['replicas']} | {t['hit_vs_ideal']:.2f} ({'met' if t['hit_met'] else 'missed'}) | "
              f"{t['imbalance']:.2f} ({'met' if t['imbalance_met'] else 'missed'}) | "
              f"{t['own_doc_at_ideal_vs_ideal']:.2f} | {t['held_anywhere_vs_ideal']:.2f} |" for t in targets(results["main"])]
    if results["variations"]:
        n = s["sensitivity_replicas"]
        lines += ["", f"## One knob at a time ({n} replicas; 'vs ideal' against the ideal of the same trace and tier)",
                  "", COLUMNS.replace("| policy |", "| variant: policy |"), RULE]
        lines += [_row(r, f"{r['variant']}: {r['policy']}") for r in results["variations"]]
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    main = results["main"]
    panels = [("local_hit", "local-hit rate"), ("fetched_mb_per_request", "MB fetched / request"),
              ("ttft_p95_s", "TTFT p95 (s)"), ("imbalance", "imbalance (max / mean)")]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6))
    for ax, (key, title) in zip(axes, panels):
        for p in dict.fromkeys(r["policy"] for r in main):
            pts = [(r["replicas"], r[key]) for r in main if r["policy"] == p]
            ax.plot(*zip(*pts), marker="o", label=p)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("replicas")
        ax.set_title(title)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write(results: dict, out: Path, command: str, with_plot: bool = True) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    results = {"meta": {"command": command, "time": time.strftime("%Y-%m-%d %H:%M:%S")}, **results,
               "targets": targets(results["main"])}
    paths = [out / "sim.md", out / "sim.json"]
    paths[0].write_text(markdown(results, command))
    paths[1].write_text(json.dumps(results, indent=1) + "\n")
    if with_plot:
        paths.append(plot(results, out / "sim.png"))
    return paths


def sweep_of(replicas, tier_tokens: int = 65_536, docs_per_replica: int = 50, requests_per_replica: int = 400,
             utilization: float = 0.7, seed: int = 0, lam: float = 0.5, variations: bool = True, **trace) -> Sweep:
    """The sweep the command line asks for; variations run at 64 replicas when swept, else the first count."""
    replicas = tuple(int(n) for n in replicas)
    if not replicas or min(replicas) < 2 or max(replicas) > 256:
        raise ValueError(f"replica counts go from 2 to 256, got {replicas}")
    return Sweep(replicas=replicas, tier_tokens=tier_tokens, docs_per_replica=docs_per_replica,
                 requests_per_replica=requests_per_replica, utilization=utilization, seed=seed, trace=trace,
                 router_options={"chunk-affinity": {"lam": lam}},
                 sensitivity_replicas=(64 if 64 in replicas else replicas[0]) if variations else 0)


def simulate_and_write(sweep: Sweep, model: str, results: Path, out: Path, command: str,
                       make_policy: Callable = LRU, with_plot: bool = True, log: Callable = print) -> list[Path]:
    """Run the sweep with `model`'s costs read from `results`, write sim.md / sim.json (/ sim.png) to `out`."""
    t = time.process_time()
    res = run(sweep, from_results(model, results), make_policy, log)
    res["cpu_s"] = round(time.process_time() - t, 1)
    paths = write(res, out, command, with_plot)
    log(f"{res['cpu_s']} s of CPU; written: " + ", ".join(map(str, paths)))
    return paths
