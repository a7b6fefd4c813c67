"""`EngineHooks`: the seams a harness uses to reuse work the engine would redo (the eval reuses a sample's
full prefill and memoises scores across ratios), instead of replacing engine or selector methods at run time.
Set them for a block of work with `Engine.hooked`; None = the engine computes as usual."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable


@dataclass
class EngineHooks:
    # every full prefill the engine runs (method "full" alone, the adaptive budget's fallback, the guard):
    # ``(layout, extra, plan, logits_to_keep, compute) -> (cache, logits)``, where ``compute`` takes the same
    # four arguments and runs it
    full_prefill: Callable | None = None
    # the scoring of the request's method (`SelectionContext.scores`): ``(selector, ctx, compute) -> scores``,
    # where ``compute(ctx)`` is the method's own `score`
    score: Callable | None = None


@contextlib.contextmanager
def hooked(hooks: EngineHooks, **fns):
    """`Engine.hooked`: set ``fns`` on ``hooks`` for the block, then restore the ones before."""
    unknown = sorted(set(fns) - set(vars(hooks)))
    if unknown:
        raise TypeError(f"unknown engine hook {unknown[0]!r}; the hooks: {', '.join(vars(hooks))}")
    before = {k: getattr(hooks, k) for k in fns}
    for k, fn in fns.items():
        setattr(hooks, k, fn)
    try:
        yield hooks
    finally:
        for k, fn in before.items():
            setattr(hooks, k, fn)
