"""Budget arithmetic: which page ranges a decode step attends to (PRKV Sec. 3.5 / 4.1).

A layer's storage is split, per step, into three page ranges:

    [0, front)                   sinks + static set (PRKV/SnapKV restructure the static set to the front)
    [front, local_start)         candidates; ``n_dynamic`` of them are chosen per KV head
    [local_start, n_pages)       the local window, rounded out to whole pages (always attended)

The budget ``k`` is counted the way the PRKV paper counts it (Sec. 3.5 / 5.1): ``k`` tokens of sinks,
static set and dynamic pages, and the local window (64 tokens) *on top*, so a step attends at most
``k + window`` tokens per KV head (`attended_cap`). Sinks count inside ``k``; the local window is rounded
out to whole pages and that slack (< one page) comes out of ``k``. With ``window_in_budget`` (the old
accounting, a named variant) the window counts inside ``k`` too and a step attends at most ``k`` tokens.
Front and local tokens are taken first, the rest goes to whole dynamic pages. Every range is whole pages
(only the last page may be partly filled), so when the cap covers the cache every candidate is chosen and
the step is exactly dense attention.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstitch.core.errors import InputError


def pages_for(n_tokens: int, page_size: int) -> int:
    return -(-n_tokens // page_size)


def max_window_pages(window: int, page_size: int) -> int:
    """Most pages a ``window``-token local region can span (it starts mid-page when unaligned)."""
    return pages_for(window, page_size) + 1


def attended_cap(budget: int, window: int, window_in_budget: bool = False) -> int:
    """Most tokens a step attends per KV head: ``k + window`` (the paper's accounting) or ``k``."""
    return budget if window_in_budget else budget + window


def front_pages(budget: int, page_size: int, sinks: int, window: int, static_ratio: float | None,
                cap: int | None = None) -> int:
    """Pages of the front region: the sink pages, or for static policies ``floor(k·S / P)`` pages
    (App. G rounds S to pages), at least the sink pages and leaving room for the local window within the
    step's ``cap`` of attended tokens (default ``budget``)."""
    sink_pages = pages_for(sinks, page_size)
    if static_ratio is None:
        return sink_pages
    most = (budget if cap is None else cap) // page_size - max_window_pages(window, page_size)
    return max(sink_pages, min(int(static_ratio * budget) // page_size, most))


def check_budget(cap: int, page_size: int, sinks: int, window: int, budget: int | None = None) -> None:
    """The attended-token ``cap`` must hold the sink pages and the local window's pages."""
    need = (pages_for(sinks, page_size) + max_window_pages(window, page_size)) * page_size
    if window < 1:
        raise InputError(f"the local window must hold at least the current token, got window={window}")
    if cap < need:
        budget = cap if budget is None else budget
        extra = "" if budget == cap else f" + the {cap - budget}-token local window"
        raise InputError(f"kv_budget={budget}{extra} is smaller than the sink + local-window pages ({need} tokens "
                         f"at page_size={page_size}, sinks={sinks}, window={window})")


@dataclass(frozen=True)
class PagePlan:
    """The page ranges of one step (see the module docstring); ``lo`` is the first token attended
    (``n - sliding_window`` on local-attention layers, else 0)."""

    n_tokens: int
    page_size: int
    front: int
    local_start: int
    n_dynamic: int
    lo: int = 0

    @property
    def n_pages(self) -> int:
        return pages_for(self.n_tokens, self.page_size)

    @property
    def n_candidates(self) -> int:
        return self.local_start - self.front

    @property
    def selected_tokens(self) -> int:
        """Tokens attended per KV head (front and dynamic pages are full; the local range ends at n)."""
        local = self.n_tokens - max(self.lo, self.local_start * self.page_size)
        return (self.front + self.n_dynamic) * self.page_size + local


def plan_step(n_tokens: int, page_size: int, budget: int, front: int, window: int, *,
              select_all: bool = False, sliding_window: int | None = None) -> PagePlan:
    """The plan for a cache of ``n_tokens`` (current token included); ``budget`` here is the step's cap of
    attended tokens (`attended_cap`)."""
    P = page_size
    if sliding_window is not None:  # local-attention layer: dense over its window, nothing else
        lo = max(0, n_tokens - sliding_window)
        return PagePlan(n_tokens, P, 0, lo // P, 0, lo)
    local_start = max(0, n_tokens - window) // P
    front = min(front, local_start)
    candidates = local_start - front
    if select_all:
        return PagePlan(n_tokens, P, front, local_start, candidates)
    spare = budget - front * P - (n_tokens - local_start * P)
    return PagePlan(n_tokens, P, front, local_start, max(0, min(spare // P, candidates)))
