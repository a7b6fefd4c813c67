"""Calibrate the convergence signal of recompute_ratio="auto" on a seed the eval never uses.

For every sample: full prefill's greedy answer, then every round of the schedule run to the end (tol 0,
ceiling = the last scheduled ratio) with each method, logging per round the probe (greedy answer start) and
the KL to the previous round. Offline, for each (tol, patience) it replays where `auto` would have stopped
and whether the answer there agrees with full prefill's (first 12 words), and the cost (recomputed
fraction; a fallback costs the rounds plus a full prefill). Writes JSON lines + a markdown table.

    python scripts/calibrate_auto.py --seed 1 --n 12 --length 2048 --out docs/results/auto-calibration
    python scripts/calibrate_auto.py --model qwen2.5-0.5b --haystack essays --length 8192 ...  (the reference model)

``--verify-chunks 2,4``: for every sample already in rounds.jsonl, the verification's answer (a full prefill of
the question over its m best-matching chunks, `kvstitch.engine.budget.reference_answer`) into verify.jsonl, and
the report replays `auto` with that verification (``AutoBudget.verify_chunks``) over every schedule.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from kvstitch import Engine
from kvstitch.engine.budget import DEFAULT_SCHEDULE, AutoBudget
from kvstitch.tasks import generate, scorer_for
from kvstitch.tasks.haystack import resolve_haystack
from kvstitch.tasks.agreement import first_words_agree
from kvstitch.eval.runner import answer_budget, sample_layout, EvalConfig

TOLS = (0.005, 0.01, 0.02, 0.05, float("inf"))


def collect(engine, args) -> list[dict]:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "rounds.jsonl"
    schedule = [float(x) for x in args.schedule.split(",")]
    done = set()
    if path.exists():
        done = {(r["task"], r["index"], r["method"]) for r in map(json.loads, path.read_text().splitlines())}
    cfg = EvalConfig(tasks=args.tasks.split(","), lengths=[args.length], methods=[], ratios=[], n=args.n,
                     seed=args.seed, chunk_tokens=args.chunk_tokens, haystack=resolve_haystack(args.haystack))
    def count(text: str) -> int:
        return len(engine.tokenizer.encode(text, add_special_tokens=False))

    with path.open("a") as f:
        for task in cfg.tasks:
            for i, sample in enumerate(generate(task, args.n, args.length, cfg.chunk_tokens, args.seed, count,
                                                      haystack=cfg.haystack)):
                if i < args.skip:  # another process has these (sample i depends on (task, seed, i) only)
                    continue
                layout = sample_layout(engine, sample)
                budget = answer_budget(engine, sample, cfg)
                engine.chunk_kvs(layout)
                t0 = time.perf_counter()
                fpre = engine.prefill(layout, "full", 0.0, budget)
                full_s = time.perf_counter() - t0
                full = list(engine.decode_tokens(fpre, budget))
                full_text = engine.tokenizer.decode(full, skip_special_tokens=True)
                fl = engine.teacher_force(fpre, torch.tensor(full))
                full_min_p = float(torch.softmax(fl, -1).gather(1, torch.tensor(full).view(-1, 1)).min())
                for m in args.methods.split(","):
                    if (task, i, m) in done:
                        continue
                    t0 = time.perf_counter()
                    pre = engine.prefill(layout, m, AutoBudget(tol=0.0, max_ratio=max(schedule), schedule=schedule,
                                                               probe_tokens=args.probe_tokens, mode=args.mode),
                                         budget)
                    rounds_s = time.perf_counter() - t0  # every round run to the end, probes included
                    rounds = []
                    for r in pre.stats["round_log"]:
                        text = engine.tokenizer.decode(r["probe"], skip_special_tokens=True)
                        rounds.append({**r, "agrees_full": first_words_agree(text, full_text)})
                    row = {"task": task, "index": i, "method": m, "full": full_text, "full_min_p": full_min_p,
                           "score_full": scorer_for(task)(full_text, sample.answers), "rounds": rounds,
                           "full_s": full_s, "rounds_s": rounds_s, "n_context": layout.n_context}
                    f.write(json.dumps(row) + "\n")
                    f.flush()
                    print(task, i, m, [(x["ratio"], x["kl"], x["agrees_full"]) for x in rounds], flush=True)
    return [json.loads(x) for x in path.read_text().splitlines()]


def _samples(engine, args, keys):
    """The samples (task, index) in ``keys``, regenerated as `collect` made them -> {(task, index): (sample, cfg)}."""
    cfg = EvalConfig(tasks=sorted({t for t, _ in keys}), lengths=[args.length], methods=[], ratios=[], n=args.n,
                     seed=args.seed, chunk_tokens=args.chunk_tokens, haystack=resolve_haystack(args.haystack))

    def count(text: str) -> int:
        return len(engine.tokenizer.encode(text, add_special_tokens=False))

    out = {}
    for task in cfg.tasks:
        n = 1 + max(i for t, i in keys if t == task)
        for i, sample in enumerate(generate(task, n, args.length, cfg.chunk_tokens, args.seed, count, haystack=cfg.haystack)):
            if (task, i) in keys:
                out[(task, i)] = (sample, cfg)
    return out


def _per_short_prompt(engine, args, rows: list[dict], name: str, make) -> list[dict]:
    """Resumable JSON lines ``name`` in ``--out``: one row per sample of ``rows`` and m in ``--verify-chunks``,
    ``{task, index, m, **make(layout, task, index, m)}``."""
    path = Path(args.out) / name
    done = set()
    if path.exists():
        done = {(r["task"], r["index"], r["m"]) for r in map(json.loads, path.read_text().splitlines())}
    ms = [int(x) for x in args.verify_chunks.split(",")]
    todo = {(r["task"], r["index"]) for r in rows if any((r["task"], r["index"], m) not in done for m in ms)}
    with path.open("a") as f:
        for (task, i), (sample, cfg) in sorted(_samples(engine, args, todo).items()):
            layout = sample_layout(engine, sample)
            for m in ms:
                if (task, i, m) in done:
                    continue
                row = {"task": task, "index": i, "m": m, **make(layout, task, i, m)}
                f.write(json.dumps(row) + "\n")
                f.flush()
                print(name, task, i, m, str(row)[:200], flush=True)
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def collect_verify(engine, args, rows: list[dict]) -> list[dict]:
    """verify.jsonl: per sample of ``rows`` and m in ``--verify-chunks``, the short prompt's greedy answer."""
    from kvstitch.engine.budget import reference_answer

    def make(layout, task, i, m):
        t0 = time.perf_counter()
        ref = reference_answer(engine, layout, m, args.probe_tokens)
        return {"answer": ref.text, "chunks": ref.chunks, "n_context": ref.n_context,
                "seconds": time.perf_counter() - t0}

    return _per_short_prompt(engine, args, rows, "verify.jsonl", make)


