"""CacheClip's grouping strategy (Yang et al. 2025, "CacheClip", Sec. 3.3 last paragraph; motivated in
Sec. 2.6 and 4.2: recomputing only part of a multi-token entity such as "5663623" breaks it).

The context is cut into consecutive windows of ``group_size`` tokens (default 8) starting at the first
context token. After the scorer's top-``budget`` pick, a window keeps its selected tokens only when at
least ``group_min`` of them (default 5) were selected; sparse windows are dropped. The paper stops there:
it recomputes FEWER tokens than the budget, and so does kvstitch by default (``refill=False``; the
tokens actually recomputed are what the engine reports, ``recomputed_tokens``). ``refill=True`` is a
named variant that spends the freed budget, deterministically and window-wise so the refill stays dense:

1. the not-yet-selected tokens of the *kept* windows (completing them: whole windows, as the paper's
   "contextual integrity" argument asks), kept windows by mean score, best first;
2. then whole *dropped/unselected* windows by mean score, best first;
   within a window tokens go by score (ties: position). Only the last refilled window may be partial.

A trailing window shorter than ``group_size`` needs ceil(group_min * len / group_size) selected tokens.
``group_min <= 1`` or ``group_size <= 1`` disables grouping (plain top-k).

Any scorer can be grouped: `grouped_top_k(scores, budget)` is a plain function (CacheClip calls it), and
the registered ``grouped`` method wraps any method (a `Wrapper`: every hook but `pick` is its base's)::

    Grouped(base=Prophet(), group_size=8, group_min=5, refill=False)      # or "grouped(base=prophet)"
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from .context import SelectionContext, top_k_indices
from .method import Selector, Wrapper, register
from .deviation import CacheBlend


def window_thresholds(n: int, group_size: int, group_min: int) -> torch.Tensor:
    """[n_windows] minimum selected count per window (scaled down for a short trailing window)."""
    n_win = math.ceil(n / group_size) if n else 0
    lens = torch.full((n_win,), group_size, dtype=torch.long)
    if n_win and n % group_size:
        lens[-1] = n % group_size
    return torch.clamp(torch.ceil(lens.double() * group_min / group_size).long(), max=group_min)


def kept_windows(selected: torch.Tensor, group_size: int = 8, group_min: int = 5) -> torch.Tensor:
    """[n_windows] bool: windows with at least ``group_min`` selected tokens (``selected``: [n] bool)."""
    n = selected.numel()
    win = torch.arange(n) // group_size
    counts = torch.zeros(math.ceil(n / group_size) if n else 0, dtype=torch.long)
    counts.index_add_(0, win, selected.long())
    return counts >= window_thresholds(n, group_size, group_min)


def grouped_top_k(scores: torch.Tensor, k: int, group_size: int = 8, group_min: int = 5,
                  refill: bool = False) -> torch.Tensor:
    """Sorted unique indices: top-k with sparse windows dropped (at most ``k``, the paper); with ``refill``
    exactly ``k``, the dropped budget refilled window-wise."""
    scores = scores.float().cpu()
    n = scores.numel()
    if k <= 0:
        return torch.zeros(0, dtype=torch.long)
    if k >= n:
        return torch.arange(n)
    top = top_k_indices(scores, k)
    if group_size <= 1 or group_min <= 1:
        return top
    selected = torch.zeros(n, dtype=torch.bool)
    selected[top] = True
    win = torch.arange(n) // group_size
    kept = kept_windows(selected, group_size, group_min)
    keep = selected & kept[win]
    short = k - int(keep.sum())
    if short > 0 and refill:
        n_win = kept.numel()
        sums = torch.zeros(n_win, dtype=torch.float64).index_add_(0, win, scores.double())
        mean = sums / torch.bincount(win, minlength=n_win).double()
        # refill priority (lexicographic, all ascending): kept windows first, then by window mean score,
        # then by token score, then by position (stable sorts applied from the least significant key).
        order = torch.arange(n)
        for key in (-scores, -mean[win], (~kept[win]).double()):
            order = order[torch.sort(key[order], stable=True).indices]
        fill = order[~keep[order]][:short]
        keep[fill] = True
    return keep.nonzero().flatten()


@register
@dataclass
class Grouped(Wrapper):
    """Any method's scores + CacheClip's grouping windows (``base``: the method to wrap)."""

    name: ClassVar[str] = "grouped"
    base: Selector = field(default_factory=CacheBlend)
    group_size: int = 8
    group_min: int = 5
    refill: bool = False  # True: refill the dropped budget window-wise (exact budget); False: the paper

    @property
    def exact_budget(self) -> bool:
        return self.refill

    # every capability of the base passes on (`Wrapper`): its prompt change (InfoFlow's reorder), its scores,
    # its zero budget, its recompute and decode plans; only the picking is grouped
    def pick(self, scores: torch.Tensor, ctx: SelectionContext) -> torch.Tensor:
        idx = grouped_top_k(scores, ctx.budget, self.group_size, self.group_min, self.refill)
        ctx.stats.update(selection_budget=int(ctx.budget), grouping_dropped=int(ctx.budget - idx.numel()))
        return idx
