"""`kvstitch calibrate`: choose a method, a ratio and the `auto` options on the user's own questions.

On a sample of questions and documents (``--dataset FILE``, read by the eval's reader `kvstitch.tasks.datasets`)
and a model, every sample is answered by full prefill (the reference) and by each configuration: every
method at every fixed ratio, and every method at ``ratio="auto"`` with each ``--auto`` setting. A configuration
*agrees* on a sample when its answer's first 12 words equal full prefill's (`tasks.agreement`); its TTFT
speed-up is mean full-prefill TTFT / its mean TTFT over the samples (same process, same samples).

The **perfect-signal frontier** of a method: per sample, a signal that knew which answers agree would take the
cheapest fixed ratio whose answer agrees, else full prefill (agreement 1.0 at the mean of those TTFTs); for a
lower agreement a it would also give up the (1 - a) of the samples where agreeing costs the most, answering
them with the cheapest ratio. An `auto` setting is judged against it at its own agreement:
``frontier_share`` = its speed-up / the frontier's speed-up at that agreement.

The chosen setting is the fastest configuration whose agreement is at least ``--target`` (else the one that
agrees most), written into the TOML config that ``kvstitch serve --config`` and ``kvstitch ask --config`` read
(``method``, ``ratio``, ``auto``, ``model``) with what was measured under ``[calibration]`` (read by nobody
else: a record). Other keys of an existing file are kept. Outputs in ``--out``: ``rows.jsonl`` (one row per
sample and configuration; a rerun resumes), ``calibration.md`` and ``frontier.png``.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

from kvstitch.core.figures import save_png
from kvstitch.core.spec import parse_call
from kvstitch.engine.budget import AUTO, AutoBudget
from kvstitch.core.errors import InputError
from kvstitch.core.extras import require

WORDS = 12


@dataclass(frozen=True)
class Config:
    method: str
    ratio: float | str  # a fraction, or "auto"
    auto: dict | None = None  # options of "auto"

    @property
    def label(self) -> str:
        if self.ratio != AUTO:
            return f"{self.method}@{self.ratio:g}"
        opts = ",".join(f"{k}={'/'.join(f'{x:g}' for x in v) if isinstance(v, (list, tuple)) else v}"
                        for k, v in sorted((self.auto or {}).items()))
        return f"{self.method}@auto({opts})"


def parse_auto(spec: str) -> dict:
    """One ``--auto`` setting: an auto spec (``"auto(schedule=[0.05,0.1],tol=0.01)"``, the grammar of
    `kvstitch.core.spec`), ``"schedule=0.05/0.1,tol=0.01"`` (any `AutoBudget` field; lists with '/') or JSON
    -> the options dict (checked by `AutoBudget`)."""
    spec = spec.strip()
    if spec.lower() == AUTO or spec[:len(AUTO)].lower() == AUTO and spec[len(AUTO):].lstrip()[:1] in ("(", ":"):
        AutoBudget.of(spec)  # unknown or bad options fail here, before the model loads
        return dict(parse_call(spec, "auto budget").options)  # as written: what the setting's label shows
    if spec.startswith("{"):
        try:
            opts = json.loads(spec)
        except ValueError as e:
            raise InputError(f"--auto {spec!r}: not valid JSON ({e})") from None
    else:
        opts = {}
        for part in filter(None, (p.strip() for p in spec.split(","))):
            if "=" not in part:
                raise InputError(f"--auto takes key=value pairs (e.g. schedule=0.05/0.1,tol=0.01), got {part!r}")
            k, v = (x.strip() for x in part.split("=", 1))
            try:
                opts[k] = [float(x) for x in v.split("/")] if k == "schedule" else json.loads(v)
            except ValueError:
                opts[k] = v  # e.g. mode=refresh
    AutoBudget.of(opts)  # unknown or bad options fail here, before the model loads
    return opts


def configs(methods: list[str], ratios: list[float], autos: list[dict]) -> list[Config]:
    from kvstitch.select import check_methods

    methods = check_methods(methods)  # labels: what rows and the config file name them by
    for r in ratios:
        if not 0.0 < r < 1.0:
            raise InputError(f"calibration ratios must be in (0, 1), got {r}")
    out = [Config(m, float(r)) for m in methods for r in sorted(ratios)]
    out += [Config(m, AUTO, a) for m in methods for a in autos]
    return out


# ---- measuring ---------------------------------------------------------------------------------------------------
def measure(engine, samples, cfgs: list[Config], out: Path, progress=None) -> list[dict]:
    """Full prefill and every configuration on every sample -> rows (appended to ``out/rows.jsonl``; rows already
    there are kept and not run again)."""
    from kvstitch.tasks.agreement import first_words_agree
    from .runner import EvalConfig, answer_budget, run_method, sample_layout, warm_up

    out.mkdir(parents=True, exist_ok=True)
    path = out / "rows.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []
    have = {(r["sample"], r["config"]) for r in rows}
    ecfg = EvalConfig(tasks=[], lengths=[], methods=[], ratios=[])
    warm_up(engine, sorted({c.method for c in cfgs}))
    with path.open("a", encoding="utf-8") as f:
        for s in samples:
            key = f"{s.task}#{s.meta['index']}"
            todo = [c for c in cfgs if (key, c.label) not in have]
            if not todo and (key, "full") in have:
                continue
            layout = sample_layout(engine, s)
            budget = answer_budget(engine, s, ecfg)
            engine.chunk_kvs(layout)  # the store is warm, as it is for RAG reuse (untimed)
            ref = run_method(engine, layout, "full", None, budget)

            def emit(row: dict) -> None:  # each row as it is measured: a stopped run resumes at the next one
                f.write(json.dumps(row) + "\n")
                f.flush()
                rows.append(row)

            if (key, "full") not in have:
                emit({"sample": key, "config": "full", "method": "full", "ratio": 1.0, "ttft_s": ref.ttft_s,
                      "ttft_full_s": ref.ttft_s, "agree": True, "pred": ref.text[:200],
                      "context_tokens": layout.n_context})
            for c in todo:
                run = run_method(engine, layout, c.method, c.ratio, budget, ref.tokens, auto=c.auto)
                emit({"sample": key, "config": c.label, "method": c.method, "ratio": c.ratio, "auto": c.auto,
                      "ttft_s": run.ttft_s, "ttft_full_s": ref.ttft_s,
                      "agree": first_words_agree(run.text, ref.text, WORDS), "pred": run.text[:200],
                      "ratio_used": run.stats.get("ratio_used"), "rounds": run.stats.get("rounds"),
                      "converged": run.stats.get("converged")})
                if progress:
                    progress(key, c.label)
    return rows


# ---- the frontier and the choice ----------------------------------------------------------------------------------
def _by_sample(rows: list[dict]) -> dict[str, dict[str, dict]]:
    out: dict[str, dict[str, dict]] = {}
    for r in rows:
        out.setdefault(r["sample"], {})[r["config"]] = r
    return out


def summarize(rows: list[dict], labels: list[str]) -> list[dict]:
    """Per configuration over the samples that have it and full: n, agreement, mean TTFTs, speed-up."""
    table = []
    per = _by_sample(rows)
    for lab in labels:
        got = [(d[lab], d["full"]) for d in per.values() if lab in d and "full" in d]
        if not got:
            continue
        t = sum(r["ttft_s"] for r, _ in got) / len(got)
        tf = sum(f["ttft_s"] for _, f in got) / len(got)
        table.append({"config": lab, "n": len(got), "agreement": sum(bool(r["agree"]) for r, _ in got) / len(got),
                      "ttft_s": t, "ttft_full_s": tf, "speedup": tf / t if t > 0 else math.inf})
    return table


def perfect_frontier(rows: list[dict], fixed: list[str]) -> list[tuple[float, float]]:
    """The perfect-signal frontier over the fixed-ratio configurations ``fixed`` (module doc) -> points
    (agreement, speed-up), one per number of samples given up, agreement decreasing from 1."""
    per = [d for d in _by_sample(rows).values() if "full" in d and all(f in d for f in fixed)]
    if not per or not fixed:
        return []
    n = len(per)
    t_full = sum(d["full"]["ttft_s"] for d in per) / n
    need, cheap = [], []  # per sample: the cost of an agreeing answer, and of the cheapest answer
    for d in per:
        need.append(min([d[f]["ttft_s"] for f in fixed if d[f]["agree"]] + [d["full"]["ttft_s"]]))
        cheap.append(min(need[-1], min(d[f]["ttft_s"] for f in fixed)))
    saving = sorted((need[i] - cheap[i] for i in range(n)), reverse=True)  # give up the dearest agreements first
    points, mean = [], sum(need) / n
    for k in range(n + 1):
        if k and saving[k - 1] <= 0:
            break
        mean -= saving[k - 1] / n if k else 0.0
        points.append(((n - k) / n, t_full / mean if mean > 0 else math.inf))
    return points


def frontier_at(points: list[tuple[float, float]], agreement: float) -> float | None:
    """The frontier's best speed-up among its points with agreement >= ``agreement``."""
    ok = [s for a, s in points if a >= agreement - 1e-9]
    return max(ok) if ok else None


