"""One table over several eval runs (e.g. SQuAD, NIAH 8K and MuSiQue on one model): per dataset, method and ratio,
the answers kept, the score as % of full prefill's, agreement with full prefill, the TTFT speed-up and the selection's
own time; then kvstitch's own method against the best of its rivals, paired, and a plot of kept vs speed-up per
dataset.

"Answers kept": of the samples full prefill answers correctly, the share the method still answers correctly (SQuAD's
answerable questions only). The rival a target is judged against is, per dataset and ratio, the one keeping most on
the samples both ran; "ahead" means at least `MARGIN` more kept with the paired 95% interval above 0 at no less than
`SPEED_FLOOR` times that rival's TTFT speed-up.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path

from kvstitch.core.figures import new_figure, save_png
from .plots import draw_pareto
from .rows import (REFERENCES, bootstrap_mean_ci, colour_cycle, fmt_ci, fmt_num, json_default, mean_of, method_key,
                  norm_ratio, ratio_cell, ratio_key, sample_key, ttft_speedup)

MARGIN = 0.05
SPEED_FLOOR = 0.95


def family(method: str) -> str:
    """A method's name without its options: 'deltaprop(base=infoflow)' -> 'deltaprop'."""
    return method.split("(", 1)[0]


class _Dataset:
    """One run's rows, indexed: full prefill per sample, and per (method, ratio) the rows that have an answer."""

    def __init__(self, rows: Sequence[dict]):
        rows = [r for r in rows if r.get("answerable", True)]
        self.full = {sample_key(r): r for r in rows if r.get("method") == "full"}
        self.groups: dict[tuple, dict[tuple, dict]] = defaultdict(dict)
        for r in rows:
            if r.get("correct") is not None and sample_key(r) in self.full:
                key = (str(r.get("method")), norm_ratio(str(r.get("method")), r.get("ratio")))
                self.groups[key][sample_key(r)] = r
        self.rows = rows

    def keys(self) -> list[tuple]:
        return sorted(self.groups, key=lambda k: (method_key(k[0]), ratio_key(k[1])))

    def kept(self, key: tuple) -> dict[tuple, float]:
        """sample -> 1.0 / 0.0 (still right), over the samples full prefill answers correctly."""
        return {s: float(bool(r["correct"])) for s, r in self.groups[key].items() if self.full[s].get("correct")}

    def speedup(self, key: tuple, samples=None) -> float:
        return ttft_speedup(r for s, r in self.groups[key].items() if samples is None or s in samples)

    def stats(self, key: tuple) -> dict:
        g = list(self.groups[key].values())
        kept = list(self.kept(key).values())
        agree = [float(bool(r["agree_words"])) for r in g if r.get("agree_words") is not None]
        full_score = mean_of(self.full[sample_key(r)].get("score") for r in g)
        score = mean_of(r.get("score") for r in g)
        return {"method": key[0], "ratio": key[1], "n": len(g), "full_right": len(kept),
                "kept": mean_of(kept), "kept_ci": bootstrap_mean_ci([kept]),
                "score_pct_of_full": 100 * score / full_score if full_score else None,
                "agree": mean_of(agree), "agree_ci": bootstrap_mean_ci([agree]),
                "speedup": self.speedup(key), "select_s": mean_of(r.get("select_s") for r in g)}


def _paired(ds: _Dataset, a: tuple, b: tuple) -> dict | None:
    ka, kb = ds.kept(a), ds.kept(b)
    common = sorted(set(ka) & set(kb))
    if len(common) < 2:
        return None
    diff = [ka[s] - kb[s] for s in common]
    both = set(ds.groups[a]) & set(ds.groups[b])
    speed = ds.speedup(a, both) / ds.speedup(b, both)
    return {"n": len(common), "kept_a": mean_of(ka[s] for s in common), "kept_b": mean_of(kb[s] for s in common),
            "diff": mean_of(diff), "diff_ci": bootstrap_mean_ci([diff]), "speed_ratio": speed}


def targets(ds: _Dataset, own: str, rivals: Sequence[str]) -> list[dict]:
    """Per fixed ratio: `own` against the rival keeping most there (paired), and whether `own` is ahead; then
    `own` at its lowest ratio against the best method of another family at the highest ratio."""
    out = []
    ratios = sorted({r for m, r in ds.groups if m == own and r not in (None, "auto")})
    for ratio in ratios:
        pairs = [(m, _paired(ds, (own, ratio), (m, ratio))) for m in rivals if (m, ratio) in ds.groups]
        pairs = [(m, p) for m, p in pairs if p]
        if not pairs:
            continue
        best, p = max(pairs, key=lambda mp: mp[1]["kept_b"])
        ahead = p["diff"] >= MARGIN and p["diff_ci"][0] > 0 and p["speed_ratio"] >= SPEED_FLOOR
        out.append({"kind": "ahead", "ratio": ratio, "rival": best, **p, "met": bool(ahead)})
    if len(ratios) >= 2:
        lo, hi = ratios[0], max(r for m, r in ds.groups if r not in (None, "auto"))
        paper = [m for m, r in ds.groups if r == hi and m not in REFERENCES and family(m) != family(own)]
        pairs = [(m, _paired(ds, (own, lo), (m, hi))) for m in paper]
        pairs = [(m, p) for m, p in pairs if p]
        if pairs:
            best, p = max(pairs, key=lambda mp: mp[1]["kept_b"])
            out.append({"kind": "low_vs_high", "ratio": lo, "rival": best, "rival_ratio": hi, **p,
                        "met": bool(p["kept_a"] >= p["kept_b"])})
    return out


