"""Shared helpers for attention-based selectors (ProphetKV, A3, InfoFlow, oracle, A3's eviction).

`query_attention` runs the suffix (question + end of turn + assistant header) at its global slots over a
cache, with an attention hook on the requested layers, and returns per layer the attention of every
query head averaged over the suffix tokens, restricted to the context columns: ``[Hq, n_context]``.
That is ProphetKV's Φ̂'_{Q,t} per head (Eq. 5 notation); reducers below aggregate heads and layers.

GQA (docs/design.md, pitfalls): attention is computed per query head (the hook's probabilities already are), then
averaged within each KV group (`group_mean`) - never average the queries first.

Cost: one forward of |Q| tokens, stopped after the last requested layer; O(|Q| N) per hooked layer.
The pass writes the suffix K/V into the cache's suffix slots (``write=True``): the stitched context
slots are untouched, and the recompute pass rewrites every suffix slot before anything reads them
(context queries only see keys at slots <= their own), so no out-of-place copy of the cache is needed.
"""

from __future__ import annotations

from typing import Iterable

import torch


def query_attention(engine, cache, layout, layers: Iterable[int] | None = None, *,
                    key_keep: torch.Tensor | None = None) -> dict[int, torch.Tensor]:
    """{layer: [Hq, n_context] float32}: suffix-averaged attention of each query head to each context token
    (`SelectionContext.query_attention` over ``engine``'s model; for callers holding an engine, e.g. A3's
    decode plan)."""
    from .context import SelectionContext

    return SelectionContext(engine, cache, layout, 0).query_attention(layers, key_keep=key_keep)


def group_mean(per_head: torch.Tensor, n_kv_heads: int) -> torch.Tensor:
    """[Hq, n] -> [Hkv, n]: mean over the query heads of each KV group (q head h uses KV head h // rep)."""
    hq, n = per_head.shape
    return per_head.view(n_kv_heads, hq // n_kv_heads, n).mean(dim=1)


def head_mean(per_head: torch.Tensor, n_kv_heads: int) -> torch.Tensor:
    """[Hq, n] -> [n]: mean within each KV group, then over the groups."""
    return group_mean(per_head, n_kv_heads).mean(dim=0)


def layer_mean(per_layer: dict[int, torch.Tensor], n_kv_heads: int) -> torch.Tensor:
    """Uniform fusion over layers (ProphetKV Eq. 7) of the head-averaged scores -> [n] float32 (cpu)."""
    return torch.stack([head_mean(per_layer[i], n_kv_heads) for i in sorted(per_layer)]).mean(dim=0).float().cpu()


def band_layers(n_layers: int, band: tuple[float, float]) -> list[int]:
    """Layers [floor(lo*L), ceil(hi*L) - 1] (at least one): (0.55, 0.65) of 40 layers -> 22..25,
    InfoFlow's band on Qwen3-14B; 30 layers (SmolLM2) -> 16..19; 4 layers -> [2]."""
    import math

    lo, hi = band
    if not 0.0 <= lo <= hi <= 1.0:
        raise ValueError(f"band must satisfy 0 <= lo <= hi <= 1, got {band}")
    first = min(int(math.floor(lo * n_layers)), n_layers - 1)
    last = min(max(first, int(math.ceil(hi * n_layers)) - 1), n_layers - 1)
    return list(range(first, last + 1))