def choose(table: list[dict], target: float) -> tuple[dict, bool]:
    """The fastest configuration with agreement >= target (True), else the one that agrees most (False)."""
    ok = [r for r in table if r["config"] != "full" and r["agreement"] >= target]
    if ok:
        return max(ok, key=lambda r: (r["speedup"], r["agreement"])), True
    rest = [r for r in table if r["config"] != "full"]
    return max(rest, key=lambda r: (r["agreement"], r["speedup"])), False


# ---- the config file ------------------------------------------------------------------------------------------------
def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        if isinstance(v, float) and not math.isfinite(v):
            raise InputError(f"cannot write {v} to a TOML config")
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)  # a TOML basic string: JSON's escapes are TOML's
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + " }"
    raise InputError(f"cannot write a {type(v).__name__} to a TOML config")


def write_config(path: Path, settings: dict, record: dict) -> None:
    """Set ``settings`` (method, ratio, auto, model) at the top level of the TOML file ``path`` (other keys kept;
    an ``auto`` left from an earlier choice is dropped when the new ratio is fixed) and ``record`` as its
    ``[calibration]`` table. Written atomically."""
    from kvstitch.serve.config import load_toml

    data = load_toml(path) if path.exists() else {}
    data.pop("calibration", None)
    if settings.get("ratio") != AUTO:
        data.pop("auto", None)
    data.update({k: v for k, v in settings.items() if v is not None})
    tables = {k: v for k, v in data.items() if isinstance(v, dict) and k != "auto"}
    lines = ["# kvstitch settings; method / ratio / auto / model chosen by `kvstitch calibrate` (see [calibration])"]
    lines += [f"{k} = {_toml_value(v)}" for k, v in data.items() if k not in tables]
    for name, table in [*tables.items(), ("calibration", record)]:
        lines += ["", f"[{name}]"] + [f"{k} = {_toml_value(v)}" for k, v in table.items() if v is not None]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("\n".join(lines) + "\n", encoding="utf-8")
    tmp.replace(path)


