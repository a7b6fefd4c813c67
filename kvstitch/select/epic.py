"""EPIC (Hu et al. 2024, "EPIC: Efficient Position-Independent Context Caching", arXiv 2410.15332),
its LegoLink recompute: the first tokens of every chunk, a static, input-independent rule.

ProphetKV (Appendix C, Table 3) writes EPIC's value function as alpha(t) = -(distance of t to its
chunk's start). Taking the top-k of that score with ties broken by position (`top_k_indices` is
stable) is exactly "spread the budget evenly over the chunks":

- every chunk gets floor(budget / n_chunks) head tokens, the remainder goes to the earliest chunks
  (at the last distance level the tied tokens are taken in position order);
- a chunk shorter than its share runs out of tokens and its unused share flows to the other chunks
  (they simply continue to the next distance level), so the budget stays exact.

"Chunk start" is the first token of the chunk *piece*, i.e. including the leading separator that
`PromptBuilder.chunk_piece` adds: that is where the precomputed chunk's attention sink sits.

The first chunk under a shared prefix: with kvstitch's ``shared_prefix`` precompute (APE / CacheClip
Sec. 3.1) the *first* chunk's cache is already exact (it was precomputed right after the same prefix at
the same positions, which is what a full prefill computes there), so recomputing its head tokens buys
nothing. By default (``skip_first_chunk=None``) EPIC then gives the first chunk no budget and spreads it
over the other chunks (falling back to chunk 0 only when they are exhausted); in ``isolated`` precompute
mode (each chunk from position 0 on its own, the paper's setting) every chunk, the first included, gets
its share. ``skip_first_chunk=True``/``False`` forces either rule; ``stats["epic_skip_first_chunk"]``
says which ran.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .context import SelectionContext
from .method import Selector, register


def distance_to_chunk_start(chunk_lengths: list[int]) -> torch.Tensor:
    """[n_context] distance of every context token to the first token of its chunk."""
    return torch.cat([torch.arange(n, dtype=torch.long) for n in chunk_lengths]) if chunk_lengths else \
        torch.zeros(0, dtype=torch.long)


@register
@dataclass
class Epic(Selector):
    """EPIC/LegoLink: the first tokens of every chunk, the budget spread evenly over the chunks."""

    name: ClassVar[str] = "epic"
    skip_first_chunk: bool | None = None  # None: skip exactly when the shared prefix makes chunk 0 exact

    def skips_first_chunk(self, ctx: SelectionContext) -> bool:
        if self.skip_first_chunk is not None:
            return bool(self.skip_first_chunk)
        return ctx.precompute == "shared_prefix"

    def score(self, ctx: SelectionContext) -> torch.Tensor:
        lengths = [int(c.numel()) for c in ctx.layout.chunk_ids]
        score = -distance_to_chunk_start(lengths).float()
        skip = self.skips_first_chunk(ctx)
        ctx.stats["epic_skip_first_chunk"] = skip
        if skip and len(lengths) > 1:
            score[:lengths[0]] -= float(max(lengths) + 1)  # after every head of the later chunks
        return score
