"""A store outage is not an outage: `ResilientStore` turns a failing backend into misses.

When the backend (Redis, a shared directory) raises `StoreError`, a lookup is a miss (the engine computes
the chunk), a write is dropped, and the store is marked down: logged once per outage, counted
(`degraded_ops`, `outages`), reported by `health()`. While down, the backend is not called for
`retry_after_s`; then the next operation (or a `health()` probe) tries again, and when it answers,
reads and writes resume. No partial entry is ever read: every entry checks its own checksum
(`kvstitch.store.codec`). Maintenance calls (keys, gc, verify, stats, metadata) are passed through and
raise as before: a document upload that cannot be recorded is an error, not a silent drop.
"""

from __future__ import annotations

import logging
import threading
import time

import torch

from kvstitch.core.chunk import ChunkKV
from kvstitch.core.errors import StoreError
from .base import ChunkStore

log = logging.getLogger("kvstitch.store")


class ResilientStore(ChunkStore):
    def __init__(self, inner: ChunkStore, retry_after_s: float = 2.0) -> None:
        super().__init__()
        self.inner = inner
        self.storage_dtype = inner.storage_dtype
        self.retry_after_s = retry_after_s
        self.degraded_ops = 0
        self.outages = 0
        self.down_since: float | None = None
        self.last_error: str | None = None
        self._retry_at = 0.0
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"ResilientStore({self.inner!r})"

    # settings live on the backend
    @property
    def fingerprint(self) -> str | None:
        return self.inner.fingerprint

    @fingerprint.setter
    def fingerprint(self, fp: str | None) -> None:
        self.inner.fingerprint = fp

    @property
    def compute_dtype(self) -> torch.dtype | None:
        return self.inner.compute_dtype

    @compute_dtype.setter
    def compute_dtype(self, dt: torch.dtype | None) -> None:
        self.inner.compute_dtype = dt

    @property
    def problems(self) -> list[str]:
        return self.inner.problems

    @property
    def up(self) -> bool:
        return self.down_since is None

    # -- degrade / recover ---------------------------------------------------------------------
    def _down(self, err: Exception) -> None:
        with self._lock:
            self._retry_at = time.monotonic() + self.retry_after_s
            self.last_error = str(err)
            if self.down_since is None:
                self.down_since = time.time()
                self.outages += 1
                log.warning("kvstitch store %r is unavailable (%s): serving without it (chunks are computed), "
                            "retrying every %.0f s", self.inner, err, self.retry_after_s)

    def _recovered(self) -> None:
        if self.down_since is not None:
            with self._lock:
                if self.down_since is not None:
                    log.warning("kvstitch store %r is back after %.1f s", self.inner, time.time() - self.down_since)
                    self.down_since = None

    def _try(self, fn, default):
        if self.down_since is not None and time.monotonic() < self._retry_at:
            self.degraded_ops += 1
            return default
        try:
            out = fn()
        except StoreError as e:
            self.degraded_ops += 1
            self._down(e)
            return default
        self._recovered()
        return out

    def health(self) -> dict:
        """``{"status": "up" | "down", ...}``; probes a down backend whose retry time has come."""
        ping = getattr(self.inner, "ping", None)
        if self.down_since is not None and ping is not None and time.monotonic() >= self._retry_at:
            self._try(ping, None)
        return {"status": "up" if self.up else "down", "backend": repr(self.inner),
                "down_since": self.down_since, "last_error": self.last_error if not self.up else None,
                "degraded_ops": self.degraded_ops, "outages": self.outages}

    # -- the hot path: degrade --------------------------------------------------------------------
    def get(self, key: str) -> ChunkKV | None:
        return self._try(lambda: self.inner.get(key), None)

    def put(self, key: str, kv: ChunkKV) -> None:
        self._try(lambda: self.inner.put(key, kv), None)

    def __contains__(self, key: str) -> bool:
        return self._try(lambda: key in self.inner, False)

    def add_anchors(self, key: str, scores: torch.Tensor, tag: str) -> bool:
        return self._try(lambda: self.inner.add_anchors(key, scores, tag), False)

    # -- maintenance: pass through -------------------------------------------------------------
    def delete(self, key: str) -> bool:
        return self.inner.delete(key)

    def keys(self) -> list[str]:
        return self.inner.keys()

    def __len__(self) -> int:
        return len(self.inner)

    def verify(self) -> list[tuple[str, str]]:
        return self.inner.verify()

    def gc(self, max_bytes: int) -> dict:
        return self.inner.gc(max_bytes)

    def stats(self) -> dict:
        try:
            s = self.inner.stats()
        except StoreError as e:
            s = {"backend": type(self.inner).__name__, "error": str(e)}
        return {**s, "hits": self.hits, "misses": self.misses, "bytes_loaded": self.bytes_loaded,
                "store_up": self.up, "degraded_ops": self.degraded_ops, "outages": self.outages}

    def close(self) -> None:
        self.inner.close()

    def meta_put(self, ns: str, name: str, value: dict) -> None:
        self.inner.meta_put(ns, name, value)

    def meta_get(self, ns: str, name: str) -> dict | None:
        return self.inner.meta_get(ns, name)

    def meta_delete(self, ns: str, name: str) -> bool:
        return self.inner.meta_delete(ns, name)

    def meta_list(self, ns: str) -> dict[str, dict]:
        return self.inner.meta_list(ns)


def resilient(store: ChunkStore) -> ChunkStore:
    """`store` wrapped in a `ResilientStore` unless it cannot fail (memory) or already is one."""
    from .memory import MemoryStore

    if isinstance(store, (ResilientStore, MemoryStore)):
        return store
    return ResilientStore(store)
