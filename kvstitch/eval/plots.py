"""Plots of evaluation results: score per task vs recompute ratio, fidelity panels, the NIAH depth x length
heatmap and the agreement / speed-up Pareto picture (PNG files written).

matplotlib Figure + Agg canvas: no pyplot global state, safe in workers and tests. The tables and
``summary.md`` are in `eval/report.py`.
"""

from __future__ import annotations

import math
import os
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvstitch.core.figures import new_figure, save_png
from .rows import (REFERENCE_METHODS, REFERENCES, as_number, colour_cycle, group_rows, mean_of, method_key,
                  naive_nll_by_sample, norm_ratio, pooled_recovery, ratio_key, ratio_of_means, sample_key)


def plot_accuracy_vs_ratio(rows: Sequence[dict], path: str | os.PathLike) -> Path:
    """ProphetKV Fig. 8 style: one panel per task, x = recompute ratio, score x100 per method; `full`
    and `naive` are horizontal references (they have no ratio axis)."""
    rows = [r for r in rows if as_number(r.get("score")) is not None]
    if not rows:
        raise ValueError("no rows with a score to plot")
    tasks = sorted({str(r["task"]) for r in rows})
    ncols = min(4, len(tasks))
    nrows = math.ceil(len(tasks) / ncols)
    fig = new_figure(4.0 * ncols, 3.2 * nrows)
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    colors: dict[str, Any] = {}
    palette = [f"C{i}" for i in range(10)]
    handles: dict[str, Any] = {}
    for ax, task in zip(axes, tasks):
        by_method = group_rows((r for r in rows if str(r["task"]) == task), "method")
        for (method,) in sorted(by_method, key=lambda k: method_key(str(k[0]))):
            method = str(method)
            color = colors.setdefault(method, "black" if method == "full" else "gray" if method == "naive"
                                      else palette[len([m for m in colors if m not in REFERENCE_METHODS]) % 10])
            g = by_method[(method,)]
            if method in REFERENCE_METHODS:
                h = ax.axhline(100 * mean_of(r["score"] for r in g), color=color, linestyle="--", linewidth=1.2,
                               label=method)
            else:
                pts = sorted((ratio_key(k[0]), 100 * mean_of(r["score"] for r in gg))
                             for k, gg in group_rows(g, "ratio").items() if as_number(k[0]) is not None)
                if not pts:
                    continue
                (h,) = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color=color, label=method)
            handles.setdefault(method, h)
        ax.set_title(task)
        ax.set_xlabel("recompute ratio")
        ax.set_ylabel("score")
        ax.set_ylim(-3, 103)
        ax.grid(alpha=0.3)
    for ax in axes[len(tasks):]:
        ax.set_visible(False)
    names = sorted(handles, key=method_key)
    fig.legend([handles[m] for m in names], names, loc="outside right upper")
    return save_png(fig, path)


