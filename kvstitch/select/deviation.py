"""Deviation-based selection with the low-layer approximation: CacheBlend and KVShare.

Both run one *scoring pass* of the primary model over every context token (and, for KVShare, the
suffix), out-of-place (the stitched cache is not touched), stopped as soon as layer 1's attention is
entered (`SelectionContext.fresh_pass`):

- layer 0 is recomputed for all of them against the exact prefix K/V, so its output is exactly what a
  full prefill computes there;
- layer 1's fresh K/V (captured as the pass enters layer 1) are therefore the full-prefill layer-1 K/V, and its
  fresh V can be compared with the stitched (precomputed-per-chunk) layer-1 V.

`cacheblend` (Yao et al., EuroSys 2025, "selecting which tokens to recompute": HKVD tokens), as
    CacheClip Sec. 2.6 and ProphetKV App. C Table 3 describe it:
    alpha(t) = ||dV_t||_2, dV_t = V_t(fresh, layer 1) - V'_t(stitched, layer 1), L2 over all KV heads'
    dims together (the reference implementation, vllm_blend's xformers backend with check layer 1,
    sums the squared V difference over heads and dims before its top-k). CacheBlend's "gradual
    filtering" narrows the set further on later layers; kvstitch recomputes one fixed set through all
    layers, so the selection is this layer-1 top-k (as in ProphetKV's comparison).

`kvshare` (Yang et al. 2025, "KVShare", arXiv 2503.16525; as ProphetKV App. C Table 3 defines it):
    alpha(t) = (sum_n Phi_{n,t}) * ||dV_t||_1, Phi the layer-1 attention of input token n to t (the
    *fresh* attention of the scoring pass, i.e. the full-prefill attention at that layer), summed over all
    input tokens n that can see t (context + suffix; prefix tokens precede every context token) and
    averaged over query heads (per query head first, then the mean: docs/design.md's GQA rule); ||dV_t||_1
    over all KV heads' dims. The [n, n] attention exists only at this one layer and is reduced to column
    sums in query blocks, so memory stays O(block * N).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvstitch.core.attention import attention_probs
from .context import FreshPass, SelectionContext
from .method import Selector, register

SCORE_LAYER = 1  # "the second layer" of CacheBlend: the first whose V depends on cross-chunk attention
_BLOCK_BYTES = 64 << 20  # float32 probabilities per query block of the column-sum pass

LowLayerPass = FreshPass  # what the scoring pass measured (see `SelectionContext.fresh_pass`)


def score_layer(n_layers: int) -> int:
    return min(SCORE_LAYER, n_layers - 1)


@torch.no_grad()
def low_layer_pass(ctx: SelectionContext, include_suffix: bool = False, with_queries: bool = False) -> FreshPass:
    """Recompute layer 0 (and layer 1's projections) for all context tokens (+ suffix) out of place; the
    stitched cache is untouched. Layer 1's attention itself is never computed: its fresh K/V/Q are all the
    scores need."""
    lay = ctx.layout
    q = (lay.n_total if include_suffix else lay.context_end) - lay.context_start
    return ctx.fresh_pass(score_layer(ctx.num_layers), include_suffix=include_suffix,
                          queries=q if with_queries else 0)


@torch.no_grad()
def attention_received(ctx: SelectionContext, lp: FreshPass) -> torch.Tensor:
    """[n_context] sum over the pass's queries n of Phi_{n,t} at ``lp.layer``, mean over query heads."""
    cache, lay = ctx.cache, ctx.layout
    c0, c1 = lay.context_start, lay.context_end
    layer = lp.layer
    scaling = ctx.attention_scaling(layer)
    # none of the supported families (llama, qwen2/3, mistral, gemma3) passes a logit softcap to the
    # attention interface; the window is the model's per-layer one, exactly what the masks use.
    window = ctx.sliding_window(layer)
    keys = torch.cat([cache.layers[layer].keys[0, :, :c0], lp.fresh_keys.to(cache.layers[layer].keys.dtype)], 1)
    n_keys, hq = keys.shape[1], lp.queries.shape[0]
    block = max(1, _BLOCK_BYTES // (4 * hq * n_keys))
    col = torch.zeros(hq, c1 - c0, dtype=torch.float32, device=keys.device)
    for a in range(0, lp.slots.numel(), block):
        probs = attention_probs(lp.queries[None, :, a:a + block], keys[None], lp.slots[a:a + block], scaling, window)
        col += probs[:, :, c0:c1].sum(1)
    return col.mean(0)


@register
@dataclass
class CacheBlend(Selector):
    """CacheBlend: the tokens whose layer-1 V deviates most from the stitched cache (||dV||_2)."""

    name: ClassVar[str] = "cacheblend"

    def score(self, ctx: SelectionContext) -> torch.Tensor:
        lp = low_layer_pass(ctx)
        ctx.stats["score_layer"] = lp.layer
        return lp.delta_v.pow(2).sum((0, 2)).sqrt().cpu()


@register
@dataclass
class KVShare(Selector):
    """KVShare: attention received at layer 1 times the layer-1 V deviation (||dV||_1)."""

    name: ClassVar[str] = "kvshare"

    def score(self, ctx: SelectionContext) -> torch.Tensor:
        lp = low_layer_pass(ctx, include_suffix=True, with_queries=True)
        ctx.stats["score_layer"] = lp.layer
        phi = attention_received(ctx, lp)
        return (phi * lp.delta_v.abs().sum((0, 2))).cpu()
