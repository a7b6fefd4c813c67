"""Stitching: the prefix's and every chunk's K/V in one cache, keys re-rotated from precompute to their global
positions, and the stitch adapter's part in it (its link tokens join the layout, query-time passes read through
it)."""

from __future__ import annotations

from kvstitch.core.cache import StitchCache
from kvstitch.core.chunk import ChunkKV
from kvstitch.core.prompt import PromptLayout
from kvstitch.core.rope import rerotate


def writer_tag(engine) -> str:
    """The store key's part for the engine's stitch adapter's writer ("" when it writes nothing): caches written
    through a writer never mix with plain ones."""
    ad = engine.stitch_adapter
    return ad.precompute_tag() if ad is not None else ""


def with_adapter(engine, layout: PromptLayout, ratio: float, stats: dict | None = None) -> tuple[PromptLayout, float]:
    """The layout a stitched prefill at ``ratio`` runs, and how strongly it reads through the engine's stitch adapter
    (`kvstitch.models.stitch_adapter`; 0: not at all): its link tokens join the layout. Never at ratio 1: every
    token is fresh there, and the pass is exactly full prefill. Records the adapter's form in ``stats``."""
    ad = engine.stitch_adapter
    strength = 0.0 if ad is None or ratio >= 1 else ad.strength_at(ratio)
    if strength <= 0:
        return layout, 0.0
    if stats is not None:
        stats["stitch_adapter"] = ad.config.form if strength == 1 else f"{ad.config.form}@{strength:.2f}"
    if ad.n_links and not layout.links:
        layout = layout.with_links(ad.link_ids(engine.vocab_size))
    return layout, strength


def stitch(engine, layout: PromptLayout, chunks: list[ChunkKV], extra: int = 0,
           adapted: float | None = None) -> StitchCache:
    """Prefix K/V + every chunk's K/V, keys re-rotated from precompute to global positions. ``adapted``: how strongly
    query-time passes over the cache read through the stitch adapter (None: fully when the layout has its link
    tokens)."""
    if adapted is None:
        adapted = 1.0 if layout.links else 0.0
    pk, pv = engine.prefix_kv(layout.prefix_ids)
    cache = StitchCache.from_stacked(pk, pv, capacity=layout.n_total + extra)
    cache.adapted = float(adapted) if engine.stitch_adapter is not None else 0.0
    cache.adapt_from = layout.context_end  # the link tokens, the question, the answer
    for start, kv in zip(layout.chunk_starts, chunks):
        keys = rerotate(kv.keys, start - kv.start, engine.inv_freq)
        n = kv.n_tokens
        for i, layer in enumerate(cache.layers):
            layer.keys[0, :, start:start + n] = keys[i]
            layer.values[0, :, start:start + n] = kv.values[i]
    for layer in cache.layers:
        layer.length = layout.context_end
    return cache