def plot_niah_heatmap(rows: Sequence[dict], path: str | os.PathLike, tasks: Sequence[str] | None = None) -> Path:
    """Depth x length grid of mean score x100 (RULER / needle-test style), one panel per method/ratio.
    Averages over the NIAH tasks unless `tasks` says otherwise."""
    keep = [r for r in rows
            if (str(r.get("task", "")).startswith("niah") if tasks is None else r.get("task") in tasks)
            and as_number(r.get("depth")) is not None and as_number(r.get("length")) is not None
            and as_number(r.get("score")) is not None]
    if not keep:
        raise ValueError("no rows with task, depth, length and score to plot")
    depths = sorted({round(float(r["depth"]), 3) for r in keep})
    lengths = sorted({int(r["length"]) for r in keep})
    panels = sorted(group_rows(keep, "method", "ratio"), key=lambda k: (method_key(str(k[0])), ratio_key(k[1])))
    ncols = min(3, len(panels))
    nrows = math.ceil(len(panels) / ncols)
    fig = new_figure(1.0 + 0.9 * len(lengths) * ncols + 1.0, 0.9 + 0.45 * len(depths) * nrows + 0.4)
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    groups = group_rows(keep, "method", "ratio")
    im = None
    for ax, key in zip(axes, panels):
        grid = [[math.nan] * len(lengths) for _ in depths]
        acc: dict[tuple[int, int], list[float]] = defaultdict(list)
        for r in groups[key]:
            acc[(depths.index(round(float(r["depth"]), 3)), lengths.index(int(r["length"])))].append(float(r["score"]))
        for (i, j), v in acc.items():
            grid[i][j] = 100 * sum(v) / len(v)
        im = ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=100, aspect="auto", origin="upper")
        for (i, j), _ in acc.items():
            ax.text(j, i, f"{grid[i][j]:.0f}", ha="center", va="center", fontsize=7)
        method, ratio = key
        ax.set_title(f"{method}" + (f" r={as_number(ratio):g}" if as_number(ratio) is not None else ""))
        ax.set_xticks(range(len(lengths)), [str(L) for L in lengths])
        ax.set_yticks(range(len(depths)), [f"{100 * d:.0f}%" for d in depths])
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("needle depth")
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    fig.colorbar(im, ax=list(axes[:len(panels)]), label="score", shrink=0.8)
    return save_png(fig, path)


# (field, y label, scale, y limits): the panels `plot_vs_ratio` can draw
PANELS = {
    "score": ("score x100", 100.0, "linear", (-3, 103)),
    "kl": ("KL(full || method), nats", 1.0, "log", None),
    "nll_recovery": ("NLL-gap recovery (pooled)", 1.0, "linear", None),
}


def plot_vs_ratio(rows: Sequence[dict], path: str | os.PathLike, fields: Sequence[str] = ("score",)) -> Path:
    """One column per task, one row per field of `PANELS`, x = recompute ratio, one line per method (distinct
    colours and markers for a dozen methods); `full` / `naive` are horizontal references (no ratio axis).
    Scores and KL are means over samples; the NLL-gap recovery is pooled (`pooled_recovery`)."""
    rows = [r for r in rows if all(r.get(f) is not None for f in fields if f != "nll_recovery")]
    if not rows:
        raise ValueError(f"no rows with {', '.join(fields)} to plot")
    tasks = sorted({str(r["task"]) for r in rows})
    fig = new_figure(3.8 * len(tasks) + 1.8, 3.1 * len(fields) + 0.3)
    axes = fig.subplots(len(fields), len(tasks), squeeze=False)
    palette = colour_cycle()
    styles: dict[str, tuple] = {}
    handles: dict[str, Any] = {}
    naive_nll = naive_nll_by_sample(rows)
    for method in sorted({str(r["method"]) for r in rows}, key=method_key):
        k = len([m for m in styles if m not in REFERENCES])
        styles[method] = (("black" if method == "full" else "gray", None) if method in REFERENCES
                          else (palette[k % 20], "osD^v<>ph*"[k % 10]))
    for j, task in enumerate(tasks):
        by_method: dict[str, list[dict]] = defaultdict(list)
        for r in rows:
            if str(r["task"]) == task:
                by_method[str(r["method"])].append(r)
        for i, field_ in enumerate(fields):
            label, scale, yscale, ylim = PANELS[field_]
            ax = axes[i][j]

            def agg(rs, f=field_, scale=scale):
                return pooled_recovery(rs, naive_nll) if f == "nll_recovery" else scale * mean_of(r.get(f) for r in rs)

            for method in sorted(by_method, key=method_key):
                g = by_method[method]
                color, marker = styles[method]
                if method in REFERENCES:
                    y = agg(g)
                    if math.isnan(y) or (yscale == "log" and y <= 0):
                        continue
                    h = ax.axhline(y, color=color, linestyle="--", linewidth=1.2)
                else:
                    pts: dict[float, list[dict]] = defaultdict(list)
                    for r in g:
                        if r.get("ratio") not in (None, "auto"):
                            pts[float(r["ratio"])].append(r)
                    ys = [(x, agg(pts[x])) for x in sorted(pts)]
                    ys = [(x, y) for x, y in ys if not math.isnan(y)]
                    if not ys:
                        continue
                    (h,) = ax.plot([x for x, _ in ys], [y for _, y in ys], marker=marker, color=color)
                handles.setdefault(method, h)
            if i == 0:
                ax.set_title(task)
            if i == len(fields) - 1:
                ax.set_xlabel("recompute ratio")
            ax.set_ylabel(label)
            ax.set_yscale(yscale)
            if ylim:
                ax.set_ylim(*ylim)
            ax.grid(alpha=0.3)
    names = sorted(handles, key=method_key)
    fig.legend([handles[m] for m in names], names, loc="outside right upper")
    return save_png(fig, path)


