"""The stitch adapter pilot table: each adapter form (a `kvstitch adapt` run) against the same evaluation samples
without an adapter, at every (method, ratio) the evaluation ran, with what training cost.

    python scripts/adapter_pilot.py --eval none=EVAL_DIR --eval links=EVAL_DIR:ADAPT_DIR ... --out DIR

"answer NLL − full's": the mean NLL per token of full prefill's answer under the method, less full prefill's own
(the eval's NLL-gap recovery is measured against naive reuse, which an adapter changes too). Each
``--eval LABEL=EVAL_DIR[:ADAPT_DIR]`` is a `kvstitch eval --out` directory (the adapter's run directory after
the colon: its steps, CPU-hours, size and validation curve). Rows are paired on the samples every evaluation has.
Writes DIR/pilot.md (the command above the tables) and DIR/pilot.json.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
from pathlib import Path

from kvstitch.eval.rows import mean_ci_cell, read_jsonl


def parse_eval(text: str) -> tuple[str, Path, Path | None]:
    label, _, rest = text.partition("=")
    run, _, adapt = rest.partition(":")
    if not label or not run:
        raise SystemExit(f"--eval takes LABEL=EVAL_DIR[:ADAPT_DIR], got {text!r}")
    return label, Path(run), Path(adapt) if adapt else None


def training(adapt: Path | None) -> dict:
    """The adapter's card (`kvstitch adapt` writes adapter.json beside the adapter) and the validation KL at its
    first and last evaluation (loss.jsonl)."""
    if adapt is None:
        return {}
    card_path = adapt / "adapter.json"
    if card_path.exists():
        card = json.loads(card_path.read_text())
    else:
        from kvstitch.adapt.train import adapter_card

        card = adapter_card(adapt / "adapter.safetensors")
    rows = [json.loads(line) for line in (adapt / "loss.jsonl").read_text().splitlines() if line.strip()]
    val = [r for r in rows if r.get("val") is not None]
    return {**card, "mb": round(card["bytes"] / 1e6, 2), "val_first": val[0]["val"] if val else None,
            "val_last": val[-1]["val"] if val else None, "val_last_step": val[-1]["step"] if val else None}


def rows_of(run: Path) -> dict[tuple, dict]:
    return {(r["qid"], r["method"], r.get("ratio")): r for r in read_jsonl(run / "results.jsonl")}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--eval", action="append", required=True, help="LABEL=EVAL_DIR[:ADAPT_DIR] (repeatable)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    evals = [parse_eval(e) for e in args.eval]
    runs = {label: rows_of(run) for label, run, _ in evals}
    full = {k[0]: r for rows in runs.values() for k, r in rows.items() if k[1] == "full"}
    qids = set.intersection(*({k[0] for k in rows} for rows in runs.values()))
    combos = sorted({(k[1], k[2]) for rows in runs.values() for k in rows if k[1] != "full"},
                    key=lambda mr: (mr[0] != "naive", mr[0], mr[1] or 0))
    right = sorted(q for q in qids if full[q]["correct"])
    table = ["| adapter | method | ratio | n | KL to full | same answer as full | answers kept (of "
             f"{len(right)}) | answer NLL − full's | TTFT speed-up (median) |", "|---|---|---|---|---|---|---|---|---|"]
    out = {"n": len(qids), "full_right": len(right), "rows": [], "training": {}}
    for label, _, adapt in evals:
        out["training"][label] = training(adapt)
        for m, r in combos:
            got = [runs[label].get((q, m, r)) for q in sorted(qids)]
            got = [g for g in got if g is not None]
            if len(got) < len(qids):
                continue
            kl = statistics.fmean(g["kl"] for g in got)
            same = [float(bool(g["agree_words"])) for g in got]
            kept = [float(bool(runs[label][(q, m, r)]["correct"])) for q in right]
            gap = statistics.fmean(g["nll"] - g["nll_full"] for g in got)
            own_full = runs[label]  # TTFT ratios within one run (one process, one load on the machine)
            speed = statistics.median(own_full[(g["qid"], "full", None)]["ttft_s"] / g["ttft_s"] for g in got)
            ratio = "–" if r is None else f"{r:.2f}"
            table.append(f"| {label} | {m} | {ratio} | {len(got)} | {kl:.3f} | {mean_ci_cell(same, 2)} | "
                         f"{mean_ci_cell(kept, 2) if kept else '–'} | {gap:.3f} | {speed:.2f} |")
            out["rows"].append({"adapter": label, "method": m, "ratio": r, "n": len(got), "kl": kl,
                                "same": statistics.fmean(same), "kept": statistics.fmean(kept) if kept else None,
                                "nll_gap": gap, "speedup_median": speed})
    cost = ["| adapter | form | steps | CPU-hours | parameters | file MB | validation KL (step 0 → last) |",
            "|---|---|---|---|---|---|---|"]
    for label, t in out["training"].items():
        if t:
            cost.append(f"| {label} | {t['form']} | {t['steps']} | {t['cpu_hours']:.2f} | {t['parameters']:,} | "
                        f"{t['mb']:.2f} | {t['val_first']:.4f} → {t['val_last']:.4f} (step {t['val_last_step']}) |")
    command = "python scripts/adapter_pilot.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    args.out.mkdir(parents=True, exist_ok=True)
    text = [f"Written by `{command}`.", "", f"n = {len(qids)} questions, {len(right)} answered right by full prefill.",
            "", *table, "", "Training (`kvstitch adapt`; CPU-hours = wall time x threads):", "", *cost, ""]
    (args.out / "pilot.md").write_text("\n".join(text), encoding="utf-8")
    (args.out / "pilot.json").write_text(json.dumps(out, indent=1), encoding="utf-8")
    print("\n".join(text))


if __name__ == "__main__":
    main()
