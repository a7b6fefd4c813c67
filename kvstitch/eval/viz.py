"""Token picture of what each selection method recomputes (ProphetKV Fig. 2), side by side.

`selection_picture` runs the selection of every method on one prompt (no recompute needed for the picture;
optionally each method's answer too) and keeps, per context token, its text, chunk, role (answer-bearing
fact / distractor / filler, from the task's inserts) and per method whether it was selected and its score.
`render_html` writes a self-contained page: one column per method, the prompt's tokens with the selected
ones in red and the selector's score as the shade of every token (rank-normalised per method, so methods
with different score scales compare). `render_png` draws the same as one strip per method.

The command, ``kvstitch viz``, is `kvstitch.cli.viz.viz_command`.
"""

from __future__ import annotations

import html
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvstitch.core.figures import save_png
from kvstitch.core.errors import InputError
from kvstitch.core.extras import require

ANSWER_ROLES = ("needle", "fact", "chain")


@dataclass
class MethodPicture:
    method: str
    selected: list[int]  # context token indices (original order)
    shade: list[float] | None  # per token in [0, 1] (rank of the score), None = the method has no scores
    answer: str | None = None
    score: float | None = None  # task score of the answer
    overlap: float | None = None  # |S ∩ G| / |G| with the oracle set at the same budget
    note: str = ""


@dataclass
class Picture:
    question: str
    answers: list[str]
    task: str
    ratio: float
    tokens: list[str]  # context token texts
    chunk: list[int]  # chunk of each token
    role: list[str]  # "answer", "distractor" or "" per token
    methods: list[MethodPicture] = field(default_factory=list)
    meta: dict = field(default_factory=dict)


def _rank_shade(scores: torch.Tensor) -> list[float]:
    """Scores -> [0, 1] by rank (ties share the mean rank); robust to heavy-tailed attention scores."""
    s = scores.double().flatten()
    n = s.numel()
    if n <= 1 or float(s.max() - s.min()) == 0.0:
        return [0.0] * n
    order = torch.argsort(s, stable=True)
    ranks = torch.empty(n, dtype=torch.float64)
    ranks[order] = torch.arange(n, dtype=torch.float64)
    # ties -> mean rank
    uniq, inv = torch.unique(s, return_inverse=True)
    if uniq.numel() < n:
        sums = torch.zeros(uniq.numel(), dtype=torch.float64).index_add_(0, inv, ranks)
        cnt = torch.zeros(uniq.numel(), dtype=torch.float64).index_add_(0, inv, torch.ones(n, dtype=torch.float64))
        ranks = (sums / cnt)[inv]
    return (ranks / (n - 1)).tolist()


def _token_roles(engine, layout, chunks: list[str], inserts: list[dict]) -> tuple[list[str], list[int], list[str]]:
    """Per context token: its text, chunk and the role of the insert it falls in (by character offsets of
    the per-token decodes inside the chunk's text)."""
    tok = engine.tokenizer
    texts, chunk_of, roles = [], [], []
    for ci, ids in enumerate(layout.chunk_ids):
        pieces = [tok.decode([int(t)], skip_special_tokens=False) for t in ids.tolist()]
        joined = "".join(pieces)
        marks = [""] * len(joined)
        for ins in inserts:
            if ins.get("chunk") != ci:
                continue
            role = "answer" if ins.get("role") in ANSWER_ROLES else "distractor"
            start = joined.find(ins["text"])
            if start >= 0:
                for p in range(start, start + len(ins["text"])):
                    marks[p] = marks[p] or role
        pos = 0
        for p in pieces:
            span = marks[pos:pos + len(p)]
            roles.append("answer" if "answer" in span else "distractor" if "distractor" in span else "")
            pos += len(p)
            texts.append(p)
            chunk_of.append(ci)
    return texts, chunk_of, roles


