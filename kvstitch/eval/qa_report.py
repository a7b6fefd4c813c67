"""What a RAG user asks of the fast path on questions the model can answer (SQuAD rows, `kvstitch.tasks.squad`).

- `answers_table`: per method and ratio, of the questions full prefill answers correctly, the share the method
  still answers correctly ("answers kept"), with a 95% bootstrap interval; the same answer as full prefill's
  (SQuAD-normalised first line, on every question); F1 and EM as % of full prefill's; the TTFT speed-up.
- `abstention_table` (SQuAD v2.0): where full prefill abstains on an unanswerable question, how often the method
  abstains too, and how often it invents an answer.
- `paired_kept_table`: kvstitch's own method against every other at one ratio, on the questions full prefill
  answers correctly and both ran: the difference in answers kept, paired, with its interval (a method "ahead"
  needs the interval above 0).
- `auto_bound_table`: the most an adaptive budget over a method's fixed ratios can pay while always giving full
  prefill's answer, with a perfect verifier: what limits ``recompute_ratio="auto"`` on a model whose stitched
  answers seldom equal full prefill's.
- `plot_kept_by_position`: answers kept against the gold passage's position (lost in the middle);
  `kvstitch.eval.plots.plot_pareto` with ``y="kept"``: answers kept against the TTFT speed-up.
"""

from __future__ import annotations

import math
import os
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

from kvstitch.core.figures import new_figure, save_png
from kvstitch.tasks.agreement import same_answer
from .plots import plot_pareto
from .rows import (REFERENCES, fmt_num, mean_of, colour_cycle, ratio_cell, ratio_of_means, mean_ci_cell, method_key,
                  norm_ratio, ratio_key, sample_key, ttft_speedup)


def _by_method(rows: Sequence[dict]) -> tuple[dict, dict[tuple, list[dict]]]:
    full = {sample_key(r): r for r in rows if r.get("method") == "full"}
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        if r.get("correct") is not None and sample_key(r) in full:
            groups[(r.get("method"), norm_ratio(str(r.get("method")), r.get("ratio")))].append(r)
    return full, groups


def _order(groups):
    return sorted(groups, key=lambda k: (method_key(str(k[0])), ratio_key(k[1])))


def _pct_of_full(g: list[dict], full: dict, field: str) -> str:
    ours = mean_of(x.get(field) for x in g)
    theirs = mean_of(full[sample_key(x)].get(field) for x in g)
    return "–" if not theirs or math.isnan(theirs) else f"{100 * ours / theirs:.0f}%"


def answers_table(rows: Sequence[dict]) -> str:
    full, groups = _by_method([r for r in rows if r.get("answerable", True)])
    lines = ["| method | ratio | n | full right | answers kept | same answer as full | F1 % of full | EM % of full | "
             "TTFT speed-up | selection s |", "|---|---|---|---|---|---|---|---|---|---|"]
    for key in _order(groups):
        g = groups[key]
        m, ratio = key
        right = [x for x in g if full[sample_key(x)].get("correct")]
        kept = [float(bool(x["correct"])) for x in right]
        same = [float(same_answer(x.get("pred", ""), full[sample_key(x)].get("pred", ""))) for x in g]
        lines.append(f"| {m} | {'–' if ratio is None else ratio_cell(ratio)} | {len(g)} | {len(right)} | "
                     f"{mean_ci_cell(kept, 2)} | "
                     f"{mean_ci_cell(same, 2)} | {_pct_of_full(g, full, 'score')} | "
                     f"{_pct_of_full(g, full, 'em')} | "
                     f"{fmt_num(ttft_speedup(g), 2)} | "
                     f"{fmt_num(mean_of(x.get('select_s') for x in g), 3)} |")
    return "\n".join(lines) + "\n"


def abstention_table(rows: Sequence[dict]) -> str:
    """'' when the rows hold no unanswerable question."""
    unans = [r for r in rows if r.get("answerable") is False]
    if not unans:
        return ""
    full, groups = _by_method(unans)
    lines = ["| method | ratio | unanswerable | full abstains | abstentions kept | answers invented |",
             "|---|---|---|---|---|---|"]
    for key in _order(groups):
        g = groups[key]
        m, ratio = key
        abstained = [x for x in g if full[sample_key(x)].get("abstained")]
        kept = [float(bool(x.get("abstained"))) for x in abstained]
        invented = [1.0 - k for k in kept]
        lines.append(f"| {m} | {'–' if ratio is None else ratio_cell(ratio)} | {len(g)} | {len(abstained)} | "
                     f"{mean_ci_cell(kept, 3)} | "
                     f"{mean_ci_cell(invented, 3)} |")
    return "\n".join(lines) + "\n"