def plot_pareto(rows: Sequence[dict], path: str | os.PathLike, y: str = "agree") -> Path:
    """Quality (y) vs TTFT speed-up over full prefill (x): fixed ratios as one curve per method, ``auto`` as a star
    per method (its options in the run's protocol). ``y="agree"``: answers equal to full prefill's (12 words);
    ``y="kept"``: of the questions full prefill answers correctly, the share still answered correctly."""
    fig = new_figure(6.4, 4.4)
    draw_pareto(fig.subplots(), rows, y)
    return save_png(fig, path)


def draw_pareto(ax, rows: Sequence[dict], y: str = "agree", colours: dict[str, Any] | None = None) -> None:
    """`plot_pareto`'s picture on the matplotlib axes `ax`; `colours` (method -> colour) keeps a method's colour
    the same across several axes."""
    if y not in ("agree", "kept"):
        raise ValueError(f"y must be 'agree' or 'kept', got {y!r}")
    full_right = {sample_key(r) for r in rows if r.get("method") == "full" and r.get("correct")}
    pts: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        if r.get("method") in REFERENCES:
            continue
        if (r.get("agree_words") is not None) if y == "agree" else (sample_key(r) in full_right):
            pts[(str(r["method"]), norm_ratio(str(r["method"]), r.get("ratio")))].append(r)
    if not pts:
        raise ValueError("no rows with an agreement to plot" if y == "agree" else
                         "no rows on questions full prefill answers correctly")
    palette = colour_cycle()

    def xy(g):
        return (ratio_of_means([x.get("ttft_full_s") for x in g], [x.get("ttft_s") for x in g]),
                mean_of(float(bool(x["agree_words" if y == "agree" else "correct"])) for x in g))

    for k, method in enumerate(sorted({m for m, _ in pts}, key=method_key)):
        color = (colours or {}).get(method, palette[k % len(palette)])
        fixed = sorted((r, xy(g)) for (m, r), g in pts.items() if m == method and r != "auto")
        if fixed:
            ax.plot([p[0] for _, p in fixed], [p[1] for _, p in fixed], marker="o", color=color, label=f"{method} (fixed)")
            for r, (px, py) in fixed:
                ax.annotate(f"{r:g}", (px, py), textcoords="offset points", xytext=(4, 4), fontsize=7)
        if (method, "auto") in pts:
            px, py = xy(pts[(method, "auto")])
            ax.plot([px], [py], marker="*", markersize=14, linestyle="none", color=color, label=f"{method} auto")
    ax.plot([1.0], [1.0], marker="s", markersize=8, linestyle="none", color="black", label="full prefill")
    ax.set_xlabel("TTFT speed-up over full prefill (mean full TTFT / mean TTFT)")
    ax.set_ylabel("answers equal to full prefill's (12 words)" if y == "agree" else
                  "answers kept (of full prefill's right answers)")
    ax.set_ylim(-0.03, 1.05)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