def selection_picture(engine, question: str, chunks: list[str], methods: list[str], ratio: float = 0.2,
                      answers: list[str] | None = None, task: str = "", inserts: list[dict] | None = None,
                      answer_prefix: str | None = None, with_answers: bool = True,
                      max_new_tokens: int = 24) -> Picture:
    """Selections (and scores, answers) of `methods` on one prompt."""
    from kvstitch.tasks.grading import scorer_for
    from .selection import oracle_sets, select_tokens
    from kvstitch.core.prompt import with_answer_prefix
    from kvstitch.select import check_methods
    from kvstitch.select import methods as registered

    check_methods(methods)
    if not methods:
        raise InputError("no methods to draw")
    layout = with_answer_prefix(engine.layout(question, chunks), engine.tokenizer, answer_prefix)
    texts, chunk_of, roles = _token_roles(engine, layout, chunks, inserts or [])
    pic = Picture(question=question, answers=list(answers or []), task=task, ratio=ratio, tokens=texts,
                  chunk=chunk_of, role=roles,
                  meta={"context_tokens": layout.n_context, "prompt_tokens": layout.n_total,
                        "chunks": len(layout.chunk_ids), "budget": round(ratio * layout.n_context)})
    G = None
    if "oracle" in registered() and 0 < ratio < 1:
        G = oracle_sets(engine, layout, [ratio])[round(float(ratio), 6)]
    scorer = scorer_for(task) if task and answers else None
    for m in methods:
        idx, scores, _ = select_tokens(engine, layout, m, ratio, keep_scores=False)
        mp = MethodPicture(m, [int(i) for i in idx.tolist()], None if scores is None else _rank_shade(scores))
        if m == "full":
            mp.note = "full prefill: every token computed with cross-chunk attention"
        if G is not None and m not in ("full",) and G.numel():
            mp.overlap = len(set(mp.selected) & set(G.tolist())) / G.numel()
        if with_answers:
            res = engine.generate(question, chunks, method=m, recompute_ratio=ratio, max_new_tokens=max_new_tokens,
                                  layout=layout)
            mp.answer = res.text
            if scorer is not None:
                mp.score = scorer(res.text, pic.answers)
        pic.methods.append(mp)
    return pic


# ---------------------------------------------------------------------------------------------------
# HTML
# ---------------------------------------------------------------------------------------------------

_CSS = """
body { font: 13px/1.45 system-ui, -apple-system, 'Segoe UI', sans-serif; margin: 16px; color: #222; }
h1 { font-size: 18px; margin: 0 0 6px; }
.question { margin: 4px 0 10px; }
.legend span { margin-right: 14px; }
.grid { display: grid; grid-template-columns: repeat(var(--ncols), minmax(300px, 1fr)); gap: 12px;
        overflow-x: auto; align-items: start; }
.method-col { border: 1px solid #ccc; border-radius: 6px; padding: 8px; min-width: 0; background: #fff; }
.method-col h2 { font-size: 15px; margin: 0 0 4px; }
.method-col .stats { font-size: 12px; color: #444; margin-bottom: 6px; }
.method-col .answer { font-family: ui-monospace, monospace; background: #f4f4f4; padding: 2px 4px; }
.tokens { font-family: ui-monospace, 'DejaVu Sans Mono', monospace; font-size: 11px; white-space: pre-wrap;
          word-break: break-word; }
.t { border-radius: 2px; }
.t.sel { color: #9b0000; font-weight: bold; outline: 1px solid rgba(214, 39, 40, .55); }
.t.r-answer { text-decoration: underline 2px #2ca02c; }
.t.r-distractor { text-decoration: underline 2px #ff7f0e; }
.chunk-sep { display: block; border-top: 1px dashed #bbb; margin: 4px 0; font-size: 10px; color: #999; }
.ok { color: #2a7a2a; } .bad { color: #b00; }
"""

_LAYOUT_SCRIPT = """
window.addEventListener('load', function () {
  var cols = Array.prototype.slice.call(document.querySelectorAll('.method-col'));
  var info = cols.map(function (c) {
    var r = c.getBoundingClientRect();
    return {method: c.dataset.method, x: Math.round(r.left), y: Math.round(r.top), w: Math.round(r.width),
            h: Math.round(r.height), selected: c.querySelectorAll('.t.sel').length};
  });
  document.body.setAttribute('data-layout', JSON.stringify(info));
});
"""


def _shade_style(shade: float | None, selected: bool) -> str:
    if shade is None:
        return "background: rgba(214, 39, 40, .22)" if selected else ""
    a = 0.06 + 0.6 * shade ** 2
    if selected:
        return f"background: rgba(214, 39, 40, {0.15 + 0.55 * shade:.3f})"
    return f"background: rgba(31, 119, 180, {a:.3f})" if shade > 0.5 else ""


