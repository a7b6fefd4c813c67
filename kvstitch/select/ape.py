"""`ape`: Adaptive Parallel Encoding (Yang, Chen, Chen, ICLR 2025), as the A3 paper describes it:
"a shared prefix and tunable attention temperatures and scaling factors"; no recompute.

- Shared prefix: every chunk is precomputed after the same prefix (the engine always does this).
- Attention temperature T and scaling factor S on the attention of the query (and of every generated
  token) to the parallel-encoded context: `kvstitch.core.attention._ape_attention` (softmax(s/T) inside
  the context, the context block's LogSumExp scaled by S). Defaults T = S = 0.9 (APE's defaults).
- Nothing is recomputed (``zero_budget``): the suffix pass and the decode steps use the APE plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvstitch.core.attention import ForwardPlan
from kvstitch.core.errors import BadMethodOption
from .context import SelectionContext
from .method import Selector, register


@register
@dataclass
class Ape(Selector):
    name: ClassVar[str] = "ape"
    zero_budget: ClassVar[bool] = True
    temperature: float = 0.9
    scale: float = 0.9

    def __post_init__(self):
        super().__post_init__()
        if not self.temperature > 0 or not self.scale > 0:
            raise BadMethodOption(f"ape: temperature and scale must be > 0, got {self.temperature}, {self.scale}")

    def score(self, ctx: SelectionContext) -> torch.Tensor:
        return torch.zeros(ctx.n_context)

    def plan(self, layout) -> ForwardPlan:
        return ForwardPlan(ape=(float(self.temperature), float(self.scale), layout.context_start,
                                layout.context_end))

    def recompute_plan(self, ctx: SelectionContext) -> ForwardPlan:
        return self.plan(ctx.layout)

    def decode_plan(self, engine, cache, layout, stats: dict) -> ForwardPlan:
        return self.plan(layout)
