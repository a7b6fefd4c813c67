"""Summaries of evaluation results: the tables of ``summary.md`` and `write_reports`, which writes them with the
plots (`eval/plots.py`).

A result row is a flat dict, one per (sample, method, ratio): `task, method, ratio, length, depth`,
`score` in [0, 1], and where measured `kl, nll, nll_recovery, ttft_s, overlap`. Missing or None values
are skipped in means, so rows from runs that measured different things can be mixed.
"""

from __future__ import annotations

import math
import os
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .plots import PANELS, plot_accuracy_vs_ratio  # noqa: F401  (part of this module's API)
from .plots import plot_niah_heatmap, plot_pareto, plot_vs_ratio
from .rows import (REFERENCES, as_number, mean_of, median_of, method_key, ratio_key, ratio_cell, fmt_num,
                   bootstrap_mean_ci, bootstrap_ratio_ci, fmt_ci, sample_id, group_rows, norm_ratio,
                   sample_key, ratio_of_means, mean_ci_cell, ttft_speedup)
from .rows import naive_nll_by_sample, pooled_recovery, pooled_recovery_ci  # noqa: F401  (part of this module's API)


# ---------------------------------------------------------------------------------------------------
# Table
# ---------------------------------------------------------------------------------------------------

def _full_by_sample(full_rows: dict) -> dict[tuple, float | None]:
    """Full prefill's score per sample (`sample_id`); None when a sample has several full rows (ambiguous)."""
    out: dict[tuple, float | None] = {}
    for g in full_rows.values():
        for r in g:
            sid = sample_id(r)
            out[sid] = None if sid in out else as_number(r.get("score"))
    return out


def _pct(score: float, ref: float | None) -> float:
    return 100 * score / ref if ref is not None and not math.isnan(score) and ref and ref > 0 else math.nan


def summary_table(rows: Sequence[dict]) -> str:
    """Markdown table per task / method / ratio: mean score x100, % of the `full` score on the same task,
    mean KL vs full, mean NLL-gap recovery, median TTFT; score, % full, KL and NLL rec. carry a 95% percentile
    bootstrap interval over the samples (`bootstrap_mean_ci`; % full paired with full prefill's score on
    the same samples, `bootstrap_ratio_ci`). A final `avg` block averages the per-task means (RULER's
    "Avg." column), with % of full taken over the same tasks; its intervals resample each task apart."""
    groups = group_rows(rows, "task", "method", "ratio")
    full_rows = group_rows((r for r in rows if r.get("method") == "full"), "task")
    full_score = {task: 100 * mean_of(r.get("score") for r in g) for (task,), g in full_rows.items()}
    full_by_sample = _full_by_sample(full_rows)

    def paired(g: list[dict]):
        """(method scores, full scores) on the same samples, or None when not every row has its full row."""
        m, f = [], []
        for r in g:
            ref, x = full_by_sample.get(sample_id(r)), as_number(r.get("score"))
            if ref is None or x is None:
                return None
            m.append(x)
            f.append(ref)
        return m, f

    cells = {k: {"n": len(g), "score": 100 * mean_of(r.get("score") for r in g),
                 "kl": mean_of(r.get("kl") for r in g), "rec": mean_of(r.get("nll_recovery") for r in g),
                 "ttft": median_of(r.get("ttft_s") for r in g), "rows": g, "pairs": paired(g)}
             for k, g in groups.items()}

    lines = ["| task | method | ratio | n | score [95% CI] | % full [95% CI] | KL [95% CI] | NLL rec. [95% CI] | "
             "TTFT med. (s) |",
             "|---|---|---|---|---|---|---|---|---|"]

    def emit(task: str, method: str, ratio: Any, c: dict, ref: float | None, parts: list[dict]) -> None:
        def ci(field: str):
            return bootstrap_mean_ci([[r.get(field) for r in p["rows"]] for p in parts])

        pairs = [p["pairs"] for p in parts]
        pct_ci = bootstrap_ratio_ci(pairs) if all(pr is not None for pr in pairs) else (math.nan, math.nan)
        lines.append(f"| {task} | {method} | {ratio_cell(ratio)} | {c['n']} | "
                     f"{fmt_ci(c['score'] / 100, ci('score'), 1, 100)} | "
                     f"{fmt_ci(_pct(c['score'], ref) / 100, pct_ci, 1, 100)} | {fmt_ci(c['kl'], ci('kl'), 4)} | "
                     f"{fmt_ci(c['rec'], ci('nll_recovery'), 2)} | {fmt_num(c['ttft'], 3)} |")

    order = sorted(cells, key=lambda k: (str(k[0]), method_key(str(k[1])), ratio_key(k[2])))
    for task, method, ratio in order:
        c = cells[(task, method, ratio)]
        emit(str(task), str(method), ratio, c, full_score.get(task), [c])

    by_combo: dict[tuple, list[tuple]] = defaultdict(list)
    for task, method, ratio in cells:
        by_combo[(method, ratio)].append(task)
    if len({k[0] for k in cells}) > 1:
        for method, ratio in sorted(by_combo, key=lambda k: (method_key(str(k[0])), ratio_key(k[1]))):
            tasks = by_combo[(method, ratio)]
            per = [cells[(t, method, ratio)] for t in tasks]
            avg = {"n": sum(c["n"] for c in per), **{f: mean_of(c[f] for c in per) for f in ("score", "kl", "rec")},
                   "ttft": median_of(r.get("ttft_s") for c in per for r in c["rows"])}
            ref_tasks = [full_score[t] for t in tasks if t in full_score]
            ref = mean_of(ref_tasks) if len(ref_tasks) == len(tasks) else None
            emit("avg", str(method), ratio, avg, ref, per)
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------------
# Reports
# ---------------------------------------------------------------------------------------------------