# ---- report ------------------------------------------------------------------------------------------------------
def plot(table: list[dict], frontiers: dict[str, list[tuple[float, float]]], path: Path, chosen: str,
         xlabel: str = "TTFT speed-up vs full prefill") -> None:
    matplotlib = require("matplotlib", "plots", "the calibration plot")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for m, pts in frontiers.items():
        if pts:
            ax.plot([s for _, s in pts], [a for a, _ in pts], "-", alpha=0.6, label=f"perfect signal: {m}")
    for r in table:
        if r["config"] == "full":
            continue
        marker = "*" if r["config"] == chosen else ("s" if "@auto" in r["config"] else "o")
        ax.scatter(r["speedup"], r["agreement"], marker=marker, s=120 if marker == "*" else 30)
        ax.annotate(r["config"], (r["speedup"], r["agreement"]), fontsize=6, alpha=0.8)
    ax.axvline(1.0, color="grey", lw=0.5)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("agreement with full prefill (first 12 words)")
    ax.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    save_png(fig, path)
    plt.close(fig)


def report(rows: list[dict], cfgs: list[Config], target: float, command: str = "") -> dict:
    """-> {"table", "frontiers", "chosen", "met", "markdown"} from the rows."""
    labels = ["full"] + [c.label for c in cfgs]
    table = summarize(rows, labels)
    if not table:
        raise InputError("no sample was measured")
    methods = list(dict.fromkeys(c.method for c in cfgs))
    frontiers = {m: perfect_frontier(rows, [c.label for c in cfgs if c.method == m and c.ratio != AUTO])
                 for m in methods}
    for r in table:
        m = r["config"].split("@")[0]
        f = frontier_at(frontiers.get(m, []), r["agreement"]) if r["config"] != "full" else None
        r["frontier_speedup"] = f
        r["frontier_share"] = r["speedup"] / f if f else None
    chosen, met = choose(table, target)
    md = ["# kvstitch calibrate", ""]
    if command:
        md += [f"`{command}`", ""]
    md += [f"Agreement = the first {WORDS} words equal full prefill's; speed-up = mean full-prefill TTFT / mean TTFT "
           f"over the same samples (one process). Frontier = the method's perfect-signal frontier over its fixed "
           f"ratios at the row's agreement; share = speed-up / frontier.", "",
           "| configuration | n | agreement | TTFT (s) | speed-up | frontier speed-up | share of frontier |",
           "|---|---|---|---|---|---|---|"]
    for r in table:
        f = "–" if r["frontier_speedup"] is None else f"{r['frontier_speedup']:.2f}"
        sh = "–" if r["frontier_share"] is None else f"{r['frontier_share']:.2f}"
        md.append(f"| {r['config']} | {r['n']} | {r['agreement']:.2f} | {r['ttft_s']:.3f} | {r['speedup']:.2f} | {f} | {sh} |")
    md += ["", "Perfect-signal frontier (agreement: speed-up):", ""]
    for m, pts in frontiers.items():
        sel = [p for p in pts if p[0] in (1.0,) or abs(p[0] * 20 - round(p[0] * 20)) < 1e-9]
        md.append(f"- {m}: " + ", ".join(f"{a:.2f}: {s:.2f}x" for a, s in (sel or pts)[:12]))
    md += ["", f"Chosen (target agreement {target:.2f}, {'met' if met else 'NOT met: the most agreeing one'}): "
               f"**{chosen['config']}**, agreement {chosen['agreement']:.2f} at {chosen['speedup']:.2f}x.", ""]
    return {"table": table, "frontiers": frontiers, "chosen": chosen, "met": met, "markdown": "\n".join(md) + "\n"}


