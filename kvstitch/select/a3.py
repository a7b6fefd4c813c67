"""A3, Attention-Aware Accurate KV Cache Fusion (paper: a3-attention-aware-fusion).

Selection (Sec. "Attention Recovery", Eq. 3): layers are indexed 0..L-1; the input passes through the
embedding and decoder block 0, "producing the actual Q, K, V at layer 1". At layer 1 the attention of
every question token to every document token is computed and summed over the question tokens; the
top r*N document tokens are recomputed (Eq. 4-5). Here: one pass of the suffix (the question tokens)
over the stitched cache, hooked at ``layer`` (default 1) and stopped right after it; per query head,
mean within each KV group, then over groups (the paper does not say how heads are combined). Layer-0
K/V of stitched tokens are exact after position recovery (they depend on token and position only), so
layer 1 is the first layer whose keys carry the missing cross-chunk attention.

Extension (Sec. "Extention"): SnapKV-style eviction after the first token. The system prompt (prefix)
and the question (suffix) are kept whole; of the context, the top ``evict_capacity`` tokens per layer
and KV head are kept, scored SnapKV-style: attention of the observation window (the question tokens)
to each context token, per query head, averaged within the KV group, smoothed by a 1-D average pool
(``evict_kernel``, SnapKV's default 5). Generated tokens are always kept. The dense cache keeps its
layout; evicted keys are masked per layer and KV head in the attention function
(`ForwardPlan.key_keep`), which is numerically what attending over the physically evicted cache gives,
but frees no memory (the paged decoders in `kvstitch.decode` are where memory is actually saved).
The score is computed over the final (recomputed) cache by one more pass of the question tokens, so it
sees exactly the K/V the decode will read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

import time

from kvstitch.core.attention import ForwardPlan, attention_probs
from kvstitch.core.errors import BadMethodOption
from .context import SelectionContext
from .method import Selector, register
from .attention_scores import group_mean, head_mean


@register
@dataclass
class A3(Selector):
    name: ClassVar[str] = "a3"
    layer: int = 1
    evict_capacity: int | None = None  # context tokens kept per layer and KV head during decode; None = off
    evict_kernel: int = 5
    # True: scored on the stitched cache, the suffix's layer-1 attention over the precomputed (re-rotated)
    # layer-1 keys, no block-0 pass (ProphetKV's "Layer1"; alias `a3_stitched`)
    stitched: bool = False

    def __post_init__(self):
        super().__post_init__()
        if self.layer < 0:
            raise BadMethodOption(f"a3: layer must be >= 0, got {self.layer}")
        if self.evict_capacity is not None and self.evict_capacity < 0:
            raise BadMethodOption(f"a3: evict_capacity must be >= 0, got {self.evict_capacity}")
        if self.evict_kernel < 1 or self.evict_kernel % 2 == 0:
            raise BadMethodOption(f"a3: evict_kernel must be a positive odd number, got {self.evict_kernel}")

    def scoring_layer(self, n_layers: int) -> int:
        return min(self.layer, n_layers - 1)

    def actual_qk(self, ctx: SelectionContext) -> tuple[int, torch.Tensor, torch.Tensor]:
        """The block-0 pass (Eq. 3): -> (layer, suffix queries [Hq, n_suffix, d] post-RoPE, keys [Hkv, n_total, d]
        at slots 0..n_total-1: the exact prefix keys, then the pass's fresh context + suffix keys)."""
        lay = ctx.layout
        fp = ctx.fresh_pass(self.scoring_layer(ctx.num_layers), include_suffix=True, queries=lay.n_suffix)
        prefix_k = ctx.cache.layers[fp.layer].keys[0, :, :lay.context_start]
        keys = torch.cat([prefix_k, fp.fresh_keys.to(prefix_k.dtype)], dim=1)
        return fp.layer, fp.queries, keys

    def score(self, ctx: SelectionContext) -> torch.Tensor:
        if self.stitched:
            return self.stitched_score(ctx)
        t0 = time.perf_counter()
        lay = ctx.layout
        layer, q, keys = self.actual_qk(ctx)
        slots = torch.arange(lay.context_end, lay.n_total, device=keys.device)
        probs = attention_probs(q[None], keys[None], slots, ctx.attention_scaling(layer), ctx.sliding_window(layer))
        att = probs[:, :, lay.context_start:lay.context_end].mean(dim=1)  # [Hq, n_context]
        ctx.stats.update(score_layer=layer, a3_block0_pass_s=time.perf_counter() - t0)
        return head_mean(att, ctx.num_kv_heads).float().cpu()

    # ---- the eviction extension ---------------------------------------------------------------
    def eviction_mask(self, engine, cache, layout) -> torch.Tensor:
        """bool [L, Hkv, n_total]: prefix and suffix kept, ``evict_capacity`` context tokens per layer/head."""
        ctx = SelectionContext(engine, cache, layout, 0)
        c0, c1, n = layout.context_start, layout.context_end, layout.n_context
        keep = torch.ones(ctx.num_layers, ctx.num_kv_heads, layout.n_total, dtype=torch.bool, device=ctx.device)
        cap = min(int(self.evict_capacity), n)
        if cap >= n:
            return keep
        per_layer = ctx.query_attention()
        keep[:, :, c0:c1] = False
        for layer, att in per_layer.items():
            s = group_mean(att, ctx.num_kv_heads)  # [Hkv, n_context]
            k = self.evict_kernel
            s = F.avg_pool1d(s[:, None], kernel_size=k, stride=1, padding=k // 2, count_include_pad=False)[:, 0]
            top = torch.topk(s, cap, dim=-1).indices  # [Hkv, cap]
            keep[layer, :, c0:c1].scatter_(1, top.to(keep.device), True)
        return keep

    def adjusts_decode(self) -> bool:
        return self.evict_capacity is not None

    def decode_plan(self, engine, cache, layout, stats: dict) -> ForwardPlan | None:
        if self.evict_capacity is None:
            return None
        keep = self.eviction_mask(engine, cache, layout)
        ctx_kept = keep[:, :, layout.context_start:layout.context_end].sum(-1)
        stats.update(evict_capacity=int(self.evict_capacity), evicted_per_head=int(layout.n_context - ctx_kept.min()),
                     kv_kept_per_head=int(layout.n_prefix + layout.n_suffix + ctx_kept.max()))
        return ForwardPlan(key_keep=keep)

    def stitched_score(self, ctx: SelectionContext) -> torch.Tensor:
        """``stitched=True``: the suffix's attention at ``layer`` over the stitched cache (no block-0 pass)."""
        layer = self.scoring_layer(ctx.num_layers)
        att = ctx.query_attention([layer])[layer]
        ctx.stats["score_layer"] = layer
        return head_mean(att, ctx.num_kv_heads).float().cpu()