OWN = "deltaprop"  # kvstitch's own method: the paired table sets it against every other method


def paired_kept_table(rows: Sequence[dict]) -> str:
    """A - B in answers kept at each fixed ratio, paired on the questions full prefill gets right, for A each
    variant of kvstitch's own method (`OWN`) and B every other method at that ratio."""
    full, groups = _by_method([r for r in rows if r.get("answerable", True)])
    by = {k: {sample_key(x): float(bool(x["correct"])) for x in g if full[sample_key(x)].get("correct")}
          for k, g in groups.items() if k[0] not in REFERENCES}
    lines = ["| ratio | A | B | n | kept A | kept B | A - B |", "|---|---|---|---|---|---|---|"]
    keys = _order(by)
    for a in [k for k in keys if str(k[0]).startswith(OWN)]:
        for b in keys:
            if b == a or str(b[0]).startswith(OWN) or a[1] != b[1] or a[1] == "auto":
                continue
            common = sorted(set(by[a]) & set(by[b]))
            if len(common) < 2:
                continue
            diff = [by[a][s] - by[b][s] for s in common]
            lines.append(f"| {ratio_cell(a[1])} | {a[0]} | {b[0]} | {len(common)} | "
                         f"{mean_of(by[a][s] for s in common):.2f} | {mean_of(by[b][s] for s in common):.2f} | "
                         f"{mean_ci_cell(diff, 2)} |")
    return "\n".join(lines) + "\n" if len(lines) > 2 else ""


def auto_bound_table(rows: Sequence[dict]) -> str:
    """Per method with fixed ratios r1 < r2 < ..., on the answerable questions every one of them ran: the TTFT
    speed-up of an `auto` that always ends with full prefill's answer (SQuAD-normalised first line), when its
    verification is perfect and free. "Clairvoyant": each question costs its cheapest ratio that gives full's
    answer, else a full prefill alone. "Cascade": it tries r1, r2, ... in turn, paying each try, and falls back
    to a full prefill after the last. Real verification only costs more. '' without two fixed ratios."""
    full, groups = _by_method([r for r in rows if r.get("answerable", True)])
    by_method: dict[str, dict] = defaultdict(dict)
    for (m, ratio), g in groups.items():
        if m not in REFERENCES and isinstance(ratio, float):
            by_method[m][ratio] = {sample_key(x): x for x in g}
    lines = ["| method | ratios | n | same answer at the lowest | clairvoyant speed-up | cascade speed-up |",
             "|---|---|---|---|---|---|"]
    for m in sorted(by_method, key=method_key):
        ratios = sorted(by_method[m])
        common = sorted(set.intersection(*(set(by_method[m][r]) for r in ratios)))
        if len(ratios) < 2 or not common:
            continue
        full_t, clair, cascade, first = [], [], [], []
        for s in common:
            ref = full[s]
            t_full = float(ref["ttft_s"])
            tries = [by_method[m][r][s] for r in ratios]
            ok = [same_answer(x.get("pred", ""), ref.get("pred", "")) for x in tries]
            first.append(float(ok[0]))
            full_t.append(t_full)
            k = ok.index(True) if any(ok) else None
            clair.append(t_full if k is None else float(tries[k]["ttft_s"]))
            paid = tries if k is None else tries[:k + 1]
            cascade.append(sum(float(x["ttft_s"]) for x in paid) + (t_full if k is None else 0.0))
        lines.append(f"| {m} | {', '.join(ratio_cell(r) for r in ratios)} | {len(common)} | "
                     f"{mean_ci_cell(first, 2)} | "
                     f"{fmt_num(ratio_of_means(full_t, clair), 2)} | {fmt_num(ratio_of_means(full_t, cascade), 2)} |")
    return "\n".join(lines) + "\n" if len(lines) > 2 else ""