def _f(x: float, d: int = 3) -> str:
    return "–" if x is None or math.isnan(x) else f"{x:.{d}f}"



def fidelity_table(rows: Sequence[dict]) -> str:
    """Per method / ratio over all tasks: first-token and answer KL, NLL recovery, oracle overlap (each with
    its 95% bootstrap interval over the samples), median TTFT and its stages (seconds, warm chunk store), share of
    answers read off the teacher-forced pass."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        groups[(r.get("method"), norm_ratio(str(r.get("method")), r.get("ratio")))].append(r)
    naive_nll = naive_nll_by_sample(rows)
    lines = ["| method | ratio | n | KL first | KL answer | NLL (nats/tok) | NLL rec. (mean) | NLL rec. (pooled) | "
             "overlap w/ oracle | TTFT med. (s) | load | assemble | select | recompute |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def ci(g, field, digits):  # mean [95% CI]
        return mean_ci_cell([x.get(field) for x in g], digits)

    for key in sorted(groups, key=lambda k: (method_key(str(k[0])), ratio_key(k[1]))):
        g = groups[key]
        m, r = key
        lines.append(f"| {m} | {'–' if r is None else ratio_cell(r)} | {len(g)} | {ci(g, 'kl_first', 4)} | "
                     f"{ci(g, 'kl', 4)} | {ci(g, 'nll', 3)} | {ci(g, 'nll_recovery', 2)} | "
                     f"{fmt_ci(pooled_recovery(g, naive_nll), pooled_recovery_ci(g, naive_nll), 2)} | "
                     f"{ci(g, 'overlap', 2)} | "
                     f"{_f(median_of(x.get('ttft_s') for x in g))} | {_f(median_of(x.get('chunk_load_s') for x in g))} | "
                     f"{_f(median_of(x.get('assemble_s') for x in g))} | {_f(median_of(x.get('select_s') for x in g))} | "
                     f"{_f(median_of(x.get('recompute_s') for x in g))} |")
    return "\n".join(lines) + "\n"


def full_prefill_table(rows: Sequence[dict]) -> str:
    """Where full prefill itself fails: the `full` score per task and length, with the naive score."""
    cells: dict[tuple, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        if r.get("method") in REFERENCES:
            cells[(r["task"], r["length"])][r["method"]].append(r.get("score"))
    lengths = sorted({k[1] for k in cells})
    tasks = sorted({k[0] for k in cells})
    head = "| task | " + " | ".join(f"full @{L} | naive @{L}" for L in lengths) + " |"
    lines = [head, "|---|" + "---|---|" * len(lengths)]
    for t in tasks:
        parts = []
        for L in lengths:
            c = cells.get((t, L), {})
            parts.append(f"{_f(100 * mean_of(c.get('full', [])), 1)} (n={len(c.get('full', []))}) | "
                         f"{_f(100 * mean_of(c.get('naive', [])), 1)}")
        lines.append(f"| {t} | " + " | ".join(parts) + " |")
    return "\n".join(lines) + "\n"


def _binned(rows: Sequence[dict], bins: int) -> list[dict]:
    if bins <= 1:
        return list(rows)
    out = []
    for r in rows:
        d = r.get("depth")
        out.append({**r, "depth": None if d is None else round(round(float(d) * (bins - 1)) / (bins - 1), 3)})
    return out


def _used(row: dict) -> float | None:
    """Recomputed fraction of the context: the engine's ``ratio_used``, else recomputed / context tokens."""
    if row.get("ratio_used") is not None:
        return row["ratio_used"]
    return row["recomputed"] / row["n_tokens"] if row.get("recomputed") is not None and row.get("n_tokens") else None


