"""The server's admission budget: one byte budget for the K/V of every request in flight (not the paged
pool of a sparse decoder, `kvstitch.decode.pool`, whose bytes it counts).

A worker admits a request only when the K/V it can ever hold fits under the limit: its prompt plus its
``max_new_tokens`` answer tokens, in every layer (the stitched cache of a dense request, or the paged host
pool + page bounds of a sparse decoder, which takes the cache's K/V over and reserves the answer's pages at
prefill, `SparseDecoder.reserve_tokens`). The reservation is made before the prefill and held until the
request ends, so a request never runs out of room mid-answer: one that does not fit waits (first in, first
out) until others finish. One that cannot fit even alone is refused before anything is computed.

What is *not* counted: the model's weights, activations and the transient buffers of selection passes.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from kvstitch.core.errors import InputError


class PoolTooSmall(InputError):
    """A request whose K/V cannot fit in the pool even with nothing else in flight."""

    code = "kv_pool_too_small"


@dataclass(frozen=True)
class KVShape:
    """Bytes of one token's K/V in every layer of a model (``2 x layers x kv_heads x head_dim x element``)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    element_bytes: int

    @property
    def token_bytes(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.element_bytes

    def request_bytes(self, prompt_tokens: int, max_new_tokens: int, sparse: bool, page_size: int = 32,
                      copies: int = 1) -> int:
        """What a request may hold: ``copies`` caches of prompt + answer tokens; a sparse decoder's host pool
        rounds up to whole pages (one more for the last partial one) and keeps a ``(kmax | -kmin)`` box of
        ``2 x head_dim`` floats per page and KV head beside it."""
        tokens = prompt_tokens + max_new_tokens
        if not sparse:
            return copies * tokens * self.token_bytes
        pages = -(-tokens // page_size) + 1
        kv = pages * page_size * self.token_bytes
        boxes = pages * self.num_layers * self.num_kv_heads * 2 * self.head_dim * 4
        return copies * (kv + boxes)


def kv_shape(engine) -> KVShape | None:
    """The engine's per-token K/V size (None for an engine without a model adapter: no pool accounting)."""
    ad = getattr(engine, "adapter", None)
    dtype = getattr(engine, "dtype", None)
    if ad is None or dtype is None:
        return None
    return KVShape(ad.num_layers, ad.num_kv_heads, ad.head_dim, torch.empty(0, dtype=dtype).element_size())


class KVPool:
    """A byte budget (``limit``, None = unlimited) reserved per request in flight; thread-safe (the worker
    reserves, /metrics reads)."""

    def __init__(self, limit: int | None = None) -> None:
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit <= 0):
            raise InputError(f"the KV pool limit must be a positive number of bytes, got {limit!r}")
        self.limit = limit
        self.reserved = 0
        self.peak = 0
        self.waits = 0  # requests that had to wait for room (counted by the caller, once per request)
        self._held: dict[int, int] = {}  # id(owner) -> bytes
        self._lock = threading.Lock()

    def check(self, nbytes: int) -> None:
        """Raise `PoolTooSmall` when ``nbytes`` exceed the whole pool."""
        if self.limit is not None and nbytes > self.limit:
            raise PoolTooSmall(f"the request needs {nbytes / 2**20:.1f} MiB of K/V (prompt + max_tokens), more than "
                               f"the whole KV pool ({self.limit / 2**20:.1f} MiB, --kv-pool-bytes): shorten the "
                               f"documents or max_tokens")

    def fits(self, nbytes: int) -> bool:
        with self._lock:
            return self.limit is None or self.reserved + nbytes <= self.limit

    def reserve(self, owner: object, nbytes: int) -> bool:
        """Reserve ``nbytes`` for ``owner`` if they fit -> whether they did (`PoolTooSmall` if they never can)."""
        self.check(nbytes)
        with self._lock:
            if id(owner) in self._held:  # by identity: requests need not be hashable
                raise InputError("this request already holds a reservation")
            if self.limit is not None and self.reserved + nbytes > self.limit:
                return False
            self._held[id(owner)] = nbytes
            self.reserved += nbytes
            self.peak = max(self.peak, self.reserved)
            return True

    def release(self, owner: object) -> None:
        with self._lock:
            self.reserved -= self._held.pop(id(owner), 0)

    def occupancy(self) -> float:
        """Reserved share of the limit (0 without one)."""
        return self.reserved / self.limit if self.limit else 0.0

    def __len__(self) -> int:
        return len(self._held)
