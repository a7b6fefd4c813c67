"""QCFuse (arXiv 2606.05875): query-aware selection through a compressed view of the context.

Re-implemented from its public code (github.com/uYanJX/QCFuse, Apache-2.0; read in the leideng/QCFuse
copy; nothing of it is copied here). Three passes:

1. Offline, per passage (`kvstitch.core.anchors`): the passage with "\\n\\nRepeat the previous context
   exactly." appended; per layer every passage token is scored by the most any head and prompt token
   attend to it (`srt/utils/digest_index_manager.py:accumulate_kvzip_layer_score`). Its *anchors* at a
   layer are its first ``n_sink`` (4) tokens, then the best-scored, ``ceil(anchor_ratio * n)`` tokens in
   all (`_rank_from_scores`, `srt/utils/cache_blender_info.py:ContextBlendPool._build_context_positions_for_layer`:
   the sinks count within the share; the system prompt, kvstitch's shared prefix, is kept whole).
   ``anchor_ratio`` = 0.1: `blend/qcfuse_config.py:DIGEST_RATIO` and `cache_blender_info.DEFAULT_DIGEST_RATIO`
   (the paper's text says ~15%; its code uses 10%).
2. Online probe (`srt/utils/cache_blender.py:CacheBlender.blend`, QCOMPUTE): only the question runs, through
   layers 0..max(critical layers) (``qcompute_end``), attending at each layer to the shared prefix and that
   layer's anchors of every passage at their real positions (the stitched cache holds every passage's keys
   re-rotated by `kvstitch.core.rope`; the rest is masked by `ForwardPlan.key_keep`) and to itself.
3. Selection (`srt/utils/indice_select.py:IndiceSelector._compute_layer_fusion`,
   `srt/utils/triton_attention_score.py:compute_att_full_softmax_importance`): at each critical layer, the
   probe's queries against the FULL stitched cache (every passage token, plus the question's own keys,
   causal) give softmax probabilities; a passage token's score is their maximum over query heads and question
   tokens, averaged over the critical layers (``reduce="max"``; ``"mean"`` averages over heads and tokens
   instead, as the method's summary describes it); the global top-k over all passages (k = ratio x context) is
   recomputed with the question through every layer (the engine's recompute pass).

Critical layers: ``critical_layers`` when given ("explicit"); else the model's profiled ranking
(`kvstitch.models.loader.CRITICAL_LAYERS`, "profiled"), its first ``n_critical`` (3:
`blend/qcfuse_config.py:DEFAULT_CRITICAL_LAYERS`); else, for a model never profiled, ``n_critical`` layers
around 0.55 of its depth ("depth_scaled": the mean relative depth of QCFuse's published top-3 for its four
models; on a model with sliding-window layers, its global layers nearest that depth).
``stats["qcfuse_critical_layers"]`` / ``["qcfuse_layer_rule"]`` say which ran.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

from kvstitch.core.attention import ForwardPlan, attention_probs
from kvstitch.core.errors import BadMethodOption
from kvstitch.core.anchors import DEFAULT_SINKS, REPEAT_PROMPT, AnchorSpec
from .context import SelectionContext
from .method import Selector, register

DEFAULT_CRITICAL = 3  # blend/qcfuse_config.py: DEFAULT_CRITICAL_LAYERS
ANCHOR_RATIO = 0.1  # blend/qcfuse_config.py: DIGEST_RATIO
FALLBACK_DEPTH = 0.55  # QCFuse's published top-3 critical layers sit at 0.47-0.61 of the depth (mean 0.55)


def anchor_indices(scores: torch.Tensor, ratio: float, n_sink: int) -> torch.Tensor:
    """One passage's anchors at one layer: scores [n] -> sorted indices, the first ``n_sink`` tokens then the
    best-scored (ties by position), ``ceil(ratio * n)`` in all (`_rank_from_scores` +
    `_build_context_positions_for_layer`)."""
    n = scores.numel()
    keep = min(n, math.ceil(n * ratio))
    sinks = min(n_sink, n)
    rest = torch.sort(scores[sinks:], descending=True, stable=True).indices + sinks
    ranked = torch.cat([torch.arange(sinks), rest])
    return ranked[:keep].sort().values


def depth_scaled_layers(n_layers: int, k: int, candidates: list[int] | None = None) -> list[int]:
    """``k`` layers around `FALLBACK_DEPTH` of the depth: consecutive ones, or the ``candidates`` nearest it."""
    if candidates is not None and len(candidates) < n_layers:
        centre = FALLBACK_DEPTH * (n_layers - 1)
        return sorted(sorted(candidates, key=lambda i: (abs(i - centre), i))[:k])
    k = min(k, n_layers)
    first = min(max(0, round(FALLBACK_DEPTH * (n_layers - 1)) - (k - 1) // 2), n_layers - k)
    return list(range(first, first + k))


@register
@dataclass
class QCFuse(Selector):
    name: ClassVar[str] = "qcfuse"
    critical_layers: tuple[int, ...] | None = None  # explicit layers (overrides the profiled ones)
    n_critical: int = DEFAULT_CRITICAL
    anchor_ratio: float = ANCHOR_RATIO
    n_sink: int = DEFAULT_SINKS
    prompt: str = REPEAT_PROMPT
    reduce: Literal["max", "mean"] = "max"  # over query heads and question tokens, per critical layer

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.anchor_ratio, (int, float)) or not 0.0 < self.anchor_ratio <= 1.0:
            raise BadMethodOption(f"{self.name}: anchor_ratio must be in (0, 1], got {self.anchor_ratio!r}")
        if isinstance(self.n_critical, bool) or not isinstance(self.n_critical, int) or self.n_critical < 1:
            raise BadMethodOption(f"{self.name}: n_critical must be an integer >= 1, got {self.n_critical!r}")
        if self.critical_layers is not None:
            self.critical_layers = tuple(self.critical_layers)
            if not self.critical_layers or not all(isinstance(i, int) for i in self.critical_layers):
                raise BadMethodOption(f"{self.name}: critical_layers must be layer indices, got {self.critical_layers}")
        try:
            AnchorSpec(self.prompt, self.n_sink)
        except Exception as e:  # noqa: BLE001 - one option error, whatever the spec refused
            raise BadMethodOption(f"{self.name}: {e}") from None

    def chunk_anchors(self) -> AnchorSpec:
        return AnchorSpec(self.prompt, self.n_sink)

    def layer_choice(self, ctx: SelectionContext) -> tuple[list[int], str]:
        """-> (critical layers, rule): "explicit", "profiled" (the model registry's) or "depth_scaled"."""
        from kvstitch.models.loader import critical_layers

        n = ctx.num_layers
        if self.critical_layers is not None:
            bad = [i for i in self.critical_layers if not 0 <= i < n]
            if bad:
                raise BadMethodOption(f"{self.name}: critical_layers must be within 0..{n - 1}, "
                                      f"got {self.critical_layers}")
            return list(dict.fromkeys(self.critical_layers)), "explicit"
        profiled = critical_layers(ctx.weights_id)
        if profiled and max(profiled[:self.n_critical]) < n:
            return list(profiled[:self.n_critical]), "profiled"
        glob = [i for i in range(n) if not ctx.sliding_window(i)] or None  # a window cannot see the context
        return depth_scaled_layers(n, self.n_critical, glob), "depth_scaled"

    def anchor_keep(self, ctx: SelectionContext, kvs) -> torch.Tensor:
        """[L, Hkv, n_total] bool: what the probe may attend to at each layer - the prefix, every passage's
        anchors of that layer, the question. A conversation's pinned system segment is kept whole, as QCFuse
        keeps its system prompt."""
        lay = ctx.layout
        keep = torch.ones(ctx.num_layers, ctx.num_kv_heads, lay.n_total, dtype=torch.bool)
        keep[:, :, lay.context_start:lay.context_end] = False
        for j, (start, kv) in enumerate(zip(lay.chunk_starts, kvs)):
            if j < lay.pinned:
                keep[:, :, start:start + kv.n_tokens] = True
                continue
            for layer in range(ctx.num_layers):
                idx = anchor_indices(kv.anchor_scores[layer], self.anchor_ratio, self.n_sink)
                keep[layer, :, start + idx] = True
        return keep.to(ctx.device)

    def score(self, ctx: SelectionContext) -> torch.Tensor:
        return torch.stack(list(self.layer_scores(ctx).values())).mean(0)

    def layer_scores(self, ctx: SelectionContext) -> dict[int, torch.Tensor]:
        """{critical layer: [n_context]} each layer's score (`score` is their mean): deltaprop's
        ``fusion="union"``."""
        layers, rule = self.layer_choice(ctx)
        ctx.stats.update(qcfuse_critical_layers=layers, qcfuse_layer_rule=rule, qcfuse_anchor_ratio=self.anchor_ratio)
        kvs = ctx.chunk_kvs(anchors=self.chunk_anchors())
        keep = self.anchor_keep(ctx, kvs)
        ctx.stats["qcfuse_anchors"] = int(keep[0, 0, ctx.layout.context_start:ctx.layout.context_end].sum())
        queries = anchor_probe(ctx, keep, max(layers))
        per_layer = critical_scores(ctx, ctx.cache, queries, layers, self.reduce)
        return {i: per_layer[i] for i in layers}


@torch.no_grad()
def anchor_probe(ctx: SelectionContext, keep: torch.Tensor, last_layer: int) -> dict[int, torch.Tensor]:
    """The probe over the prefix + each layer's anchors (``keep``) -> {layer: queries [Hq, |suffix|, d]}.

    Every passage keeps ``ceil(anchor_ratio * n)`` anchors at every layer, so each layer holds as many
    context keys: the pass runs over a compacted cache (those keys gathered, the suffix after them; RoPE at
    the real positions, the keys already rotated there), O(|Q| (prefix + anchors)) per layer as in QCFuse's
    own kernel. Causal order is all a compacted slot loses; a sliding-window layer also needs real
    distances, so a model with one below ``last_layer`` (Gemma 3) runs the masked pass over the full cache
    instead (`probe_queries`, the same attention at O(|Q| N))."""
    from kvstitch.core.cache import StitchCache, StitchLayer

    if any(ctx.sliding_window(i) for i in range(last_layer + 1)):
        return probe_queries(ctx, keep, last_layer)
    lay = ctx.layout
    kept = [keep[i, 0, :lay.context_end].nonzero().flatten() for i in range(last_layer + 1)]
    n_kept, m = kept[0].numel(), lay.n_suffix
    layers = []
    for i, src in enumerate(ctx.cache.layers):
        if i > last_layer:  # never reached: the pass stops after ``last_layer``
            layers.append(StitchLayer(src.keys[:, :, :0], src.values[:, :, :0], 0))
            continue
        k = src.keys.new_zeros(1, src.keys.shape[1], n_kept + m, src.keys.shape[3])
        v = torch.zeros_like(k)
        k[:, :, :n_kept], v[:, :, :n_kept] = src.keys[:, :, kept[i]], src.values[:, :, kept[i]]
        layers.append(StitchLayer(k, v, n_kept))
    plan = ForwardPlan(capture_queries=m, stop_after_layer=last_layer)
    ctx.run_pass(StitchCache(layers), lay.suffix_ids, torch.arange(n_kept, n_kept + m), plan,
                 positions=torch.arange(lay.context_end, lay.n_total))
    for i in range(last_layer + 1):  # the suffix's own keys, where the selection's softmax reads them
        dst, src = ctx.cache.layers[i], layers[i]
        dst.keys[:, :, lay.context_end:lay.n_total] = src.keys[:, :, n_kept:]
        dst.values[:, :, lay.context_end:lay.n_total] = src.values[:, :, n_kept:]
    return plan.queries


@torch.no_grad()
def probe_queries(ctx: SelectionContext, keep: torch.Tensor | None, last_layer: int) -> dict[int, torch.Tensor]:
    """Run the suffix through layers 0..``last_layer`` over ``ctx.cache``, attending only where ``keep``
    (None: everywhere) -> {layer: post-RoPE queries [Hq, |suffix|, d]}. The suffix's K/V go into the cache's
    suffix slots (the recompute pass rewrites them; see `kvstitch.select.attention_scores`)."""
    lay = ctx.layout
    plan = ForwardPlan(capture_queries=lay.n_suffix, stop_after_layer=last_layer, key_keep=keep)
    ctx.run_pass(ctx.cache, lay.suffix_ids, torch.arange(lay.context_end, lay.n_total), plan)
    return plan.queries


@torch.no_grad()
def critical_scores(ctx: SelectionContext, cache, queries: dict[int, torch.Tensor], layers, reduce: str = "max"
                    ) -> dict[int, torch.Tensor]:
    """{layer: [n_context] float32 cpu}: the queries' softmax attention over the whole of ``cache`` (prefix,
    every context token, the suffix's own keys, causal; the layer's window), restricted to the context and
    reduced over query heads and suffix tokens (``reduce``: "max" or "mean")."""
    lay = ctx.layout
    c0, c1, n = lay.context_start, lay.context_end, lay.n_total
    slots = torch.arange(c1, n, device=ctx.device)
    out = {}
    for layer in layers:
        keys = cache.layers[layer].keys[:, :, :n]
        probs = attention_probs(queries[layer][None], keys, slots, ctx.attention_scaling(layer),
                                ctx.sliding_window(layer))[:, :, c0:c1]
        out[layer] = (probs.amax(dim=(0, 1)) if reduce == "max" else probs.mean(dim=(0, 1))).float().cpu()
    return out