def agreement_table(rows: Sequence[dict]) -> str:
    """Per method / ratio over all tasks: does the answer say what full prefill said (first 12 words; first
    token), at what cost (recomputed fraction of the context, rounds' total for ``auto``) and speed (`ttft_speedup`:
    the median over samples of full prefill's TTFT / the method's), with the pooled NLL-gap recovery beside it so one
    table carries the figures a reader compares. ``auto`` rows add how often they fell back to full."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        if r.get("agree_words") is not None:
            groups[(r.get("method"), norm_ratio(str(r.get("method")), r.get("ratio")))].append(r)
    lines = ["| method | ratio | n | agrees with full (12 words) | first token | score (% full) | "
             "NLL rec. (pooled) | ratio used | recompute cost | TTFT speed-up vs full | fell back to full |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    full_score = {(r["task"], r["index"]): r.get("score") for r in rows if r.get("method") == "full"}
    naive_nll = naive_nll_by_sample(rows)
    for key in sorted(groups, key=lambda k: (method_key(str(k[0])), ratio_key(k[1]))):
        g = groups[key]
        m, ratio = key
        agree = [float(bool(x["agree_words"])) for x in g]
        ref = [full_score.get((x["task"], x["index"])) for x in g]
        pct = ratio_of_means([x.get("score") for x in g], ref)
        falls = [x for x in g if x.get("converged") is not None]
        fell = (f"{sum(1 for x in falls if _fell_back(x)) / len(falls):.2f}"
                if falls else "–")
        lines.append(f"| {m} | {'–' if ratio is None else ratio_cell(ratio)} | {len(g)} | "
                     f"{mean_ci_cell(agree, 2)} | "
                     f"{fmt_num(mean_of(float(bool(x['agree_first'])) for x in g), 2)} | {fmt_num(100 * pct, 1)} | "
                     f"{fmt_ci(pooled_recovery(g, naive_nll), pooled_recovery_ci(g, naive_nll), 2)} | "
                     f"{fmt_num(mean_of(_used(x) for x in g), 3)} | "
                     f"{fmt_num(mean_of(x.get('recompute_cost') or _used(x) for x in g), 3)} | "
                     f"{fmt_num(ttft_speedup(g), 2)} | "
                     f"{fell} |")
    return "\n".join(lines) + "\n"


def _fell_back(row: dict) -> bool:
    """An ``auto`` row whose rounds did not settle and that answered with full prefill."""
    return row.get("converged") is False and (row.get("ratio_used") or 0) >= 1.0


def auto_table(rows: Sequence[dict]) -> str:
    """Per task and ``auto`` method: how many samples a stitched round answered (accepted, not fallen back to full
    prefill) and how many of those agree with full prefill; where `auto` pays and where its accepted rounds err."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        if r.get("ratio") == "auto" and r.get("converged") is not None and r.get("agree_words") is not None:
            groups[(r.get("task"), r.get("method"))].append(r)
    if not groups:
        return ""
    lines = ["| task | method | n | answered by a round | of those, agree with full | fell back to full |",
             "|---|---|---|---|---|---|"]
    for (task, m), g in sorted(groups.items(), key=lambda kv: (str(kv[0][0]), method_key(str(kv[0][1])))):
        accepted = [x for x in g if not _fell_back(x)]
        lines.append(f"| {task} | {m} | {len(g)} | {len(accepted)} | {sum(bool(x['agree_words']) for x in accepted)} | "
                     f"{len(g) - len(accepted)} |")
    return "\n".join(lines) + "\n"


