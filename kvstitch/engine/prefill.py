"""Prefill: from a checked request to a `Prefill` ready to decode. The chunk caches are stitched (RoPE
re-rotated to their global positions), the method selects context tokens, one pass recomputes them with the
suffix; or the cold path / method "full" prefill from scratch; or the adaptive budget runs its rounds.

Prefill is a generator (`prefill_steps`): with ``batch`` its final plain pass (recompute, or full prefill) is
yielded as a `RecomputeStep` whose logits the consumer (the batching server) sends back; `prefill` drives it
alone. The functions take the `Engine` as their first argument and reach it through its public members.
"""

from __future__ import annotations

import time

import torch

from kvstitch.core.attention import ForwardPlan
from kvstitch.core.cache import StitchCache
from kvstitch.core.errors import InputError
from kvstitch.core.prompt import PromptLayout
from kvstitch.select import SelectionContext, make_selector
from .batch import RecomputeStep, can_batch
from .budget import AUTO, AutoBudget, adaptive_prefill
from .cold import take_full_prefill
from .precompute import load_chunk_kvs
from .answer import sync
from .request import Prefill
from .stitch import stitch, with_adapter


def recompute_step(cache: StitchCache, layout: PromptLayout, indices: torch.Tensor,
                   plan: ForwardPlan | None = None) -> RecomputeStep:
    """The recompute pass: the selected context tokens plus the suffix, at their global positions."""
    slots = torch.cat([indices.to(torch.long).cpu() + layout.context_start,
                       torch.arange(layout.context_end, layout.n_total)])
    return RecomputeStep(cache, layout.ids[slots], slots, plan)


def compute_full_prefill(engine, layout: PromptLayout, extra: int = 0, plan: ForwardPlan | None = None,
                         logits_to_keep: int = 1) -> tuple[StitchCache, torch.Tensor]:
    """The whole prompt over an empty cache (room for ``extra`` answer tokens) -> (cache, last logits)."""
    cache = StitchCache.empty(engine.adapter, layout.n_total + extra, engine.device, engine.dtype)
    logits = engine.forward(cache, layout.ids, torch.arange(layout.n_total), plan, logits_to_keep)
    return cache, logits


def pass_steps(engine, step: RecomputeStep, batch: bool):
    """Run ``step`` here, or (``batch`` and a plain pass) yield it and take its logits from the consumer."""
    if not (batch and can_batch(step)):
        t0 = time.perf_counter()
        logits = engine.forward(step.cache, step.ids, step.slots, step.plan)
        step.seconds, step.batch_size = time.perf_counter() - t0, 1
        return logits
    logits = yield step
    if logits is None:
        raise InputError("a batched recompute pass needs its logits sent back (Engine.recompute_batch)")
    return logits


def full_prefill_steps(engine, layout: PromptLayout, extra: int, batch: bool, stats: dict):
    """`Engine.full_prefill` (lone), or as a `RecomputeStep` when ``batch``: the whole prompt over an empty
    cache -> (cache, logits)."""
    if not batch:
        t0 = time.perf_counter()
        cache, logits = engine.full_prefill(layout, extra=extra)
        stats.update(recompute_s=time.perf_counter() - t0, ratio_used=1.0)
        return cache, logits
    cache = StitchCache.empty(engine.adapter, layout.n_total + extra, engine.device, engine.dtype)
    step = RecomputeStep(cache, layout.ids, torch.arange(layout.n_total))
    logits = yield from pass_steps(engine, step, batch)
    stats.update(recompute_s=step.seconds, ratio_used=1.0, recompute_batch=step.batch_size)
    return cache, logits