def collect_verify_probs(engine, args, rows: list[dict]) -> list[dict]:
    """verify_probs.jsonl: per sample of ``rows`` and m in ``--verify-chunks``, the short prompt's probability of
    every token of every logged round's probe (teacher-forced): what a test "does the short prompt find the
    round's answer plausible" would see (replayed as `verify_p`; not an `AutoBudget` option, see the README)."""
    from kvstitch.engine.budget import ShortPrompt

    by_key: dict[tuple, list[dict]] = {}
    for r in rows:
        by_key.setdefault((r["task"], r["index"]), []).append(r)

    def make(layout, task, i, m):
        short = ShortPrompt(engine, layout, m, args.probe_tokens)
        return {"probs": {row["method"]: {f"{r['ratio']:.4f}": [round(float(x), 6) for x in short.probs_given(r["probe"])]
                                          for r in row["rounds"]} for row in by_key[(task, i)]}}

    return _per_short_prompt(engine, args, rows, "verify_probs.jsonl", make)


def _tally(outcomes: list[tuple[dict | None, float]]) -> dict:
    """(the round auto stopped at, or None: full prefill answers after the rounds; the rounds' work) per sample
    -> agreement with full prefill, mean work (a fallback adds 1.0), fallback share."""
    n = max(len(outcomes), 1)
    return {"agreement": sum(True if stop is None else bool(stop["agrees_full"]) for stop, _ in outcomes) / n,
            "cost": sum(paid + (1.0 if stop is None else 0.0) for stop, paid in outcomes) / n,
            "fallback": sum(stop is None for stop, _ in outcomes) / n}