def kept_table(rows: Sequence[dict]) -> str:
    """Per method / ratio: does it keep full prefill's answers? Agreement with full prefill's answer over all
    samples and over the samples full prefill answers correctly ("correct answers kept": same answer there),
    the share of those the method still answers correctly, the task score (QA F1 for real QA), exact match
    where measured, and the TTFT speed-up. Correct = a gold answer in the answer's first line (real QA),
    score 1 (RULER)."""
    full = {sample_key(r): r for r in rows if r.get("method") == "full"}
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        if r.get("agree_words") is not None and r.get("correct") is not None and sample_key(r) in full:
            groups[(r.get("method"), norm_ratio(str(r.get("method")), r.get("ratio")))].append(r)
    lines = ["| method | ratio | n | agrees with full (all) | full right | correct answers kept | still right | "
             "score x100 | exact match | TTFT speed-up |", "|---|---|---|---|---|---|---|---|---|---|"]
    for key in sorted(groups, key=lambda k: (method_key(str(k[0])), ratio_key(k[1]))):
        g = groups[key]
        m, ratio = key
        agree = [float(bool(x["agree_words"])) for x in g]
        right = [x for x in g if full[sample_key(x)].get("correct")]
        kept = [float(bool(x["agree_words"])) for x in right]
        still = [float(bool(x["correct"])) for x in right]
        em = [x.get("em") for x in g if x.get("em") is not None]
        lines.append(f"| {m} | {'–' if ratio is None else ratio_cell(ratio)} | {len(g)} | "
                     f"{mean_ci_cell(agree, 2)} | {len(right)} | "
                     f"{mean_ci_cell(kept, 2)} | "
                     f"{mean_ci_cell(still, 2)} | "
                     f"{fmt_num(100 * mean_of(x.get('score') for x in g), 1)} | "
                     f"{fmt_num(100 * mean_of(em), 1) if em else '–'} | "
                     f"{fmt_num(ttft_speedup(g), 2)} |")
    return "\n".join(lines) + "\n"


def paired_table(rows: Sequence[dict]) -> str:
    """Every two methods at the same fixed ratio, over the samples both ran: the difference in agreement with
    full prefill (12 words) and in pooled NLL-gap recovery, later method minus earlier (the summary's order),
    each with a *paired* 95% bootstrap interval (a sample's two rows resampled together, so what the samples
    share cancels: far narrower than comparing the two methods' own intervals). "" when no pair exists."""
    by: dict[tuple, dict[tuple, dict]] = defaultdict(dict)
    for r in rows:
        ratio = norm_ratio(str(r.get("method")), r.get("ratio"))
        if r.get("method") not in ("full", "naive") and as_number(ratio) is not None and r.get("agree_words") is not None:
            by[(r["method"], ratio)][sample_key(r)] = r  # `auto` rows spend different budgets: not paired here
    naive_nll = naive_nll_by_sample(rows)
    keys = sorted(by, key=lambda k: (ratio_key(k[1]), method_key(str(k[0]))))
    lines = []
    for i, (a, ra) in enumerate(keys):
        for b, rb in keys[i + 1:]:
            if ra != rb:
                continue
            shared = [k for k in by[(a, ra)] if k in by[(b, rb)]]
            if len(shared) < 2:
                continue
            pairs = [(by[(a, ra)][k], by[(b, rb)][k]) for k in shared]
            d_agree = [float(bool(y["agree_words"])) - float(bool(x["agree_words"])) for x, y in pairs]
            num, den = [], []  # pooled recovery of b minus a's: sum(nll_a - nll_b) / sum(naive - full)
            for k, (x, y) in zip(shared, pairs):
                if k in naive_nll and all(v.get("nll") is not None for v in (x, y)) and x.get("nll_full") is not None:
                    num.append(float(x["nll"]) - float(y["nll"]))
                    den.append(naive_nll[k] - float(x["nll_full"]))
            d_rec = sum(num) / sum(den) if den and abs(sum(den)) > 1e-9 else math.nan
            lines.append(f"| {b} − {a} | {ratio_cell(ra)} | {len(shared)} | "
                         f"{mean_ci_cell(d_agree, 2)} | "
                         f"{fmt_ci(d_rec, bootstrap_ratio_ci([(num, den)]), 2)} |")
    if not lines:
        return ""
    return "\n".join(["| difference | ratio | n (shared samples) | agrees with full | NLL rec. (pooled) |",
                      "|---|---|---|---|---|", *lines]) + "\n"