def prefill_steps(engine, layout: PromptLayout, selector, ratio, max_new_tokens: int, stats: dict,
                  auto: AutoBudget | dict | None = None, cold: bool = False, batch: bool = False):
    """Prefill ``layout`` with ``selector`` at ``ratio`` (a fraction or "auto"), recording in ``stats``;
    ``cold``: the cold-path policy applies (`kvstitch.engine.cold`). A generator (module doc) -> `Prefill`."""
    if selector.full_prefill:
        cache, logits = yield from full_prefill_steps(engine, layout, max_new_tokens, batch, stats)
        return Prefill(cache, layout, logits, torch.arange(layout.n_context), stats, selector)
    if ratio == AUTO:
        return auto_prefill(engine, layout, selector, max_new_tokens, stats, auto)
    if cold and take_full_prefill(engine, layout, stats):  # cold store: full prefill answers, chunks computed later
        cache, logits = yield from full_prefill_steps(engine, layout, max_new_tokens, batch, stats)
        return Prefill(cache, layout, logits, torch.arange(layout.n_context), stats, make_selector("full"))
    return (yield from stitched_steps(engine, layout, selector, ratio, max_new_tokens, stats, batch))


def stitched_steps(engine, layout: PromptLayout, selector, ratio: float, max_new_tokens: int, stats: dict,
                   batch: bool = False):
    """Stitch, select ``ratio`` of the context, recompute (module doc) -> `Prefill`."""
    kvs = load_chunk_kvs(engine, layout, stats, anchors=selector.chunk_anchors())
    t1 = time.perf_counter()
    layout, adapted = with_adapter(engine, layout, 0.0 if selector.zero_budget else ratio, stats)
    cache = stitch(engine, layout, kvs, extra=max_new_tokens, adapted=adapted)
    sync(engine.device)
    t2 = time.perf_counter()
    ctx = SelectionContext(engine, cache, layout, round(ratio * layout.n_context), stats,
                           precompute=engine.precompute_mode, chunks=kvs, score_hook=engine.hooks.score)
    indices, _ = selector.select(ctx)
    layout, cache = ctx.layout, ctx.cache  # a selector may reorder chunks (InfoFlow)
    sync(engine.device)
    t3 = time.perf_counter()
    step = recompute_step(cache, layout, indices, selector.recompute_plan(ctx))
    logits = yield from pass_steps(engine, step, batch)
    sync(engine.device)
    stats.update(assemble_s=t2 - t1, select_s=t3 - t2, recompute_s=time.perf_counter() - t3,
                 ratio_used=indices.numel() / max(layout.n_context, 1))
    if batch and step.seconds is not None:  # the pass's own time, not the wait for the requests packed with it
        stats.update(recompute_s=step.seconds, recompute_batch=step.batch_size)
    return Prefill(cache, layout, logits, indices, stats, selector)


def auto_prefill(engine, layout: PromptLayout, selector, max_new_tokens: int, stats: dict,
                 auto: AutoBudget | dict | None = None) -> Prefill:
    """recompute_ratio="auto": the rounds of `kvstitch.engine.budget`; full prefill answers when none converged
    below the ceiling. ``auto`` None: the engine's ``default_auto``."""
    t0 = time.perf_counter()
    budget = AutoBudget.of(engine.default_auto if auto is None else auto)
    stats["auto_spec"] = budget.spec
    got = adaptive_prefill(engine, layout, selector, budget, max_new_tokens, stats, selector.recompute_plan)
    if got is None:
        t1 = time.perf_counter()
        cache, logits = engine.full_prefill(layout, extra=max_new_tokens)
        stats.update(ratio_used=1.0, recompute_cost=stats["recompute_cost"] + 1.0,
                     fallback_s=time.perf_counter() - t1, recompute_s=time.perf_counter() - t0)
        return Prefill(cache, layout, logits, torch.arange(layout.n_context), stats, selector)
    stats["recompute_s"] = time.perf_counter() - t0
    return Prefill(got.cache, got.layout, got.logits, got.indices, stats, selector, greedy=got.greedy)


def prefill(engine, layout: PromptLayout, selector, ratio, max_new_tokens: int, stats: dict,
            auto: AutoBudget | dict | None = None, cold: bool = False) -> Prefill:
    """`prefill_steps` run alone (no pass is handed out) -> `Prefill`."""
    steps = prefill_steps(engine, layout, selector, ratio, max_new_tokens, stats, auto, cold)
    try:
        next(steps)
    except StopIteration as done:
        return done.value
    raise RuntimeError("a lone prefill yielded a recompute step")