def render_html(pic: Picture, title: str | None = None) -> str:
    """A self-contained page (inline CSS, one small inline script recording the column layout)."""
    esc = html.escape
    title = title or f"kvstitch: selected tokens at r={pic.ratio:g}"
    cols = []
    for mp in pic.methods:
        sel = set(mp.selected)
        spans, last_chunk = [], None
        for i, text in enumerate(pic.tokens):
            if pic.chunk[i] != last_chunk:
                last_chunk = pic.chunk[i]
                spans.append(f'<span class="chunk-sep">chunk {last_chunk}</span>')
            cls = ["t"]
            if i in sel:
                cls.append("sel")
            if pic.role[i]:
                cls.append(f"r-{pic.role[i]}")
            style = _shade_style(None if mp.shade is None else mp.shade[i], i in sel)
            score_attr = "" if mp.shade is None else f' data-s="{mp.shade[i]:.3f}"'
            spans.append(f'<span class="{" ".join(cls)}"{score_attr}' + (f' style="{style}"' if style else "")
                         + f">{esc(text)}</span>")
        stats = [f"{len(sel)}/{len(pic.tokens)} tokens recomputed"]
        if mp.overlap is not None:
            stats.append(f"overlap with oracle {mp.overlap:.2f}")
        if mp.shade is None:
            stats.append("no per-token scores")
        answer = ""
        if mp.answer is not None:
            verdict = "" if mp.score is None else (f' <span class="{"ok" if mp.score >= 1 else "bad"}">'
                                                    f"score {mp.score:.2f}</span>")
            answer = f'<div class="stats">answer: <span class="answer">{esc(mp.answer)}</span>{verdict}</div>'
        note = f'<div class="stats">{esc(mp.note)}</div>' if mp.note else ""
        cols.append(f'<section class="method-col" data-method="{esc(mp.method)}" id="col-{esc(mp.method)}">'
                    f"<h2>{esc(mp.method)}</h2><div class=\"stats\">{esc(' · '.join(stats))}</div>{answer}{note}"
                    f'<div class="tokens">{"".join(spans)}</div></section>')
    gold = f" — gold: <b>{esc(', '.join(pic.answers))}</b>" if pic.answers else ""
    meta = esc(json.dumps(pic.meta))
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{esc(title)}</title>'
            f"<style>{_CSS}</style></head>\n<body data-meta=\"{meta}\">"
            f"<h1>{esc(title)}</h1>"
            f'<div class="question">{esc(pic.task + ": ") if pic.task else ""}<b>Q:</b> {esc(pic.question)}{gold}</div>'
            '<div class="legend"><span style="color:#9b0000;font-weight:bold">red = recomputed</span>'
            '<span style="background:rgba(31,119,180,.5)">shade = selector score (rank)</span>'
            '<span style="text-decoration:underline 2px #2ca02c">answer-bearing fact</span>'
            '<span style="text-decoration:underline 2px #ff7f0e">distractor</span></div>'
            f'<div class="grid" style="--ncols:{len(pic.methods)}">{"".join(cols)}</div>'
            f"<script>{_LAYOUT_SCRIPT}</script></body></html>\n")


# ---------------------------------------------------------------------------------------------------
# PNG
# ---------------------------------------------------------------------------------------------------

def render_png(pic: Picture, path: str | os.PathLike) -> Path:
    """One strip per method over the context tokens: red = recomputed (darker = higher score), blue shade =
    score of the tokens left alone; green / orange ticks = answer-bearing / distractor tokens; dashed lines
    = chunk boundaries."""
    import numpy as np

    require("matplotlib", "plots", "the viz PNG")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    n, m = len(pic.tokens), len(pic.methods)
    img = np.ones((m, n, 3))
    for row, mp in enumerate(pic.methods):
        shade = np.array(mp.shade) if mp.shade is not None else np.zeros(n)
        blue = np.array([31, 119, 180]) / 255
        red = np.array([214, 39, 40]) / 255
        base = 1 - (0.7 * shade[:, None] ** 2) * (1 - blue[None, :])
        img[row] = base
        if mp.selected:
            s = np.array(mp.selected)
            strength = 0.55 + 0.45 * (shade[s] if mp.shade is not None else np.ones(len(s)))
            img[row, s] = 1 - strength[:, None] * (1 - red[None, :])
    fig = Figure(figsize=(min(18, 4 + n / 60), 0.9 + 0.45 * m), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    ax.imshow(img, aspect="auto", interpolation="nearest")
    labels = []
    for mp in pic.methods:
        extra = "" if mp.score is None else f" ({mp.score:.0%})"
        labels.append(f"{mp.method}{extra}")
    ax.set_yticks(range(m), labels)
    bounds = [i for i in range(1, n) if pic.chunk[i] != pic.chunk[i - 1]]
    for b in bounds:
        ax.axvline(b - 0.5, color="0.4", linestyle="--", linewidth=0.6)
    for role, color in (("answer", "#2ca02c"), ("distractor", "#ff7f0e")):
        xs = [i for i, r in enumerate(pic.role) if r == role]
        if xs:
            ax.scatter(xs, [-0.75] * len(xs), marker="|", color=color, s=30, clip_on=False, label=role)
    ax.set_ylim(m - 0.5, -1.0)
    ax.set_xlabel(f"context token (of {n}); red = recomputed at r={pic.ratio:g}, blue shade = score")
    ax.set_title(pic.question[:120], fontsize=9)
    return save_png(fig, path, dpi=110)


def write_picture(pic: Picture, html_path: str | os.PathLike, png_path: str | os.PathLike | None = None) -> tuple[Path, Path | None]:
    html_path = Path(html_path)
    html_path.parent.mkdir(parents=True, exist_ok=True)
    html_path.write_text(render_html(pic), encoding="utf-8")
    png = render_png(pic, png_path) if png_path is not None else None
    return html_path, png
