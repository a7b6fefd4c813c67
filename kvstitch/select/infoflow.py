"""InfoFlow KV (paper: infoflow-kv): prompt-to-context attention norms under GLOBAL RoPE geometry.

Sec. 4.2, Eq. 7: the importance of context token j is the attention mass it receives from all prompt
(question) tokens, s_j = Σ_i A_ij, i.e. the L1 norm of column j of the prompt-to-context attention
matrix ("attention norm"); top-k (Eq. 8). It must be computed under an inference-consistent RoPE
geometry (Sec. 4.2 "RoPE Geometry", Table 1: GLOBAL best): context keys re-rotated to their global
positions and the prompt at its global positions - exactly the naively stitched cache. App. B: the norms
come from layers 22-25, "for all models in our experiments" (found on Qwen). kvstitch uses those absolute
layers (``absolute_layers``) whenever the model has them (>= 26 layers, e.g. SmolLM2's 30), and a
depth-scaled band only for shallower models (``band=(0.55, 0.65)`` of L layers -> floor(0.55 L) ..
ceil(0.65 L) - 1: 22-25 of 40; Gemma 3 270M's 18 -> 9-11); the norms are averaged over the layers.
``layers=`` overrides both. ``stats["infoflow_layers"]`` / ``stats["infoflow_layer_rule"]`` ("absolute",
"depth_scaled" or "explicit") say which ran.
Heads: per query head, mean within each KV group, then over groups. ``weight="value"`` is an optional
variant, Σ_i ||A_ij v_j|| = s_j ||v_j|| (attention-output contribution norm); the paper's Eq. 7 is
``"mass"`` (default).

``reorder`` (Sec. 4.3 "KV reorder", Sec. 5.1; None = off, alias `infoflow_reorder`): a first selection round within each chunk
independently under HL-TP geometry (each chunk at its chunk-local precompute positions, right after the
shared prefix, prompt at its global positions; the other chunks are masked out), so chunks are scored on
equal footing and chunks near the prompt are not favoured; chunks are reordered so the most important
sits nearest the prompt (last); then the stitched cache is rebuilt for the new order and the final
selection runs under GLOBAL geometry. In ``isolated`` precompute mode (chunks precomputed from position 0),
the first round re-rotates each chunk to the same local positions right after the prefix.

Chunk importance: the paper gives no formula ("we first derive chunk-level importance scores" from "an
initial round of token selection within each chunk"), so it is the value of ``reorder``:

- ``"topk_mass"`` (default): the first-round scores of every chunk are pooled, the top-``budget`` tokens
  taken (the first round's selection), and a chunk's importance is the attention mass of its tokens in
  that selection (sum of their scores): how much of what the selection would recompute lies in the chunk.
- ``"max"``: the chunk's single highest first-round token score (a needle-like chunk, where a few tokens
  draw the prompt's attention, wins even when the rest of it is filler).

The alias `infoflow_reorder_max` is ``reorder="max"``, so the eval compares the two rules.
Ties keep the original order (stable sort).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

from kvstitch.core.cache import StitchCache
from kvstitch.core.errors import BadMethodOption
from .context import SelectionContext
from .method import Selector, register
from .attention_scores import band_layers, head_mean, layer_mean


@register
@dataclass
class InfoFlow(Selector):
    name: ClassVar[str] = "infoflow"
    band: tuple[float, float] = (0.55, 0.65)  # depth-scaled band: models with fewer layers than absolute ones
    layers: tuple[int, ...] | None = None  # explicit layers (overrides absolute_layers and band)
    weight: Literal["mass", "value"] = "mass"  # Eq. 7, or the attention-output contribution norm
    absolute_layers: tuple[int, ...] = (22, 23, 24, 25)  # App. B, used when the model has them
    # a first round per chunk, then the chunks reordered by importance (module doc); None: off
    reorder: Literal["topk_mass", "max"] | None = None

    def __post_init__(self):
        super().__post_init__()
        lo, hi = self.band
        if not 0.0 <= lo <= hi <= 1.0:
            raise BadMethodOption(f"{self.name}: band must satisfy 0 <= lo <= hi <= 1, got {self.band}")

    def layer_choice(self, n_layers: int) -> tuple[list[int], str]:
        """-> (layers, rule): "explicit" (``layers``), "absolute" (App. B's 22-25, when the model has
        them) or "depth_scaled" (``band`` of a shallower model)."""
        if self.layers is not None:
            bad = [i for i in self.layers if not 0 <= i < n_layers]
            if bad or not self.layers:
                raise BadMethodOption(f"{self.name}: layers must be within 0..{n_layers - 1}, got {self.layers}")
            return sorted(set(self.layers)), "explicit"
        if self.absolute_layers and max(self.absolute_layers) < n_layers:
            return sorted(set(self.absolute_layers)), "absolute"
        return band_layers(n_layers, self.band), "depth_scaled"

    def token_scores(self, ctx: SelectionContext, cache=None, key_keep=None, report: bool = False) -> torch.Tensor:
        """Attention norms over ``cache`` (default: the stitched cache) at the chosen layers."""
        cache = ctx.cache if cache is None else cache
        return layer_mean(self.per_layer(ctx, cache, key_keep, report), ctx.num_kv_heads)

    def layer_scores(self, ctx: SelectionContext) -> dict[int, torch.Tensor]:
        """{layer: [n_context]} the norms of each chosen layer (`score` is their mean): deltaprop's
        ``fusion="union"``."""
        per_layer = self.per_layer(ctx, ctx.cache, None, True)
        return {i: head_mean(a, ctx.num_kv_heads).float().cpu() for i, a in per_layer.items()}

    def per_layer(self, ctx: SelectionContext, cache, key_keep, report: bool) -> dict[int, torch.Tensor]:
        """{layer: [Hq, n_context]}: the norms per query head at the chosen layers (``weight`` applied)."""
        layers, rule = self.layer_choice(ctx.num_layers)
        if report:
            ctx.stats.update(infoflow_layers=list(layers), infoflow_layer_rule=rule)
        per_layer = ctx.query_attention(layers, cache=cache, key_keep=key_keep)
        if self.weight == "value":
            c0, c1 = ctx.layout.context_start, ctx.layout.context_end
            for i, att in per_layer.items():
                vnorm = cache.layers[i].values[0, :, c0:c1].float().norm(dim=-1)  # [Hkv, n]
                per_layer[i] = att * vnorm.repeat_interleave(att.shape[0] // vnorm.shape[0], 0)
        return per_layer

    def score(self, ctx: SelectionContext) -> torch.Tensor:
        return self.token_scores(ctx, report=True)

    def local_scores(self, ctx: SelectionContext, kvs) -> list[torch.Tensor]:
        """First round, HL-TP: per chunk, the prompt (global positions) over prefix + that chunk alone at its
        precompute positions; the slots of the other chunks are masked out. -> one score vector per chunk."""
        layout = ctx.layout
        pk, pv = ctx.prefix_kv()
        p, c1 = layout.n_prefix, layout.context_end
        tmp = StitchCache.from_stacked(pk, pv, capacity=layout.n_total)
        out = []
        for kv in kvs:
            n = kv.n_tokens
            keys = kv.keys if kv.start == p else ctx.rerotate(kv.keys, p - kv.start)  # isolated: 0 -> p
            for i, layer in enumerate(tmp.layers):
                layer.keys[0, :, p:p + n] = keys[i]
                layer.values[0, :, p:p + n] = kv.values[i]
                layer.length = c1
            keep = torch.zeros(layout.n_total, dtype=torch.bool, device=ctx.device)
            keep[:p + n] = True
            keep[c1:] = True
            s = self.token_scores(ctx, tmp, key_keep=keep)
            out.append(s[:n])
        return out

    def chunk_order(self, ctx: SelectionContext, kvs) -> tuple[list[int], list[float]]:
        """-> (new order as indices into the current chunks, most important last; importance per chunk)."""
        local = self.local_scores(ctx, kvs)
        importance = chunk_importance(local, ctx.budget, self.reorder)
        order = torch.sort(importance, stable=True).indices.tolist()  # ascending: most important last
        pinned = ctx.layout.pinned  # a conversation's system segment stays first
        order = list(range(pinned)) + [i for i in order if i >= pinned]
        return order, importance.tolist()

    def prepare(self, ctx: SelectionContext) -> None:
        """``reorder``: first round and reorder; `score` is then the second round, GLOBAL geometry on the new
        prompt."""
        if self.reorder is not None and len(ctx.layout.chunk_ids) > 1:
            kvs = ctx.chunk_kvs()
            order, importance = self.chunk_order(ctx, kvs)
            ctx.reorder(order, kvs)
            ctx.stats.update(chunk_importance=importance, chunk_score=self.reorder)


CHUNK_SCORES = ("topk_mass", "max")


def chunk_importance(local: list[torch.Tensor], budget: int, rule: str = "topk_mass") -> torch.Tensor:
    """Chunk importance [n_chunks] float64 from the first round's per-chunk token scores (module doc)."""
    if rule == "max":
        return torch.tensor([float(s.max()) if s.numel() else 0.0 for s in local], dtype=torch.float64)
    if rule != "topk_mass":
        raise BadMethodOption(f"chunk_score must be one of {', '.join(CHUNK_SCORES)}, got {rule!r}")
    flat = torch.cat(local)
    chunk_of = torch.cat([torch.full((s.numel(),), i) for i, s in enumerate(local)])
    m = min(max(budget, 1), flat.numel())
    top = torch.sort(flat, descending=True, stable=True).indices[:m]
    importance = torch.zeros(len(local), dtype=torch.float64)
    importance.index_add_(0, chunk_of[top], flat[top].double())
    return importance
