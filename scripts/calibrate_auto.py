"""Calibrate the convergence signal of recompute_ratio="auto" on a seed the eval never uses.

For every sample: full prefill's greedy answer, then every round of the schedule run to the end (tol 0,
ceiling = the last scheduled ratio) with each method, logging per round the probe (greedy answer start) and
the KL to the previous round. Offline, for each (tol, patience) it replays where `auto` would have stopped
and whether the answer there agrees with full prefill's (first 12 words), and the cost (recomputed
fraction; a fallback costs the rounds plus a full prefill). Writes JSON lines + a markdown table.

    python scripts/calibrate_auto.py --seed 1 --n 12 --length 2048 --out docs/results/auto-calibration
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from kvstitch import Engine
from kvstitch.engine.budget import DEFAULT_SCHEDULE
from kvstitch.tasks import generate, scorer_for
from kvstitch.eval.agreement import first_words_agree
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
                     seed=args.seed)
    def count(text: str) -> int:
        return len(engine.tokenizer.encode(text, add_special_tokens=False))

    with path.open("a") as f:
        for task in cfg.tasks:
            for i, sample in enumerate(generate(task, args.n, args.length, 256, args.seed, count)):
                layout = sample_layout(engine, sample)
                budget = answer_budget(engine, sample, cfg)
                engine.chunk_kvs(layout)
                fpre = engine.prefill(layout, "full", 0.0, budget)
                full = list(engine.decode_tokens(fpre, budget))
                full_text = engine.tokenizer.decode(full, skip_special_tokens=True)
                fl = engine.teacher_force(fpre, torch.tensor(full))
                full_min_p = float(torch.softmax(fl, -1).gather(1, torch.tensor(full).view(-1, 1)).min())
                for m in args.methods.split(","):
                    if (task, i, m) in done:
                        continue
                    pre = engine.prefill(layout, m, "auto", budget,
                                         auto={"tol": 0.0, "max_ratio": max(schedule), "schedule": schedule,
                                               "probe_tokens": args.probe_tokens, "mode": args.mode})
                    rounds = []
                    for r in pre.stats["round_log"]:
                        text = engine.tokenizer.decode(r["probe"], skip_special_tokens=True)
                        rounds.append({**r, "agrees_full": first_words_agree(text, full_text)})
                    row = {"task": task, "index": i, "method": m, "full": full_text, "full_min_p": full_min_p,
                           "score_full": scorer_for(task)(full_text, sample.answers), "rounds": rounds}
                    f.write(json.dumps(row) + "\n")
                    f.flush()
                    print(task, i, m, [(x["ratio"], x["kl"], x["agrees_full"]) for x in rounds], flush=True)
    return [json.loads(x) for x in path.read_text().splitlines()]


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


def report(rows: list[dict], args) -> str:
    lines = ["# auto: convergence-signal calibration", "",
             f"`python scripts/calibrate_auto.py --seed {args.seed} --n {args.n} --length {args.length} "
             f"--tasks {args.tasks} --methods {args.methods} --mode {args.mode} --schedule {args.schedule} "
             f"--out {args.out}`", "",
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
        lines.append("")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tasks", default="niah_multikey,niah_multivalue,niah_multiquery")
    ap.add_argument("--methods", default="prophet,infoflow")
    ap.add_argument("--n", type=int, default=12)
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--probe-tokens", type=int, default=16)
    ap.add_argument("--schedule", default="0.05,0.1,0.2,0.4,0.7")
    ap.add_argument("--mode", default="refresh", choices=["incremental", "refresh"])
    ap.add_argument("--report-only", action="store_true", help="rewrite calibration.md from rounds.jsonl")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default="docs/results/auto-calibration")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.report_only:
        rows = [json.loads(x) for x in Path(args.out, "rounds.jsonl").read_text().splitlines()]
    else:
        rows = collect(Engine.load(), args)
    text = report(rows, args)
    Path(args.out, "calibration.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
