"""`StitchCache`: a transformers `Cache` whose layers accept scatter-updates at arbitrary slots.

Slot index == global position. A forward over arbitrary tokens (the selected context tokens plus the
suffix) sets ``cache.slots`` to their positions; every layer's ``update`` then overwrites those slots
with the fresh K/V and returns the whole cache, so the model's own attention modules do the recompute.
transformers' `DynamicCache` only appends, hence this class.

Modes, set for a scope with ``with cache.mode(...)`` (the previous modes come back on exit, also on an
error; nested scopes change only what they name):
- ``slots`` = None: append (decode).
- ``write`` = False: out-of-place (scoring passes that must not disturb the stitched cache).
- ``capture``: set of layers whose fresh K/V are kept in ``captured`` (CacheBlend's ΔV).
- ``decoder``: a sparse decoder that owns the K/V during decode (PRKV and friends).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


class StitchLayer(CacheLayerMixin):
    is_sliding = False  # windows are enforced by kvstitch's attention masks, the buffer keeps all slots

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, length: int):
        super().__init__()
        self.keys, self.values, self.length = keys, values, length
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:  # buffers are preallocated
        pass

    def update(self, key_states, value_states, *args, **kwargs):  # routed through StitchCache.update
        raise RuntimeError("StitchLayer is updated through StitchCache.update")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    @property
    def capacity(self) -> int:
        return self.keys.shape[-2]

    def grow(self, capacity: int) -> None:
        pad = capacity - self.capacity
        if pad > 0:
            z = self.keys.new_zeros(*self.keys.shape[:-2], pad, self.keys.shape[-1])
            self.keys = torch.cat([self.keys, z], dim=-2)
            self.values = torch.cat([self.values, z.clone()], dim=-2)


_KEEP = object()  # `StitchCache.mode`: leave this mode as it is


class StitchCache(Cache):
    def __init__(self, layers: list[StitchLayer]):
        super().__init__(layers=layers)
        self.slots: torch.Tensor | None = None
        # query-time tokens at slots >= ``adapt_from`` read through the stitch adapter's reader LoRA at strength
        # ``adapted`` (0: not at all; a stitched cache of an engine that has one: `kvstitch.models.stitch_adapter`).
        # Recomputed context tokens, below it, do not: their fresh K/V are what recompute is for.
        self.adapted = 0.0
        self.adapt_from = 0
        self.write = True
        self.capture: set[int] = set()
        self.captured: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.decoder = None

    def reader_gate(self, slots: torch.Tensor) -> torch.Tensor:
        """float [len(slots)]: how strongly each of these slots' tokens reads through the stitch adapter (0: not)."""
        return (slots >= self.adapt_from).float() * float(self.adapted)

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def empty(cls, adapter, capacity: int, device, dtype) -> "StitchCache":
        shape = (1, adapter.num_kv_heads, capacity, adapter.head_dim)
        return cls([StitchLayer(torch.zeros(shape, device=device, dtype=dtype),
                                torch.zeros(shape, device=device, dtype=dtype), 0)
                    for _ in range(adapter.num_layers)])

    @classmethod
    def for_decoder(cls, adapter, length: int, device, dtype) -> "StitchCache":
        """A cache holding no K/V, only the sequence length: for decode steps through a sparse decoder,
        which owns the K/V (``Engine.decode_step``). Lets several decoders start from one prefill."""
        shape = (1, adapter.num_kv_heads, 0, adapter.head_dim)
        return cls([StitchLayer(torch.zeros(shape, device=device, dtype=dtype),
                                torch.zeros(shape, device=device, dtype=dtype), length)
                    for _ in range(adapter.num_layers)])

    @classmethod
    def from_stacked(cls, keys: torch.Tensor, values: torch.Tensor, capacity: int, batch: int = 1) -> "StitchCache":
        """From ``[L, H, n, d]`` tensors (copied into every batch row); slots ``n..capacity-1`` are zero
        and not yet valid."""
        L, H, n, d = keys.shape
        layers = []
        for i in range(L):
            k = keys.new_zeros(batch, H, max(capacity, n), d)
            v = torch.zeros_like(k)
            k[:, :, :n], v[:, :, :n] = keys[i], values[i]
            layers.append(StitchLayer(k, v, n))
        return cls(layers)

    # ---- modes --------------------------------------------------------------------------------
    @contextmanager
    def mode(self, *, slots=_KEEP, write=_KEEP, capture=_KEEP, decoder=_KEEP) -> Iterator[dict]:
        """Set the named modes for the ``with`` block; restore the previous ones on exit (also on an error).

        ``slots``: global positions of the tokens of the next forward (None = append); ``write``: False =
        out of place; ``capture``: layers whose fresh K/V to keep (the block gets a fresh, empty record);
        ``decoder``: a sparse decoder owning the K/V (None = none). Yields the block's ``captured`` dict
        ({layer: (keys, values)}), still readable after the block."""
        saved = self.slots, self.write, self.capture, self.captured, self.decoder
        if slots is not _KEEP:
            self.slots = slots
        if write is not _KEEP:
            self.write = bool(write)
        if capture is not _KEEP:
            self.capture, self.captured = set(capture), {}
        if decoder is not _KEEP:
            self.decoder = decoder
        try:
            yield self.captured
        finally:
            self.slots, self.write, self.capture, self.captured, self.decoder = saved

    # ---- the transformers Cache protocol ------------------------------------------------------
    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        layer = self.layers[layer_idx]
        q = key_states.shape[-2]
        if self.decoder is not None and self.slots is None:
            self.decoder.append(layer_idx, key_states[0], value_states[0])
            layer.length += q
            return key_states, value_states
        slots = self.slots
        if slots is None:
            slots = torch.arange(layer.length, layer.length + q, device=layer.keys.device)
            end = layer.length + q
        else:
            end = max(layer.length, int(slots[-1]) + 1) if q else layer.length
        if layer_idx in self.capture:
            self.captured[layer_idx] = (key_states, value_states)
        if end > layer.capacity:
            layer.grow(max(end, int(layer.capacity * 1.25) + 16))
        if self.write:
            layer.keys.index_copy_(2, slots, key_states.to(layer.dtype))
            layer.values.index_copy_(2, slots, value_states.to(layer.dtype))
            layer.length = end
            return layer.keys[:, :, :end], layer.values[:, :, :end]
        keys = layer.keys[:, :, :end].index_copy(2, slots, key_states.to(layer.dtype))
        values = layer.values[:, :, :end].index_copy(2, slots, value_states.to(layer.dtype))
        return keys, values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layers[layer_idx].length

    # ---- helpers ------------------------------------------------------------------------------
    @property
    def length(self) -> int:
        return self.layers[0].length

    def stacked_keys(self, start: int = 0, end: int | None = None, batch: bool = False) -> torch.Tensor:
        """``[L, H, n, d]`` (batch row 0), or ``[B, L, H, n, d]`` with ``batch=True``."""
        return self._stacked("keys", start, end, batch)

    def stacked_values(self, start: int = 0, end: int | None = None, batch: bool = False) -> torch.Tensor:
        return self._stacked("values", start, end, batch)

    def _stacked(self, what: str, start: int, end: int | None, batch: bool) -> torch.Tensor:
        parts = [getattr(layer, what)[:, :, start:end if end is not None else layer.length] for layer in self.layers]
        return torch.stack(parts, dim=1) if batch else torch.stack([t[0] for t in parts])

    def truncate(self, length: int) -> None:
        for layer in self.layers:
            layer.length = min(layer.length, length)