def replay_verify(rows: list[dict], verify: dict, schedule: tuple[float, ...], m: int, tokenizer) -> dict:
    """`auto` in refresh mode with ``verify_chunks`` = m: the first round of ``schedule`` whose probe agrees with
    the short prompt's answer is accepted, else full prefill. Cost = the short prompt's context tokens + the
    rounds' budgets (+ 1 for a fallback), per context token. -> agreement, mean work, fallback share."""
    outcomes = []
    for row in rows:
        ref = verify[(row["task"], row["index"], m)]
        paid, stop = ref["n_context"] / row["n_context"], None
        for s in schedule:
            r = next(r for r in row["rounds"] if abs(r["ratio"] - s) < 2e-3)
            paid += r["ratio"]
            if first_words_agree(tokenizer.decode(r["probe"], skip_special_tokens=True), ref["answer"]):
                stop = r
                break
        outcomes.append((stop, paid))
    return _tally(outcomes)


VERIFY_PS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5)


def replay_verify_p(rows: list[dict], verify: dict, probs: dict, schedule: tuple[float, ...], m: int, tau: float,
                    n_tokens: int) -> dict:
    """`auto` with ``verify_p`` = tau: the first round of ``schedule`` whose probe's first ``n_tokens`` tokens
    all have probability >= tau under the short prompt (m chunks) is accepted, else full prefill."""
    outcomes = []
    for row in rows:
        ref = verify[(row["task"], row["index"], m)]
        p = probs[(row["task"], row["index"], m)]["probs"][row["method"]]
        paid, stop = ref["n_context"] / row["n_context"], None
        for s in schedule:
            r = next(r for r in row["rounds"] if abs(r["ratio"] - s) < 2e-3)
            paid += r["ratio"]
            if min(p[f"{r['ratio']:.4f}"][:n_tokens], default=0.0) >= tau:
                stop = r
                break
        outcomes.append((stop, paid))
    return _tally(outcomes)


def _frontier_row(cells: list, v: dict, front) -> str:
    """A markdown row: ``cells``, then the replay ``v``'s agreement, work speed-up, fallback share, the
    perfect-signal frontier's speed-up at that agreement and the share of it reached."""
    from kvstitch.eval.calibrate import frontier_at

    speed, f = 1.0 / v["cost"], frontier_at(front, v["agreement"])
    return (f"| {' | '.join(map(str, cells))} | {v['agreement']:.2f} | {speed:.2f}x | {v['fallback']:.2f} | "
            f"{'–' if f is None else f'{f:.2f}x'} | {'–' if not f else f'{speed / f:.2f}'} |")


def verify_p_section(mrows: list[dict], verify_rows: list[dict], prob_rows: list[dict], m: str) -> list[str]:
    """`auto` with the plausibility test (`verify_p`) replayed over one-round schedules and thresholds."""
    from kvstitch.eval.calibrate import perfect_frontier

    verify = {(r["task"], r["index"], r["m"]): r for r in verify_rows}
    probs = {(r["task"], r["index"], r["m"]): r for r in prob_rows}
    ks = sorted({r["m"] for r in prob_rows})
    have = [row for row in mrows if all((row["task"], row["index"], k) in probs and (row["task"], row["index"], k)
                                        in verify for k in ks)]
    if not have:
        return []
    ratios = [r["ratio"] for r in have[0]["rounds"]]
    front = perfect_frontier(frontier_rows(have), [f"r{x:.2f}" for x in ratios])
    lines = ["", f"### {m}: verification by plausibility under the short prompt (`verify_p`, n = {len(have)})", "",
             "A round is accepted when each of its probe's first tokens has probability >= p under the short "
             "prompt (teacher-forced), not only when the short prompt's own greedy answer equals it.", "",
             "| m | round | probe tokens | p | agreement | speed-up (work) | fallback | frontier at that agreement | share |",
             "|---|---|---|---|---|---|---|---|---|"]
    for k in ks:
        for x in ratios[:2]:
            for n_tok in (16, 64):
                for tau in VERIFY_PS:
                    v = replay_verify_p(have, verify, probs, (x,), k, tau, n_tok)
                    lines.append(_frontier_row([k, f"{round(x, 2):g}", n_tok, f"{tau:g}"], v, front))
    return lines


