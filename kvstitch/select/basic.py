"""Reference points: full prefill, naive reuse (0% recompute) and uniform random selection."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .context import SelectionContext
from .method import Selector, register


@register
@dataclass
class Full(Selector):
    """Full prefill of the same prompt ids: the accuracy reference (no reuse at all)."""

    name: ClassVar[str] = "full"
    full_prefill: ClassVar[bool] = True

    def score(self, ctx: SelectionContext) -> torch.Tensor:
        return torch.ones(ctx.n_context)


@register
@dataclass
class Naive(Selector):
    """Naive position-independent reuse: stitched caches, nothing recomputed (budget forced to 0)."""

    name: ClassVar[str] = "naive"
    zero_budget: ClassVar[bool] = True

    def score(self, ctx: SelectionContext) -> torch.Tensor:
        return torch.zeros(ctx.n_context)


@register
@dataclass
class Random(Selector):
    """Uniformly random tokens at the ratio, seeded (the budget-matched control)."""

    name: ClassVar[str] = "random"
    seed: int = 0

    def score(self, ctx: SelectionContext) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed)
        return torch.rand(ctx.n_context, generator=g)