def _length_title(length: int, rows: Sequence[dict]) -> str:
    if length == 0:  # real QA datasets: one chunk per passage, no target length
        tokens = mean_of(r.get("n_tokens") for r in rows)
        return f"{', '.join(sorted({str(r['task']) for r in rows}))}: real passages (mean {fmt_num(tokens, 0)} context tokens)"
    return f"{length} tokens"



def machines_note(rows: Sequence[dict]) -> str:
    """A line naming the CPUs a run's samples were timed on, when more than one (a run resumed or sharded on
    other machines): its TTFT speed-ups then pool samples timed on each. '' for one CPU (or rows from before
    rows recorded theirs)."""
    samples: dict[str, set] = defaultdict(set)
    for r in rows:
        samples[r.get("cpu") or "not recorded"].add(sample_key(r))
    if len(samples) < 2:
        return ""
    named = "; ".join(f"{cpu}: {len(keys)} samples" for cpu, keys in sorted(samples.items()))
    return (f"**Timed on {len(samples)} machines** ({named}). Each sample's methods ran on one machine, so a "
            "per-sample speed-up is like for like; the pooled TTFT speed-ups mix machines.")


def write_reports(rows: Sequence[dict], out: str | os.PathLike, depth_bins: int = 5) -> dict[str, Path]:
    """summary.md + accuracy_vs_ratio_<L>.png per length + niah_heatmap.png (when NIAH rows with depths
    exist). -> written paths by name."""
    out = Path(out)
    rows = [r for r in rows if r.get("score") is not None]
    written: dict[str, Path] = {}
    if not rows:
        return written
    lengths = sorted({int(r["length"]) for r in rows})
    parts = ["# kvstitch eval summary", "",
             "Scores x100 (RULER string match; LongBench QA F1 on real QA datasets), % of the `full` score on the same task, mean KL(full || method) "
             "over the teacher-forced answer, NLL-gap recovery (1 = full, 0 = naive), TTFT with a warm chunk store; TTFT "
             "speed-up: the median over samples of full prefill's TTFT / the method's on the same sample. "
             "[lo, hi] = 95% percentile bootstrap interval over the samples (2000 resamples, fixed seed).",
             ""]
    for L in lengths:
        sub = [r for r in rows if int(r["length"]) == L]
        parts += [f"## {_length_title(L, sub)}", "", summary_table(sub), "", "Fidelity and time per stage (all tasks):", "",
                  fidelity_table(sub), ""]
        if any(r.get("agree_words") is not None for r in sub):
            parts += ["Agreement with full prefill and its cost (all tasks):", "", agreement_table(sub), ""]
            paired = paired_table(sub)
            if paired:
                parts += ["Two methods on the same samples, paired (all tasks):", "", paired, ""]
            auto = auto_table(sub)
            if auto:
                parts += ["`auto` per task: samples a stitched round answered, and whether it agreed:", "", auto, ""]
        for task in sorted({str(r["task"]) for r in sub if "answerable" in r}):  # SQuAD: answers kept
            from .qa_report import squad_sections

            text, plots = squad_sections([r for r in sub if r["task"] == task], out, task)
            parts += [f"### {task}: answers kept", "", *text]
            written.update(plots)
        if any(r.get("correct") is not None for r in sub):
            parts += ["Full prefill's answers kept (all tasks):", "", kept_table(sub), ""]
            written[f"pareto_{L}"] = plot_pareto(sub, out / f"pareto_{L}.png")
        written[f"accuracy_{L}"] = plot_vs_ratio(sub, out / f"accuracy_vs_ratio_{L}.png", ("score",))
        written[f"fidelity_{L}"] = plot_vs_ratio(sub, out / f"fidelity_vs_ratio_{L}.png", ("kl", "nll_recovery"))
    mixed = machines_note(rows)
    if mixed:
        parts += [mixed, ""]
    parts += ["## Full prefill itself (score x100)", "", full_prefill_table(rows), ""]
    niah = [r for r in rows if str(r.get("task", "")).startswith("niah") and r.get("depth") is not None]
    if niah:
        written["heatmap"] = plot_niah_heatmap(_binned(niah, depth_bins), out / "niah_heatmap.png")
    path = out / "summary.md"
    path.write_text("\n".join(parts))
    written["summary"] = path
    return written