def plot_kept_by_position(rows: Sequence[dict], path: str | os.PathLike, bins: int = 5) -> Path:
    """Answers kept (of full prefill's right answers) against the gold passage's relative position, one line per
    method at its lowest fixed ratio and at 0.2, full prefill's own accuracy by position beside them."""
    full, groups = _by_method([r for r in rows if r.get("answerable", True) and r.get("depth") is not None])
    if not groups:
        raise ValueError("no SQuAD rows with a gold position to plot")

    def b(d: float) -> int:
        return min(bins - 1, int(float(d) * bins))

    fig = new_figure(6.4, 4.2)
    ax = fig.subplots()
    xs = [(i + 0.5) / bins for i in range(bins)]
    acc = defaultdict(list)
    for x in full.values():
        if x.get("depth") is not None and x.get("answerable", True):
            acc[b(x["depth"])].append(float(bool(x["correct"])))
    ax.plot(xs, [mean_of(acc[i]) for i in range(bins)], color="black", linestyle="--", marker="s",
            label="full prefill: accuracy")
    palette = colour_cycle()
    for k, key in enumerate(_order(groups)):
        m, ratio = key
        if m in REFERENCES and m != "naive":
            continue
        cells = defaultdict(list)
        for x in groups[key]:
            if full[sample_key(x)].get("correct"):
                cells[b(x["depth"])].append(float(bool(x["correct"])))
        label = m if ratio is None else f"{m} {ratio if ratio == 'auto' else f'{ratio:g}'}"
        ax.plot(xs, [mean_of(cells[i]) for i in range(bins)], marker="o", color=palette[k % len(palette)],
                label=label, linewidth=1.2)
    ax.set_xlabel("gold passage position (0 = first, 1 = last)")
    ax.set_ylabel("answers kept (of full prefill's right answers)")
    ax.set_ylim(-0.03, 1.05)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    return save_png(fig, path)


def squad_sections(rows: Sequence[dict], out: Path, name: str) -> tuple[list[str], dict[str, Path]]:
    """The summary's SQuAD sections and the position plot."""
    parts = ["Answers kept: of the questions full prefill answers correctly, the share the method still answers "
             "correctly. Same answer: SQuAD-normalised first line equal to full prefill's, over every answerable "
             "question. F1 / EM: SQuAD's official scores, as % of full prefill's on the same questions.", "",
             answers_table(rows), ""]
    full = [r for r in rows if r.get("method") == "full" and r.get("answerable", True)]
    missed = [r for r in full if "gold_position" in r and r["gold_position"] is None]
    if missed:  # retrieved prompts (--retrieve): how often retrieval brought the answer at all
        parts += [f"The answer is in the retrieved context for {len(full) - len(missed)} of {len(full)} answerable "
                  f"questions; full prefill is right on {sum(bool(r.get('correct')) for r in missed)} of the "
                  f"{len(missed)} others.", ""]
    ab = abstention_table(rows)
    if ab:
        parts += ["Unanswerable questions (SQuAD v2.0): where full prefill abstains, does the method abstain too, "
                  "or invent an answer?", "", ab, ""]
    paired = paired_kept_table(rows)
    if paired:
        parts += ["Answers kept, two methods paired on the questions full prefill gets right:", "", paired, ""]
    bound = auto_bound_table(rows)
    if bound:
        parts += ["The most an adaptive budget over each method's fixed ratios can pay while always giving full "
                  "prefill's answer, its verification perfect and free (clairvoyant: the cheapest ratio that gives "
                  "it, else full prefill; cascade: the ratios tried in turn, then full prefill):", "", bound, ""]
    written = {}
    answerable = [r for r in rows if r.get("answerable", True)]
    if any(r.get("method") == "full" and r.get("correct") for r in answerable):
        written[f"kept_vs_speedup_{name}"] = plot_pareto(answerable, out / f"kept_vs_speedup_{name}.png", y="kept")
        parts += [f"![answers kept vs TTFT speed-up](kept_vs_speedup_{name}.png)", ""]
    if any(r.get("depth") is not None and r.get("method") == "full" for r in rows):
        written[f"kept_by_position_{name}"] = plot_kept_by_position(rows, out / f"kept_by_position_{name}.png")
        parts += [f"![answers kept by gold position](kept_by_position_{name}.png)", ""]
    return parts, written
