"""Stitch adapters side by side: each `kvstitch adapt` run against the same evaluation samples without an adapter,
at every (method, ratio) all the evaluations ran, with what training cost and how far each run's line of training
had come.

    python scripts/adapter_table.py --eval none=EVAL_DIR --eval links=EVAL_DIR:ADAPT_DIR ... --out DIR

Each ``--eval LABEL=EVAL_DIR[:ADAPT_DIR]`` is a `kvstitch eval --out` directory (the adapter's run directory after
the colon: its steps, CPU-hours, size and validation curve). Rows are paired on the samples every evaluation has.
"answer NLL − full's": the mean NLL per token of full prefill's answer under the method, less full prefill's own
(the eval's NLL-gap recovery is measured against naive reuse, which an adapter changes too).

A run started from another adapter (`kvstitch adapt --init`) continues that adapter's training: when the adapter
it started from is one the table evaluated (its digest in that evaluation's run.json), its steps and CPU-hours are
added, so "total" is what the whole line of training cost, and ``kept_vs_cpu_hours.png`` draws each setting's kept
answers and KL against it: the curve that shows where training stopped paying.
Writes DIR/adapters.md (the command above the tables), DIR/adapters.json and DIR/kept_vs_cpu_hours.png.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
from pathlib import Path

from kvstitch.core.figures import new_figure, save_png
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


def evaluated_digest(run: Path) -> str | None:
    """The digest of the adapter an evaluation ran with (None: no adapter)."""
    adapter = (json.loads((run / "run.json").read_text()).get("config") or {}).get("stitch_adapter")
    return adapter.get("sha256") if adapter else None


def lineage(labels: list[str], digests: dict[str, str | None], cards: dict[str, dict]) -> dict[str, dict]:
    """Per label: the label its training started from (`--init`, matched by digest), and the steps and CPU-hours
    of the whole line of training to it. None totals: it started from an adapter the table did not evaluate."""
    by_digest = {d: label for label, d in digests.items() if d}
    out: dict[str, dict] = {}

    def total(label: str, seen: tuple[str, ...]) -> dict:
        if label in out:
            return out[label]
        card = cards.get(label) or {}
        if not card:
            result = {"from": None, "steps": 0, "cpu_hours": 0.0} if digests.get(label) is None else \
                {"from": None, "steps": None, "cpu_hours": None}  # an adapter whose training is not given
        else:
            init = (card.get("config") or {}).get("init")
            parent = by_digest.get(init) if init else None
            if init and (parent is None or parent in seen):
                result = {"from": init, "steps": None, "cpu_hours": None}
            else:
                before = total(parent, seen + (label,)) if parent else {"steps": 0, "cpu_hours": 0.0}
                known = before["steps"] is not None
                result = {"from": parent, "steps": card["steps"] + before["steps"] if known else None,
                          "cpu_hours": card["cpu_hours"] + before["cpu_hours"] if known else None}
        out[label] = result
        return result

    for label in labels:
        total(label, ())
    return out


def plot_curve(rows: list[dict], totals: dict[str, dict], path: Path) -> Path | None:
    """Kept answers and KL to full prefill against the CPU-hours of each adapter's whole line of training, one
    colour per (method, ratio), each adapter joined to the one it was trained from (or to no adapter); adapters
    whose line of training is not all in the table are left out."""
    placed = [r for r in rows if totals[r["adapter"]]["cpu_hours"] is not None]
    if len({totals[r["adapter"]]["cpu_hours"] for r in placed}) < 2:
        return None
    start = next((label for label, t in totals.items() if t["steps"] == 0), None)  # the run without an adapter
    fig = new_figure(10.0, 3.8)
    kept_ax, kl_ax = fig.subplots(1, 2)
    settings = sorted({(r["method"], r["ratio"]) for r in placed}, key=lambda mr: (mr[0] != "naive", mr[1] or 0))
    for i, (method, ratio) in enumerate(settings):
        at = {r["adapter"]: (totals[r["adapter"]]["cpu_hours"], r) for r in placed
              if (r["method"], r["ratio"]) == (method, ratio)}
        name = "no recompute" if method == "naive" else f"{method} at {ratio:.0%}"
        for ax, field in ((kept_ax, "kept"), (kl_ax, "kl")):
            points = [(x, r[field]) for x, r in at.values() if r[field] is not None]
            ax.plot([x for x, _ in points], [y for _, y in points], "o", color=f"C{i}", label=name)
            for label, (x, r) in at.items():
                parent = totals[label]["from"] or (start if label != start else None)
                if parent in at and r[field] is not None and at[parent][1][field] is not None:
                    ax.plot([at[parent][0], x], [at[parent][1][field], r[field]], "-", color=f"C{i}")
        for label, (x, r) in at.items():
            kl_ax.annotate(label, (x, r["kl"]), fontsize=7, xytext=(3, 3), textcoords="offset points")
    kept_ax.set(xlabel="training CPU-hours (whole line)", ylabel="kept of full prefill's right answers",
                ylim=(0, 1.02))
    kl_ax.set(xlabel="training CPU-hours (whole line)", ylabel="KL to full prefill")
    kept_ax.legend(fontsize=8)
    for ax in (kept_ax, kl_ax):
        ax.grid(alpha=0.3)
    return save_png(fig, path)


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
    # the settings every evaluation ran (a run without the adapter may hold other methods too)
    common = set.intersection(*({(k[1], k[2]) for k in rows if k[1] != "full"} for rows in runs.values()))
    combos = sorted(common, key=lambda mr: (mr[0] != "naive", mr[0], mr[1] or 0))
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
    labels = [label for label, _, _ in evals]
    totals = lineage(labels, {label: evaluated_digest(run) for label, run, _ in evals}, out["training"])
    out["lineage"] = totals
    cost = ["| adapter | form | trained from | steps | CPU-hours | total steps | total CPU-hours | parameters | "
            "file MB | validation KL (step 0 → last) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for label, t in out["training"].items():
        if t:
            line = totals[label]
            whole = ("–", "–") if line["steps"] is None else (str(line["steps"]), f"{line['cpu_hours']:.2f}")
            val = "–" if t["val_first"] is None else \
                f"{t['val_first']:.4f} → {t['val_last']:.4f} (step {t['val_last_step']})"
            cost.append(f"| {label} | {t['form']} | {line['from'] or '–'} | {t['steps']} | {t['cpu_hours']:.2f} | "
                        f"{whole[0]} | {whole[1]} | {t['parameters']:,} | {t['mb']:.2f} | {val} |")
    command = "python scripts/adapter_table.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    args.out.mkdir(parents=True, exist_ok=True)
    curve = plot_curve(out["rows"], totals, args.out / "kept_vs_cpu_hours.png")
    text = [f"Written by `{command}`.", "", f"n = {len(qids)} questions, {len(right)} answered right by full prefill.",
            "", *table, "", "Training (`kvstitch adapt`; CPU-hours = wall time x threads; total: the whole line of "
            "training, from the adapter it started from):", "", *cost, ""]
    if curve is not None:
        text += [f"![kept and KL against training CPU-hours]({curve.name})", ""]
    (args.out / "adapters.md").write_text("\n".join(text), encoding="utf-8")
    (args.out / "adapters.json").write_text(json.dumps(out, indent=1), encoding="utf-8")
    print("\n".join(text))


if __name__ == "__main__":
    main()
