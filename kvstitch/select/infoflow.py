"""InfoFlow KV (paper: infoflow-kv): prompt-to-context attention norms under GLOBAL RoPE geometry.

Sec. 4.2, Eq. 7: the importance of context token j is the attention mass it receives from all prompt
(question) tokens, s_j = Σ_i A_ij, i.e. the L1 norm of column j of the prompt-to-context attention
matrix ("attention norm"); top-k (Eq. 8). It must be computed under an inference-consistent RoPE
geometry (Sec. 4.2 "RoPE Geometry", Table 1: GLOBAL best): context keys re-rotated to their global
positions and the prompt at its global positions - exactly the naively stitched cache. App. B: the norms
come from an intermediate-to-late layer band (layers 22-25 of Qwen3-14B's 40, used for all their models);
scaled to depth here: ``band=(0.55, 0.65)`` -> layers floor(0.55 L) .. ceil(0.65 L) - 1, averaged.
Heads: per query head, mean within each KV group, then over groups. ``weight="value"`` is an optional
variant, Σ_i ||A_ij v_j|| = s_j ||v_j|| (attention-output contribution norm); the paper's Eq. 7 is
``"mass"`` (default).

`infoflow_reorder` (Sec. 4.3 "KV reorder", Sec. 5.1): a first selection round within each chunk
independently under HL-TP geometry (each chunk at its chunk-local precompute positions, right after the
shared prefix, prompt at its global positions; the other chunks are masked out), so chunks are scored on
equal footing and chunks near the prompt are not favoured; chunks are reordered so the most important
sits nearest the prompt (last); then the stitched cache is rebuilt for the new order and the final
selection runs under GLOBAL geometry. Chunk importance (the paper does not give a formula): the
attention mass of the chunk's tokens among the top-``budget`` tokens of the first round.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..cache import StitchCache
from ..errors import BadMethodOption
from .base import SelectionContext, Selector, register
from .scoring import band_layers, layer_mean, query_attention


@register
@dataclass
class InfoFlow(Selector):
    name: ClassVar[str] = "infoflow"
    band: tuple[float, float] = (0.55, 0.65)
    layers: tuple[int, ...] | None = None  # explicit layers (overrides band)
    weight: str = "mass"  # "mass" (Eq. 7) or "value"

    def __post_init__(self):
        if self.weight not in ("mass", "value"):
            raise BadMethodOption(f"{self.name}: weight must be 'mass' or 'value', got {self.weight!r}")
        lo, hi = self.band
        if not 0.0 <= lo <= hi <= 1.0:
            raise BadMethodOption(f"{self.name}: band must satisfy 0 <= lo <= hi <= 1, got {self.band}")

    def scoring_layers(self, n_layers: int) -> list[int]:
        if self.layers is not None:
            bad = [i for i in self.layers if not 0 <= i < n_layers]
            if bad or not self.layers:
                raise BadMethodOption(f"{self.name}: layers must be within 0..{n_layers - 1}, got {self.layers}")
            return sorted(set(self.layers))
        return band_layers(n_layers, self.band)

    def token_scores(self, engine, cache, layout, key_keep=None) -> torch.Tensor:
        layers = self.scoring_layers(engine.adapter.num_layers)
        per_layer = query_attention(engine, cache, layout, layers, key_keep=key_keep)
        if self.weight == "value":
            c0, c1 = layout.context_start, layout.context_end
            for i, att in per_layer.items():
                vnorm = cache.layers[i].values[0, :, c0:c1].float().norm(dim=-1)  # [Hkv, n]
                per_layer[i] = att * vnorm.repeat_interleave(att.shape[0] // vnorm.shape[0], 0)
        return layer_mean(per_layer, engine.adapter.num_kv_heads)

    def score(self, ctx: SelectionContext) -> torch.Tensor:
        return self.token_scores(ctx.engine, ctx.cache, ctx.layout)


@register
@dataclass
class InfoFlowReorder(InfoFlow):
    name: ClassVar[str] = "infoflow_reorder"

    def local_scores(self, ctx: SelectionContext, kvs) -> list[torch.Tensor]:
        """First round, HL-TP: per chunk, the prompt (global positions) over prefix + that chunk alone at its
        precompute positions; the slots of the other chunks are masked out. -> one score vector per chunk."""
        eng, layout = ctx.engine, ctx.layout
        pk, pv = eng.prefix_kv(layout.prefix_ids)
        p, c1 = layout.n_prefix, layout.context_end
        tmp = StitchCache.from_stacked(pk, pv, capacity=layout.n_total)
        out = []
        for kv in kvs:
            n = kv.n_tokens
            for i, layer in enumerate(tmp.layers):
                layer.keys[0, :, kv.start:kv.start + n] = kv.keys[i]
                layer.values[0, :, kv.start:kv.start + n] = kv.values[i]
                layer.length = c1
            keep = torch.zeros(layout.n_total, dtype=torch.bool, device=eng.device)
            keep[:kv.start + n] = True
            keep[c1:] = True
            s = self.token_scores(eng, tmp, layout, key_keep=keep)
            out.append(s[kv.start - p:kv.start - p + n])
        return out

    def chunk_order(self, ctx: SelectionContext, kvs) -> tuple[list[int], list[float]]:
        """-> (new order as indices into the current chunks, most important last; importance per chunk)."""
        local = self.local_scores(ctx, kvs)
        flat = torch.cat(local)
        chunk_of = torch.cat([torch.full((s.numel(),), i) for i, s in enumerate(local)])
        m = min(max(ctx.budget, 1), flat.numel())
        top = torch.sort(flat, descending=True, stable=True).indices[:m]
        importance = torch.zeros(len(local), dtype=torch.float64)
        importance.index_add_(0, chunk_of[top], flat[top].double())
        order = torch.sort(importance, stable=True).indices.tolist()  # ascending: most important last
        return order, importance.tolist()

    def select(self, ctx: SelectionContext):
        if len(ctx.layout.chunk_ids) > 1:
            eng, layout = ctx.engine, ctx.layout
            kvs = eng.chunk_kvs(layout)
            order, importance = self.chunk_order(ctx, kvs)
            extra = max(0, ctx.cache.layers[0].capacity - layout.n_total)
            ctx.layout = layout.reordered(order)
            ctx.cache = eng.stitch(ctx.layout, [kvs[i] for i in order], extra=extra)
            ctx.stats.update(order=list(ctx.layout.order), chunk_importance=importance)
        return super().select(ctx)  # second round: GLOBAL geometry over the reordered prompt