def verify_section(mrows: list[dict], verify_rows: list[dict], m: str, tokenizer) -> list[str]:
    """`auto` with the verification replayed over every schedule of one or two logged rounds, against the
    perfect-signal frontier at equal agreement."""
    from itertools import combinations

    from kvstitch.eval.calibrate import perfect_frontier

    verify = {(r["task"], r["index"], r["m"]): r for r in verify_rows}
    have = [row for row in mrows if all((row["task"], row["index"], k) in verify for k in {r["m"] for r in verify_rows})]
    if not have:
        return []
    ratios = [r["ratio"] for r in have[0]["rounds"]]
    front = perfect_frontier(frontier_rows(have), [f"r{x:.2f}" for x in ratios])
    short = {k: sum(verify[(row["task"], row["index"], k)]["n_context"] / row["n_context"] for row in have) / len(have)
             for k in sorted({r["m"] for r in verify_rows})}
    agree_full = {k: sum(first_words_agree(verify[(row["task"], row["index"], k)]["answer"], row["full"])
                         for row in have) / len(have) for k in short}
    lines = ["", f"### {m}: verification by a short full prefill (n = {len(have)})", "",
             "The short prompt's own answer equals full prefill's on "
             + ", ".join(f"{agree_full[k]:.2f} (m = {k}, {short[k]:.3f} of the context)" for k in short)
             + " of the samples.", "",
             "| m | schedule | agreement | speed-up (work) | fallback | frontier at that agreement | share |",
             "|---|---|---|---|---|---|---|"]
    for k in short:
        for n_r in (1, 2):
            for sched in combinations(ratios, n_r):
                v = replay_verify(have, verify, sched, k, tokenizer)
                lines.append(_frontier_row([k, "/".join(f"{round(x, 2):g}" for x in sched)], v, front))
    return lines


def replay(rows: list[dict], tol: float, patience: int, ceiling: float, mode: str) -> dict:
    """Where auto would stop for each row with rounds up to ``ceiling`` then full prefill, its agreement with
    full and its cost in recomputed fractions (refresh rounds each pay their whole budget, incremental rounds
    only their new tokens; a fallback adds 1.0 for the full prefill)."""
    agree, cost, used = [], [], []
    for row in rows:
        rounds = [r for r in row["rounds"] if r["ratio"] <= ceiling + 1e-3]
        streak, stop, paid = 0, None, 0.0
        for j, r in enumerate(rounds):
            # the logged ratio is the round's whole set: refresh pays it again, incremental only the new part
            paid += r["ratio"] if mode == "refresh" else r["ratio"] - (rounds[j - 1]["ratio"] if j else 0.0)
            ok = r["agreed"] is not None and r["kl"] is not None and r["kl"] < tol and r.get("first_divergence") is None
            streak = streak + 1 if ok else 0
            if streak >= patience:
                stop = j
                break
        if stop is None:  # fallback: full prefill answers, after paying for every round
            agree.append(True)
            used.append(1.0)
            cost.append(paid + 1.0)
        else:
            agree.append(bool(rounds[stop]["agrees_full"]))
            used.append(rounds[stop]["ratio"])
            cost.append(paid)
    n = max(len(rows), 1)
    return {"agreement": sum(agree) / n, "ratio_used": sum(used) / n, "cost": sum(cost) / n,
            "fallback": sum(u == 1.0 for u in used) / n}


def oracle_cost(rows: list[dict]) -> float:
    """Mean cost if a perfect signal knew the smallest scheduled ratio whose answer agrees (else full)."""
    return sum(next((r["ratio"] for r in row["rounds"] if r["agrees_full"]), 1.0) for row in rows) / max(len(rows), 1)


MIN_PS = (0.3, 0.5, 0.7, 0.8, 0.9, 0.95)


def replay_signal(rows: list[dict], schedule: tuple[float, ...], min_p: float | None, tol: float | None) -> dict:
    """`auto` in refresh mode with the rounds ``schedule`` (a subset of the logged rounds: each refresh round is
    a fixed-ratio prefill at its budget, so any subset replays exactly) and the signals: confidence (the round's
    probe min p >= ``min_p``) and/or the KL test (``tol``; only between rounds adjacent in the log, where it was
    measured). Not converged: full prefill answers after the rounds. -> agreement, mean work, fallback share."""
    outcomes = []
    for row in rows:
        logged = row["rounds"]
        idx = [next(i for i, r in enumerate(logged) if abs(r["ratio"] - s) < 2e-3) for s in schedule]
        paid, stop = 0.0, None
        for k, i in enumerate(idx):
            r = logged[i]
            paid += r["ratio"]
            sure = min_p is not None and r["min_p"] >= min_p
            adjacent = k > 0 and idx[k - 1] == i - 1
            same = tol is not None and adjacent and r["kl"] is not None and r["kl"] < tol \
                and r.get("first_divergence") is None
            if sure or same:
                stop = r
                break
        outcomes.append((stop, paid))
    return _tally(outcomes)


