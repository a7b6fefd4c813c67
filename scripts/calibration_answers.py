"""Answers kept by each configuration of a `kvstitch calibrate` run on SQuAD (or any dataset with gold answers).

`kvstitch calibrate` judges a configuration by agreement with full prefill's first 12 words. On short factual
answers a user asks more: of the questions full prefill answers correctly, how many does the configuration still
answer correctly ("answers kept"), and how often is its answer the same once SQuAD-normalised ("same answer")?
This reads the run's rows.jsonl, the gold answers of the same samples, and writes ``answers.md`` beside it.

    python scripts/calibration_answers.py docs/results/squad/qwen0.5b-auto-tuning --dataset squad --passages 10
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path


def table(rows: list[dict], answers: dict[str, list[str]]) -> str:
    from kvstitch.eval.rows import bootstrap_mean_ci, fmt_ci, ratio_of_means
    from kvstitch.tasks.agreement import same_answer
    from kvstitch.tasks.grading import squad_correct

    full = {r["sample"]: r for r in rows if r["config"] == "full"}
    by = defaultdict(list)
    for r in rows:
        if r["config"] != "full" and r["sample"] in full and r["sample"] in answers:
            by[r["config"]].append(r)
    common = set.intersection(*({r["sample"] for r in g} for g in by.values())) if by else set()
    by = {cfg: [r for r in g if r["sample"] in common] for cfg, g in by.items()}  # one set of samples for all
    lines = ["| configuration | n | full right | answers kept | same answer | agrees (12 words) | fell back | "
             "accepted, not full's answer | TTFT speed-up |", "|---|---|---|---|---|---|---|---|---|"]
    for cfg in sorted(by):
        g = by[cfg]
        right = [r for r in g if squad_correct(full[r["sample"]]["pred"], answers[r["sample"]])]
        kept = [float(squad_correct(r["pred"], answers[r["sample"]])) for r in right]
        same = [float(same_answer(r["pred"], full[r["sample"]]["pred"])) for r in g]
        agree = [float(bool(r["agree"])) for r in g]
        # no round accepted: full prefill answered (or, with max_ratio < 1, a recompute of that ratio)
        fell = sum(1 for r in g if r.get("ratio") == "auto" and r.get("converged") is False)
        # the rounds' own answers `auto` accepted: how many are not what full prefill says
        accepted = [r for r in g if r.get("ratio") == "auto" and r.get("converged") is True]
        wrong = sum(1 for r in accepted if not same_answer(r["pred"], full[r["sample"]]["pred"]))
        false_accepts = f"{wrong} of {len(accepted)}" if accepted else "–"
        speed = ratio_of_means([r["ttft_full_s"] for r in g], [r["ttft_s"] for r in g])
        lines.append(f"| {cfg} | {len(g)} | {len(right)} | {fmt_ci(sum(kept) / len(kept), bootstrap_mean_ci([kept]), 2) if kept else '–'} | "
                     f"{fmt_ci(sum(same) / len(same), bootstrap_mean_ci([same]), 2)} | "
                     f"{sum(agree) / len(agree):.2f} | {fell} | {false_accepts} | {speed:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    from kvstitch.tasks.datasets import load_dataset

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", type=Path, help="a `kvstitch calibrate --out` directory")
    ap.add_argument("--dataset", required=True)
    ap.add_argument("--passages", type=int, default=None)
    args = ap.parse_args()
    rows = [json.loads(x) for x in (args.run / "rows.jsonl").read_text().splitlines() if x.strip()]
    samples = load_dataset(args.dataset, 0, None, passages=args.passages)
    answers = {f"{s.task}#{s.meta['index']}": s.answers for s in samples}
    cmd = (f"python scripts/calibration_answers.py {args.run} --dataset {args.dataset}"
           + (f" --passages {args.passages}" if args.passages else ""))
    text = ("# Answers kept per configuration\n\n" f"Written by `{cmd}` from rows.jsonl, over the samples every "
            "configuration ran (n). Answers kept: "
            "of the questions full prefill answers correctly, the share still answered correctly; same answer: "
            "SQuAD-normalised first lines equal; fell back: no round of `auto` was accepted, so full prefill answered (a "
            "recompute of max_ratio when that is below 1); accepted, not full's "
            "answer: of the answers `auto` accepted from its rounds, those not the same as full prefill's.\n\n"
            + table(rows, answers))
    (args.run / "answers.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