def _stats_table(name: str, ds: _Dataset) -> list[str]:
    lines = []
    for key in ds.keys():
        s = ds.stats(key)
        score = s["score_pct_of_full"]
        lines.append(f"| {name} | {key[0]} | {'–' if key[1] is None else ratio_cell(key[1])} | {s['n']} | "
                     f"{s['full_right']} | {fmt_ci(s['kept'], s['kept_ci'], 2)} | "
                     f"{'–' if score is None else f'{score:.0f}%'} | {fmt_ci(s['agree'], s['agree_ci'], 2)} | "
                     f"{fmt_num(s['speedup'], 2)} | {fmt_num(s['select_s'], 3)} |")
    return lines


def _target_line(name: str, own: str, t: dict) -> str:
    if t["kind"] == "ahead":
        what = f"{own} vs {t['rival']} at {ratio_cell(t['ratio'])}"
        goal = f">= +{MARGIN:.2f}, interval > 0, >= {SPEED_FLOOR:.2f}x"
    else:
        what = f"{own} at {ratio_cell(t['ratio'])} vs {t['rival']} at {ratio_cell(t['rival_ratio'])}"
        goal = "kept A >= kept B"
    return (f"| {name} | {what} | {t['n']} | {t['kept_a']:.2f} | {t['kept_b']:.2f} | "
            f"{fmt_ci(t['diff'], t['diff_ci'], 2)} | {t['speed_ratio']:.2f}x | {goal} | "
            f"{'met' if t['met'] else 'missed'} |")


def overview(runs: Mapping[str, Sequence[dict]], own: str, rivals: Sequence[str]) -> dict:
    """The figures behind the tables, per dataset name (JSON-ready)."""
    out = {}
    for name, rows in runs.items():
        ds = _Dataset(rows)
        if not ds.full:
            raise ValueError(f"{name}: no full-prefill rows to compare with")
        out[name] = {"methods": [ds.stats(k) for k in ds.keys()], "targets": targets(ds, own, rivals)}
    return out


def write_overview(runs: Mapping[str, Sequence[dict]], out: str | os.PathLike, own: str, rivals: Sequence[str],
                   command: str = "", name: str = "overview") -> dict[str, Path]:
    """`<name>.md` (both tables), `<name>.json` and `<name>.png` (kept vs TTFT speed-up, one panel per run)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    figures = overview(runs, own, rivals)
    data = {name_: _Dataset(rows) for name_, rows in runs.items()}
    md = [f"# {own} against the published methods", ""]
    if command:
        md += [f"Written by `{command}`.", ""]
    md += ["Answers kept: of the samples full prefill answers correctly, the share the method still answers "
           "correctly [95% bootstrap interval]. Score: the task's score (F1 for QA) as % of full prefill's on the "
           "same samples. Agrees: the answer's first 12 words equal full prefill's, over all samples. Speed-up: the "
           "median over samples of full prefill's TTFT / the method's on the same sample, within each run. "
           "Selection s: the method's own selection time.", "",
           "| dataset | method | ratio | n | full right | answers kept | score % of full | agrees with full | "
           "TTFT speed-up | selection s |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name_, ds in data.items():
        md += _stats_table(name_, ds)
    md += ["", f"Targets, paired on the samples full prefill answers correctly (rivals: {', '.join(rivals)}; the rival "
           f"is the one keeping most at that ratio; speed: A's TTFT speed-up / B's on the samples both ran):", "",
           "| dataset | A vs B | n | kept A | kept B | A - B | speed | target | |", "|---|---|---|---|---|---|---|---|---|"]
    for name_, f in figures.items():
        md += [_target_line(name_, own, t) for t in f["targets"]]
    png = out / f"{name}.png"
    _plot(data, png)
    md += ["", f"![answers kept vs TTFT speed-up]({png.name})", ""]
    paths = {"md": out / f"{name}.md", "json": out / f"{name}.json", "png": png}
    paths["md"].write_text("\n".join(md))
    paths["json"].write_text(json.dumps({"command": command, "own": own, "rivals": list(rivals), "datasets": figures},
                                        indent=1, default=json_default))
    return paths


def _plot(data: Mapping[str, _Dataset], path: Path) -> Path:
    methods = sorted({m for ds in data.values() for m, _ in ds.groups if m not in REFERENCES}, key=method_key)
    palette = colour_cycle()
    colours = {m: palette[i % len(palette)] for i, m in enumerate(methods)}
    fig = new_figure(5.2 * len(data), 4.6)
    for ax, (name, ds) in zip(fig.subplots(1, len(data), squeeze=False)[0], data.items()):
        draw_pareto(ax, ds.rows, y="kept", colours=colours)
        ax.set_title(f"{name} (full right on {sum(bool(r.get('correct')) for r in ds.full.values())})")
    return save_png(fig, path)
