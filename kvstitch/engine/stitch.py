"""Stitching: the prefix's and every chunk's K/V in one cache, keys re-rotated from precompute to their global
positions, and the stitch adapter's part in it (its link tokens join the layout, query-time passes read through
it)."""

from __future__ import annotations

from kvstitch.core.cache import StitchCache
from kvstitch.core.chunk import ChunkKV
from kvstitch.core.prompt import PromptLayout
from kvstitch.core.rope import rerotate


def with_adapter(engine, layout: PromptLayout, ratio, stats: dict | None = None) -> tuple[PromptLayout, bool]:
    """The layout a stitched prefill at ``ratio`` runs, and whether it reads through the engine's stitch adapter
    (`kvstitch.models.stitch_adapter`): its link tokens join the layout. Not at ratio 1: every token is fresh
    there, and the pass is exactly full prefill. Records the adapter's form in ``stats``."""
    ad = engine.stitch_adapter
    if ad is None or (isinstance(ratio, (int, float)) and ratio >= 1):
        return layout, False
    if stats is not None:
        stats["stitch_adapter"] = ad.config.form
    if ad.n_links and not layout.links:
        layout = layout.with_links(ad.link_ids(engine.vocab_size))
    return layout, True


def stitch(engine, layout: PromptLayout, chunks: list[ChunkKV], extra: int = 0,
           adapted: bool | None = None) -> StitchCache:
    """Prefix K/V + every chunk's K/V, keys re-rotated from precompute to global positions. ``adapted``: query-time
    passes over the cache read through the stitch adapter (None: when the layout has its link tokens)."""
    pk, pv = engine.prefix_kv(layout.prefix_ids)
    cache = StitchCache.from_stacked(pk, pv, capacity=layout.n_total + extra)
    cache.adapted = engine.stitch_adapter is not None and (bool(layout.links) if adapted is None else adapted)
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