def frontier_rows(rows: list[dict]) -> list[dict]:
    """The logged rounds as `kvstitch.eval.calibrate` rows (time = recompute work, full prefill = 1) so its
    perfect-signal frontier applies: per sample, the cheapest agreeing fixed ratio, else full prefill."""
    out = []
    for row in rows:
        key = f"{row['task']}#{row['index']}"
        out.append({"sample": key, "config": "full", "agree": True, "ttft_s": 1.0})
        out += [{"sample": key, "config": f"r{r['ratio']:.2f}", "agree": r["agrees_full"], "ttft_s": r["ratio"]}
                for r in row["rounds"]]
    return out


def signal_section(mrows: list[dict], m: str, out: Path) -> list[str]:
    """Confidence and KL signals replayed over every schedule of the logged rounds, against the perfect-signal
    frontier at equal agreement; draws ``frontier_<m>.png``."""
    from itertools import combinations

    from kvstitch.eval.calibrate import frontier_at, perfect_frontier, plot

    ratios = [r["ratio"] for r in mrows[0]["rounds"]]
    fr = frontier_rows(mrows)
    front = perfect_frontier(fr, [f"r{x:.2f}" for x in ratios])
    table = []
    for k in (1, 2):
        for sched in combinations(ratios, k):
            for min_p in (*MIN_PS, None):
                for tol in ((None,) if k == 1 else (None, 0.01, 0.05, float("inf"))):
                    if min_p is None and tol is None:
                        continue
                    s = replay_signal(mrows, sched, min_p, tol)
                    speed = 1.0 / s["cost"]
                    f = frontier_at(front, s["agreement"])
                    label = "/".join(f"{round(x, 2):g}" for x in sched) + (f" p>={min_p}" if min_p is not None else "") \
                        + (f" kl<{tol}" if tol is not None else "")
                    table.append({"config": label, "agreement": s["agreement"], "speedup": speed,
                                  "fallback": s["fallback"], "frontier": f, "share": speed / f if f else None})
    table.sort(key=lambda r: (-r["agreement"], -r["speedup"]))
    pareto, best = [], 0.0
    for r in table:  # keep the settings no other beats on both agreement and speed
        if r["speedup"] > best + 1e-9:
            pareto.append(r)
            best = r["speedup"]
    lines = ["", f"### {m}: signals replayed (work-based speed-up = 1 / mean recompute work; full prefill = 1)", "",
             "Perfect-signal frontier (agreement: speed-up): "
             + ", ".join(f"{a:.2f}: {x:.2f}x" for a, x in front[:8]), "",
             "Settings on the Pareto front of the replay (no other is both faster and more often in agreement):", "",
             "| schedule / signal | agreement | speed-up | fallback | frontier at that agreement | share |",
             "|---|---|---|---|---|---|"]
    for r in pareto:
        f = "–" if r["frontier"] is None else f"{r['frontier']:.2f}x"
        sh = "–" if r["share"] is None else f"{r['share']:.2f}"
        lines.append(f"| {r['config']} | {r['agreement']:.2f} | {r['speedup']:.2f}x | {r['fallback']:.2f} | {f} | {sh} |")
    fixed = [{"config": f"{m}@{round(x, 2):g}", "agreement": sum(rw["rounds"][j]["agrees_full"] for rw in mrows) / len(mrows),
              "speedup": 1.0 / x} for j, x in enumerate(ratios)]
    pts = [{"config": f"{m}@auto({r['config']})", "agreement": r["agreement"], "speedup": r["speedup"]} for r in pareto]
    plot(fixed + pts, {m: front}, out / f"frontier_{m}.png", chosen=pts[0]["config"] if pts else "",
         xlabel="speed-up vs full prefill in recompute work (1 / mean fraction recomputed)")
    return lines


