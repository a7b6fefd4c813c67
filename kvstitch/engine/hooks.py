"""`EngineHooks`: the seams a harness uses to reuse work the engine would redo (the eval reuses a sample's
full prefill and memoises scores across ratios), instead of replacing engine or selector methods at run time.
Set them for a block of work with `Engine.hooked`; None = the engine computes as usual."""

from __future__ import annotations

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