def config_of(label: str, cfgs: list[Config]) -> Config:
    return next(c for c in cfgs if c.label == label)


def calibrate(engine, samples, cfgs: list[Config], out: Path, target: float, config_path: Path | None,
              model: str | None = None, dataset: str = "", command: str = "", progress=None) -> dict:
    """Measure, report, plot, and write the chosen setting into ``config_path`` -> the report dict."""
    rows = measure(engine, samples, cfgs, out, progress)
    keys = {f"{s.task}#{s.meta['index']}" for s in samples}
    rep = report([r for r in rows if r["sample"] in keys], cfgs, target, command)
    (out / "calibration.md").write_text(rep["markdown"], encoding="utf-8")
    plot(rep["table"], rep["frontiers"], out / "frontier.png", rep["chosen"]["config"])
    if config_path is not None:
        c = config_of(rep["chosen"]["config"], cfgs)
        ch = rep["chosen"]
        record = {"agreement": round(ch["agreement"], 4), "speedup": round(ch["speedup"], 4), "n": ch["n"],
                  "target": target, "target_met": rep["met"], "dataset": dataset, "configuration": ch["config"],
                  "frontier_speedup": None if ch["frontier_speedup"] is None else round(ch["frontier_speedup"], 4),
                  "written": time.strftime("%Y-%m-%d %H:%M:%S"), "report": str(out / "calibration.md")}
        write_config(config_path, {"method": c.method, "ratio": c.ratio if c.ratio == AUTO else float(c.ratio),
                                   "auto": c.auto if c.ratio == AUTO else None, "model": model}, record)
    return rep
