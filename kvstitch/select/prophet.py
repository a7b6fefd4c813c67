"""ProphetKV (Wang et al. 2026): user-query-driven selection with layer fusion.

Sec. 4.2: the practical value function is α_l(t) = Φ̂'_{Q,t}, the attention of the user-query tokens
(averaged over them) to context token t over the *imprecise* (naively stitched) caches. Sec. 4.3 / Alg. 1,
Stage I: one lightweight pass of the query tokens through ALL layers over the stitched cache, O(|Q| N)
per layer; Eq. 7: uniform fusion ᾱ(t) = 1/L Σ_l α_l(t); top-k. Stage II (the engine's recompute) then
recomputes the selected tokens (+ the query) through all layers at their global positions.

Query tokens Q = the suffix (question, end of turn, assistant header), as in App. B where the query
segment carries the question and the answer cue. Heads: per query head, mean within each KV group,
then over groups (the paper takes a mean over heads, App. F).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .context import SelectionContext
from .method import Selector, register
from .attention_scores import head_mean, layer_mean


@register
@dataclass
class Prophet(Selector):
    name: ClassVar[str] = "prophet"

    def score(self, ctx: SelectionContext) -> torch.Tensor:
        per_layer = ctx.query_attention()  # Stage I: every layer
        return layer_mean(per_layer, ctx.num_kv_heads)

    def layer_scores(self, ctx: SelectionContext) -> dict[int, torch.Tensor]:
        """{layer: [n_context]} α_l(t) before the fusion (`score` is their mean): deltaprop's ``fusion="union"``."""
        return {i: head_mean(a, ctx.num_kv_heads).float().cpu() for i, a in ctx.query_attention().items()}