def report(rows: list[dict], args, verify_rows: list[dict] | None = None, tokenizer=None,
           prob_rows: list[dict] | None = None) -> str:
    lines = ["# auto: convergence-signal calibration", "",
             "`python scripts/calibrate_auto.py "
             + (f"--model {args.model} " if args.model else "")
             + (f"--haystack {args.haystack} " if args.haystack != "synthetic" else "")
             + f"--seed {args.seed} --n {args.n} --length {args.length} "
             f"--tasks {args.tasks} --methods {args.methods} --mode {args.mode} --schedule {args.schedule} "
             + (f"--verify-chunks {args.verify_chunks} " if args.verify_chunks else "")
             + f"--out {args.out}`", "",
             f"Mode `{args.mode}`. Agreement = the answer's first 12 words equal full prefill's. Cost = context "
             "tokens recomputed over all rounds / context tokens (a fallback adds 1.0: the full prefill); "
             "speed-up ~ 1 / cost.", ""]
    for m in args.methods.split(","):
        mrows = [r for r in rows if r["method"] == m]
        if not mrows:
            continue
        lines += [f"## {m} (n = {len(mrows)})", "", "Each round alone (what a fixed ratio gives):", "",
                  "| ratio | agrees with full |", "|---|---|"]
        for j, r in enumerate(mrows[0]["rounds"]):
            a = [row["rounds"][j]["agrees_full"] for row in mrows if len(row["rounds"]) > j]
            lines.append(f"| {r['ratio']:.2f} | {sum(a) / max(len(a), 1):.2f} |")
        lines += ["", f"A perfect signal (stop at the smallest agreeing round, else full prefill): 100% agreement at "
                      f"mean cost {oracle_cost(mrows):.2f}.", "",
                  "| rounds up to | tol | patience | agreement | mean ratio used | mean cost | fallback |",
                  "|---|---|---|---|---|---|---|"]
        for ceiling in sorted({r["ratio"] for r in mrows[0]["rounds"]})[1:]:
            for patience in (1, 2):
                for tol in TOLS:
                    s = replay(mrows, tol, patience, ceiling, args.mode)
                    lines.append(f"| {ceiling:.2f} | {tol} | {patience} | {s['agreement']:.2f} | {s['ratio_used']:.3f} "
                                 f"| {s['cost']:.3f} | {s['fallback']:.2f} |")
        lines += signal_section(mrows, m, Path(args.out))
        if verify_rows:
            lines += verify_section(mrows, verify_rows, m, tokenizer)
            if prob_rows:
                lines += verify_p_section(mrows, verify_rows, prob_rows, m)
        lines.append("")
    return "\n".join(lines) + "\n"


def load_tokenizer(model: str | None):
    """The model's tokenizer alone (decoding logged probes without loading the weights)."""
    from transformers import AutoTokenizer

    from kvstitch.models.loader import resolve_model

    return AutoTokenizer.from_pretrained(str(resolve_model(model)[0]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tasks", default="niah_multikey,niah_multivalue,niah_multiquery")
    ap.add_argument("--methods", default="prophet,infoflow")
    ap.add_argument("--n", type=int, default=12)
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--chunk-tokens", type=int, default=256)
    ap.add_argument("--skip", type=int, default=0, help="leave out the first SKIP samples of each task (sharding)")
    ap.add_argument("--haystack", default="synthetic", help="NIAH haystack: synthetic (earlier runs) or essays")
    ap.add_argument("--model", default=None, help="embedded model name or path (default: the default model)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--probe-tokens", type=int, default=16)
    ap.add_argument("--schedule", default="0.05,0.1,0.2,0.4,0.7")
    ap.add_argument("--mode", default="refresh", choices=["incremental", "refresh"])
    ap.add_argument("--report-only", action="store_true", help="rewrite calibration.md from rounds.jsonl")
    ap.add_argument("--verify-chunks", default=None, help="comma-separated m: the verification's short prompts "
                    "(chunks kept) for every sample in rounds.jsonl, and its replay")
    ap.add_argument("--verify-probs", action="store_true", help="with --verify-chunks: also the short prompts' "
                    "probability of every logged probe token (verify_probs.jsonl), and the replay of `verify_p`")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default="docs/results/auto-calibration")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    engine = None if args.report_only else Engine.load(args.model, stitch_adapter=None)
    if args.report_only or args.verify_chunks:  # the verification runs over the samples already logged
        rows = [json.loads(x) for x in Path(args.out, "rounds.jsonl").read_text().splitlines()]
    else:
        rows = collect(engine, args)
    verify_rows, tokenizer = None, None
    if Path(args.out, "verify.jsonl").exists() or args.verify_chunks:
        if args.verify_chunks:
            verify_rows = collect_verify(engine, args, rows)
        else:
            verify_rows = [json.loads(x) for x in Path(args.out, "verify.jsonl").read_text().splitlines()]
        tokenizer = engine.tokenizer if engine is not None else load_tokenizer(args.model)
    prob_rows = None
    if args.verify_probs and args.verify_chunks and not args.report_only:
        prob_rows = collect_verify_probs(engine, args, rows)
    elif Path(args.out, "verify_probs.jsonl").exists():
        prob_rows = [json.loads(x) for x in Path(args.out, "verify_probs.jsonl").read_text().splitlines()]
    text = report(rows, args, verify_rows, tokenizer, prob_rows)
    Path(args.out, "calibration.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
