"""Content-addressed chunk KV stores (memory, disk, Redis, tiered) behind one small interface.

    open_store()                               # in-process memory (S3-FIFO eviction)
    open_store("~/.cache/kvstitch/kv")         # a directory (DiskStore)
    open_store("redis://127.0.0.1:6379/0")     # Redis (checked at open: StoreError if unreachable)
    open_store("tiered:/path,redis://h:6379/0")  # memory in front of disk in front of Redis
    open_store(["memory", "/path"])            # same composition as a list
"""

from __future__ import annotations

import os

import torch

from kvstitch.core.errors import StoreError
from .base import LAYOUT_VERSION, PRECOMPUTE_MODES, ChunkStore, InvalidKeyError, check_key, check_precompute, chunk_key
from .codec import STORAGE_DTYPES, check_storage_dtype
from .disk import DiskStore
from .memory import MemoryStore
from .redis_store import RedisStore
from .tiered import TieredStore

_REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


def open_store(spec=None, *, storage_dtype: str = "float16", compute_dtype: torch.dtype | None = None,
               fingerprint: str | None = None, max_bytes: int | None = None,
               memory_bytes: int = 4 << 30) -> ChunkStore:
    """Open a store from a spec: None/"memory", a directory path, a redis:// URL, "tiered:A,B,..." or a list.

    `storage_dtype`: float16 (default), bfloat16, float32 or int8 (KIVI). `max_bytes`: disk / Redis budget
    (least-recently-used unpinned entries are evicted above it).
    `memory_bytes`: the memory tier's budget (S3-FIFO eviction). A tiered spec without "memory" gets a memory tier in front.
    """
    if isinstance(spec, ChunkStore):
        return spec
    storage_dtype = check_storage_dtype(storage_dtype)
    common = dict(storage_dtype=storage_dtype, compute_dtype=compute_dtype, fingerprint=fingerprint)

    def one(s, in_tier: bool) -> ChunkStore:
        if isinstance(s, ChunkStore):
            return s
        if s is None or s == "memory":
            return MemoryStore(max_bytes=memory_bytes, **common)
        if isinstance(s, os.PathLike):
            s = os.fspath(s)
        if not isinstance(s, str) or not s.strip():
            raise StoreError(f"unsupported store spec {s!r}")
        s = s.strip()
        if s.startswith(_REDIS_SCHEMES):
            return RedisStore(s, check=not in_tier, max_bytes=max_bytes, **common)
        if "://" in s and not s.startswith("file://"):
            raise StoreError(f"unsupported store URL {s!r} (use a directory path or redis://host:port/db)")
        return DiskStore(s.removeprefix("file://"), max_bytes=max_bytes, **common)

    if isinstance(spec, str) and spec.startswith("tiered:"):
        spec = [p for p in spec[len("tiered:"):].split(",") if p.strip()]
        if not spec:
            raise StoreError("empty tiered store spec: use tiered:memory,/path or tiered:/path,redis://host:port/0")
        if "memory" not in spec:
            spec = ["memory", *spec]
    if isinstance(spec, (list, tuple)):
        return TieredStore([one(s, in_tier=True) for s in spec])
    return one(spec, in_tier=False)


__all__ = ["ChunkStore", "MemoryStore", "DiskStore", "RedisStore", "TieredStore", "chunk_key", "check_key",
           "open_store", "LAYOUT_VERSION", "STORAGE_DTYPES", "InvalidKeyError", "PRECOMPUTE_MODES", "check_precompute"]
