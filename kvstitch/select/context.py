"""What a selection method sees: the `SelectionContext` (the request, the model's shapes, the operations
scoring needs) and the engine behind it (`EngineView`). The method objects themselves (`Selector`,
`Wrapper`, `register`) live in `kvstitch.select.method`.

A selector works through the context only: the stitched cache and the layout, the model's shapes, and the
few operations scoring needs (query attention over given layers, the low-layer pass of CacheBlend /
KVShare / A3, the chunk caches, the exact-context cache of the oracle, a new chunk order). It never reaches
into the engine.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Protocol

import torch


if TYPE_CHECKING:
    from kvstitch.core.attention import ForwardPlan
    from kvstitch.core.cache import StitchCache
    from kvstitch.core.chunk import ChunkKV
    from kvstitch.core.prompt import PromptLayout


@dataclass
class FreshPass:
    """What an out-of-place pass of the context (+ suffix) through blocks 0..layer-1 measured at ``layer``:
    exactly the full-prefill K/V (and Q) there, since block 0 sees the whole prompt under the global
    causal mask against the exact prefix K/V."""

    layer: int
    fresh_keys: torch.Tensor  # [Hkv, q, d] post-RoPE keys of the pass's tokens (slots context_start..)
    fresh_values: torch.Tensor  # [Hkv, q, d]
    stitched_values: torch.Tensor  # [Hkv, n_context, d] what the stitched cache holds for the context
    queries: torch.Tensor | None  # [Hq, w, d] post-RoPE queries of the pass's last w tokens (w = ``queries``)
    slots: torch.Tensor  # [q] global positions of the pass's tokens

    @property
    def delta_v(self) -> torch.Tensor:
        """[Hkv, n_context, d] float32: fresh minus stitched V of the context tokens."""
        n = self.stitched_values.shape[1]
        return self.fresh_values[:, :n].float() - self.stitched_values.float()


class EngineView(Protocol):
    """The engine as a selector's context reaches it (`kvstitch.Engine` is one). Typed against this, not the
    engine, so selection methods stay below the engine that imports them."""

    adapter: Any
    tokenizer: Any
    builder: Any
    device: torch.device
    inv_freq: torch.Tensor

    def forward(self, cache, ids: torch.Tensor, slots: torch.Tensor, plan=None, logits_to_keep: int = 1,
                write: bool = True, positions: torch.Tensor | None = None): ...

    def stitch(self, layout, chunks, extra: int = 0): ...

    def prefix_kv(self, prefix_ids: torch.Tensor): ...

    def chunk_kvs(self, layout, stats: dict | None = None, anchors=None): ...


@dataclass
class SelectionContext:
    """What a selector sees: the request (layout, naively stitched cache, budget), the model's shapes and
    the operations scoring needs. ``engine`` is the seam's other side: selectors use the methods here,
    never the engine itself."""

    engine: EngineView
    cache: "StitchCache"  # the naively stitched cache (prefix + re-rotated chunks; suffix slots empty)
    layout: "PromptLayout"
    budget: int
    stats: dict = field(default_factory=dict)  # selectors may report what they measured
    # how the chunk caches were precomputed: "shared_prefix" (after the shared prefix: the first chunk's
    # cache is exact) or "isolated" (each chunk from position 0 on its own); see `kvstitch.store.chunk_key`
    precompute: str = "shared_prefix"
    # the chunk caches the engine stitched ``cache`` from, in ``layout``'s order (None: read from the store)
    chunks: "list[ChunkKV] | None" = None
    # the engine's score seam (`kvstitch.engine.hooks.EngineHooks.score`): (selector, ctx, compute) -> scores;
    # None: the selector scores itself
    score_hook: "Callable | None" = None
    # a full prefill of this same prompt the caller already ran (the eval's reference), so that
    # `exact_context_cache` need not prefill the context again; None: it does. Per request: never on a selector
    exact_cache: "StitchCache | None" = None

    @property
    def n_context(self) -> int:
        return self.layout.n_context

    def scores(self, selector) -> torch.Tensor:
        """``selector.score(self)``, through the engine's score hook when one is set (`Selector.select` and
        `Selector.ranking` score this way; a harness memoising scores sets the hook)."""
        if self.score_hook is None:
            return selector.score(self)
        return self.score_hook(selector, self, selector.score)

    @property
    def suffix_slots(self) -> torch.Tensor:
        return torch.arange(self.layout.context_end, self.layout.n_total, device=self.device)

    # ---- the model's shapes ---------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.engine.device

    @property
    def num_layers(self) -> int:
        return self.engine.adapter.num_layers

    @property
    def num_kv_heads(self) -> int:
        return self.engine.adapter.num_kv_heads

    @property
    def num_q_heads(self) -> int:
        return self.engine.adapter.num_q_heads

    @property
    def head_dim(self) -> int:
        return self.engine.adapter.head_dim

    def sliding_window(self, layer: int) -> int | None:
        """The layer's attention window (None = global attention)."""
        return self.engine.adapter.sliding_window(layer)

    def attention_scaling(self, layer: int) -> float:
        attn = self.engine.adapter.backbone.layers[layer].self_attn
        return getattr(attn, "scaling", None) or self.head_dim ** -0.5

    def token_work(self) -> torch.Tensor:
        """[n_context] float64: what recomputing each context token costs per layer, in units of one key's
        attention (2 x q heads x head dim multiply-adds): its linear layers (q/k/v/o projections and a gated
        MLP, from the config) plus the keys it attends to (its position + 1, causal; every layer taken as
        global). On Qwen2.5 0.5B the linear part is ~8.3K keys: a token at 8K costs twice one at the start."""
        cfg = self.engine.adapter.config
        d, hq, hkv, hd = cfg.hidden_size, self.num_q_heads, self.num_kv_heads, self.head_dim
        linear = d * hd * (2 * hq + 2 * hkv) + 3 * d * getattr(cfg, "intermediate_size", 4 * d)
        pos = torch.arange(self.layout.context_start, self.layout.context_end, dtype=torch.float64)
        return linear / (2 * hq * hd) + pos + 1

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def weights_id(self) -> str:
        """The model weights' identity (``gguf:<sha256>`` for an embedded model; "" if the engine names none)."""
        return str(getattr(self.engine, "weights_id", "") or "")

    # ---- operations -----------------------------------------------------------------------------
    def query_attention(self, layers=None, *, cache: "StitchCache | None" = None, layout: "PromptLayout | None" = None,
                        key_keep: torch.Tensor | None = None) -> dict[int, torch.Tensor]:
        """{layer: [Hq, n_context]}: the suffix's attention over the context, averaged over the suffix tokens,
        at ``layers`` (None = all) over ``cache`` (default: the stitched cache); see `scoring.query_attention`."""
        from kvstitch.core.attention import ForwardPlan

        cache = self.cache if cache is None else cache
        layout = self.layout if layout is None else layout
        n_layers = self.num_layers
        wanted = sorted(set(range(n_layers) if layers is None else layers))
        if not wanted or wanted[0] < 0 or wanted[-1] >= n_layers:
            raise ValueError(f"layers must be within 0..{n_layers - 1}, got {wanted}")
        c0, c1 = layout.context_start, layout.context_end
        out: dict[int, torch.Tensor] = {}

        def hook(layer: int, probs: torch.Tensor, values: torch.Tensor) -> None:
            out[layer] = probs[:, :, c0:c1].mean(dim=1)  # [Hq, q, n_keys] -> [Hq, n_context]

        plan = ForwardPlan(attn_hook=hook, hook_layers=set(wanted), stop_after_layer=wanted[-1], key_keep=key_keep)
        slots = torch.arange(layout.context_end, layout.n_total)
        # writes the suffix K/V into the cache's suffix slots: the context slots are untouched and the
        # recompute pass rewrites every suffix slot before anything reads them (see `scoring`)
        self.engine.forward(cache, layout.suffix_ids, slots, plan, write=True)
        return out

    @torch.no_grad()
    def run_pass(self, cache: "StitchCache", ids: torch.Tensor, slots: torch.Tensor, plan: "ForwardPlan",
                 write: bool = True, positions: torch.Tensor | None = None) -> None:
        """``ids`` at cache slots ``slots`` (RoPE ``positions``, default the slots) through the model over
        ``cache``, as far as ``plan`` goes (a scoring pass: its hooks and captured queries are the result)."""
        self.engine.forward(cache, ids, slots, plan, write=write, positions=positions)

    @torch.no_grad()
    def recompute(self, indices: torch.Tensor) -> None:
        """Context tokens ``indices`` (sorted) and the suffix through every layer at their positions, their K/V
        written into the cache: a pass before the engine's own recompute pass (deltaprop's ``probe_first``)."""
        lay = self.layout
        slots = torch.cat([indices.cpu() + lay.context_start, torch.arange(lay.context_end, lay.n_total)])
        self.engine.forward(self.cache, lay.ids[slots], slots)

    @torch.no_grad()
    def fresh_pass(self, layer: int, *, include_suffix: bool = False, queries: int = 0) -> FreshPass:
        """The low-layer pass: every context token (+ the suffix) through blocks 0..layer-1 out of place (the
        stitched cache is untouched), stopped as soon as ``layer``'s attention is entered (its O(q N)
        attention is never computed); captures that layer's fresh K/V and the last ``queries`` queries."""
        from kvstitch.core.attention import ForwardPlan

        cache, lay = self.cache, self.layout
        layer = min(max(0, int(layer)), self.num_layers - 1)
        c0, c1 = lay.context_start, lay.context_end
        end = lay.n_total if include_suffix else c1
        slots = torch.arange(c0, end)
        plan = ForwardPlan(stop_at_attention_layer=layer, capture_queries=queries)
        with _capturing(cache, layer) as captured:
            self.engine.forward(cache, lay.ids[c0:end], slots, plan, write=False)
            k, v = captured[layer]
        stitched = cache.layers[layer].values[0, :, c0:c1]
        q = plan.queries.get(layer) if queries else None
        return FreshPass(layer, k[0], v[0], stitched, q, slots.to(self.device))

    def chunk_kvs(self, layout: "PromptLayout | None" = None, anchors=None) -> list["ChunkKV"]:
        """Every chunk's precomputed K/V (those the engine stitched from, else from the store; computed on a
        miss). ``anchors`` (an `AnchorSpec`): with their anchor scores (`kvstitch.core.anchors`)."""
        if layout is None and self.chunks is not None:
            tag = anchors.tag(self.tokenizer) if anchors is not None else ""
            if anchors is None or all(kv.has_anchors(tag) for kv in self.chunks):
                return self.chunks
        return self.engine.chunk_kvs(self.layout if layout is None else layout, anchors=anchors)

    def prefix_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The shared prefix's K/V ``[L, Hkv, n_prefix, d]``."""
        return self.engine.prefix_kv(self.layout.prefix_ids)

    def stitch(self, layout: "PromptLayout", kvs: "list[ChunkKV]", extra: int = 0) -> "StitchCache":
        """A naively stitched cache of ``layout`` from its chunks' caches (keys re-rotated to their slots)."""
        return self.engine.stitch(layout, kvs, extra=extra)

    @property
    def builder(self):
        """The engine's `PromptBuilder` (its prefix, chunk pieces and suffix template)."""
        return self.engine.builder

    def rerotate(self, keys: torch.Tensor, delta: int) -> torch.Tensor:
        """Post-RoPE keys moved by ``delta`` positions (the model's own RoPE)."""
        from kvstitch.core.rope import rerotate

        return rerotate(keys, delta, self.engine.inv_freq)

    def context_rope(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`rope.rope_table` of the context positions under layer ``layer``'s RoPE; layers of one RoPE base share
        one table (kept on the context)."""
        from kvstitch.core.rope import rope_table

        inv = self.engine.inv_freq[layer]
        c0, c1 = self.layout.context_start, self.layout.context_end
        key = (inv.detach().cpu().numpy().tobytes(), c0, c1)
        tables = self.__dict__.setdefault("_rope_tables", {})
        if key not in tables:
            tables[key] = rope_table(inv, torch.arange(c0, c1))
        return tables[key]

    def rotate(self, keys: torch.Tensor, positions: torch.Tensor, layer: int) -> torch.Tensor:
        """``keys [H, m, d]`` rotated by ``positions [m]`` (float64; negative un-rotates) with layer ``layer``'s RoPE."""
        from kvstitch.core.rope import rerotate

        return rerotate(keys, positions, self.engine.inv_freq[layer])

    def exact_context_cache(self) -> "StitchCache":
        """Prefix + context prefilled jointly (what a full prefill holds there), suffix slots empty (oracle); the
        caller's full prefill (`exact_cache`) when it gave one."""
        from kvstitch.core.cache import StitchCache

        if self.exact_cache is not None:
            return self.exact_cache
        eng, lay = self.engine, self.layout
        cache = StitchCache.empty(eng.adapter, lay.n_total, eng.device, eng.dtype)
        eng.forward(cache, lay.ids[:lay.context_end], torch.arange(lay.context_end))
        return cache

    def reorder(self, order: list[int], kvs: "list[ChunkKV] | None" = None) -> None:
        """Apply a new chunk order (``order[j]`` = current chunk placed at slot j): the layout and the stitched
        cache are rebuilt for it, and the engine recomputes and decodes over the new prompt (it reads
        ``layout`` / ``cache`` back after selection). Reported in ``stats["order"]`` (original chunk ids).
        ``kvs``: the current chunks' caches when the caller has them already (else read from the store)."""
        if sorted(order) != list(range(len(self.layout.chunk_ids))):
            raise ValueError(f"order must be a permutation of the {len(self.layout.chunk_ids)} chunks, got {order}")
        kvs = self.chunk_kvs() if kvs is None else kvs
        extra = max(0, self.cache.layers[0].capacity - self.layout.n_total)
        self.layout = self.layout.reordered(list(order))
        self.chunks = [kvs[i] for i in order]
        self.cache = self.engine.stitch(self.layout, self.chunks, extra=extra)
        self.stats["order"] = list(self.layout.order)

    def auxiliary_engine(self, model, device=None, dtype=None):
        """Another model (`kvstitch.models.load_model` spec) behind the same interface as the primary one
        (CacheClip's auxiliary model), loaded once per process."""
        from kvstitch.models import load_model

        dev = torch.device(device) if device is not None else self.device
        dtype = dtype or (torch.bfloat16 if dev.type == "cuda" else torch.float32)
        key = (model, str(dev), str(dtype))
        if key not in _AUXILIARY:
            model_, tok, weights_id = load_model(model, dev, dtype)
            _AUXILIARY[key] = type(self.engine)(model_, tok, weights_id)
        return _AUXILIARY[key]


_AUXILIARY: dict = {}  # (model spec, device, dtype) -> engine of an auxiliary model


@contextmanager
def _capturing(cache, layer: int):
    """Capture ``layer``'s fresh K/V during a pass (``cache.captured``), restoring the cache's mode after."""
    saved = cache.capture, cache.captured
    cache.capture, cache.captured = {layer}, {}
    try:
        yield cache.captured
    finally:
        cache.capture, cache.captured = saved


def top_k_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Exactly k indices, ties broken by position (stable, deterministic), returned sorted."""
    order = torch.sort(scores, descending=True, stable=True).indices
    return order[:k].sort().values
