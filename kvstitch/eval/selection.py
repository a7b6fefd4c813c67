"""Selection on its own (no recompute, no decode), with indices and scores in the ORIGINAL token order:
the `oracle` reference sets of the eval's overlap ratio, and the pictures of `kvstitch viz`.

Neutral ground for `eval.runner` and `viz` (moved out of `eval/runner.py`, unchanged)."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_original_order(indices: torch.Tensor, order: Sequence[int], chunk_lengths: Sequence[int]) -> torch.Tensor:
    """Context indices of a layout whose chunks were reordered (`order[j]` = original chunk of slot j)
    -> sorted indices into the original context."""
    if list(order) == list(range(len(order))):
        return indices
    return _reordered_positions(order, chunk_lengths)[indices.long()].sort().values


def _reordered_positions(order: Sequence[int], lens: Sequence[int]) -> torch.Tensor:
    """[n] original index of each position of the reordered context."""
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    return torch.cat([torch.arange(starts[c], starts[c] + lens[c]) for c in order])


def oracle_sets(engine, layout, ratios: Sequence[float], exact_cache=None) -> dict[float, torch.Tensor]:
    """G per ratio: the `oracle` selection (top-k of full-prefill query attention) at each budget,
    from one scoring pass (over ``exact_cache``, a full prefill of this prompt, when the caller has one)."""
    from kvstitch.select import top_k_indices

    indices, scores, _ = select_tokens(engine, layout, "oracle", 1.0, keep_scores=True, exact_cache=exact_cache)
    out = {}
    for r in ratios:
        k = round(r * layout.n_context)
        out[round(float(r), 6)] = top_k_indices(scores, k) if scores is not None else indices[:k]
    return out


@torch.no_grad()
def select_tokens(engine, layout, method: str, ratio: float, keep_scores: bool = False, selector=None,
                  method_options: dict | None = None, exact_cache=None):
    """Selection only (no recompute, no decode): -> (indices in original order, scores [n_context] or None,
    stats). For pictures and the oracle reference set; scores are mapped back to the original order too.
    With ``keep_scores`` and ratio 1, the selector's scores are computed even though the budget covers
    everything (the base class would skip scoring). ``exact_cache``: a full prefill of this prompt the caller
    has (`SelectionContext.exact_cache`)."""
    from kvstitch.select import SelectionContext, make_selector

    selector = selector or make_selector(method, **(method_options or {}))
    stats: dict = {}
    if selector.full_prefill:
        return torch.arange(layout.n_context), None, stats
    kvs = engine.chunk_kvs(layout, stats, anchors=selector.chunk_anchors())
    cache = engine.stitch(layout, kvs, extra=0)
    budget = round(ratio * layout.n_context)
    ctx = SelectionContext(engine, cache, layout, budget, stats,
                           precompute=getattr(engine, "precompute_mode", "shared_prefix"), chunks=kvs,
                           exact_cache=exact_cache)
    if keep_scores and budget >= layout.n_context and not selector.zero_budget and method != "naive":
        scores = selector.score(ctx).float().cpu()
        indices = torch.arange(layout.n_context)
    else:
        indices, scores = selector.select(ctx)
        scores = None if scores is None else scores.float().cpu()
    order = list(ctx.layout.order)
    lens = [c.numel() for c in layout.chunk_ids]
    indices = to_original_order(indices.cpu(), order, lens)
    if scores is not None and order != list(range(len(order))):
        orig = torch.empty_like(scores)
        orig[_reordered_positions(order, lens)] = scores
        scores = orig
    return indices, scores, stats
