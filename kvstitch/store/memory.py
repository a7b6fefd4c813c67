"""In-process store bounded by bytes (the front tier of a tiered store).

Which entries go when the budget is exceeded is the `policy`'s choice (`policy.py`): "s3fifo" (default)
keeps a reused set through a stream of one-off chunks, which evicts it under "lru". Pinned entries stay.

It keeps what a disk/Redis `get` would return for the same storage dtype (float16 cast, or int8
quantize->dequantize), so a hit gives the same numbers whichever tier served it. Returned tensors are
shared with the store: callers must not modify them in place.
"""

from __future__ import annotations

import torch

from kvstitch.core.chunk import ChunkKV
from .base import ChunkStore, check_key, check_meta, group_by_model
from .codec import check_storage_dtype, roundtrip, stored_nbytes
from .policy import make_policy


class MemoryStore(ChunkStore):
    def __init__(self, max_bytes: int = 4 << 30, storage_dtype: str = "float16",
                 compute_dtype: torch.dtype | None = None, fingerprint: str | None = None,
                 policy: str = "s3fifo") -> None:
        super().__init__()
        self.storage_dtype = check_storage_dtype(storage_dtype)
        self.compute_dtype = compute_dtype
        self.fingerprint = fingerprint
        self._policy = make_policy(policy, max_bytes)
        self._items: dict[str, ChunkKV] = {}
        self._meta: dict[str, dict[str, dict]] = {}

    def __repr__(self) -> str:
        return (f"MemoryStore(max_bytes={self.max_bytes}, storage_dtype={self.storage_dtype!r}, "
                f"policy={self.policy!r})")

    @property
    def policy(self) -> str:
        return self._policy.name

    @property
    def max_bytes(self) -> int:
        return self._policy.capacity

    @max_bytes.setter
    def max_bytes(self, value: int) -> None:
        self._policy.capacity = value

    @property
    def _bytes(self) -> int:
        return self._policy.bytes

    def get(self, key: str) -> ChunkKV | None:
        kv = self._items.get(check_key(key))
        if kv is None:
            return None
        if self.fingerprint is not None and kv.fingerprint != self.fingerprint:
            self._report(key, f"foreign model: entry fingerprint {kv.fingerprint[:24]!r}")
            return None
        self._policy.touch(key)
        return kv

    def put(self, key: str, kv: ChunkKV) -> None:
        self.put_loaded(key, roundtrip(kv, self.storage_dtype, self.compute_dtype))

    def put_loaded(self, key: str, kv: ChunkKV) -> None:
        """Insert a chunk that is already in returned form (a lower tier's `get` result): no re-quantizing."""
        check_key(key)
        self._items[key] = kv
        self._policy.admit(key, kv.nbytes)
        if self._bytes > self.max_bytes:
            self._evict(self.max_bytes, keep=key)

    def _evict(self, budget: int, keep: str | None = None) -> tuple[int, int]:
        """Drop unpinned entries the policy chooses (never `keep`) until <= `budget` bytes remain."""
        pins = self._meta.get("pins", {})
        removed = freed = 0
        for k in self._policy.evict(budget, pins.__contains__, keep):
            freed += self._items.pop(k).nbytes
            removed += 1
        return removed, freed

    def add_anchors(self, key: str, scores: torch.Tensor, tag: str) -> bool:
        kv = self._items.get(check_key(key))
        if kv is None:
            return False
        new = kv.with_anchors(scores, tag)  # the same K/V tensors
        self._items[key] = new
        self._policy.resize(key, new.nbytes)
        if self._bytes > self.max_bytes:
            self._evict(self.max_bytes, keep=key)
        return True

    def __contains__(self, key: str) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)

    def delete(self, key: str) -> bool:
        self._policy.discard(key)
        return self._items.pop(key, None) is not None

    def keys(self) -> list[str]:
        return list(self._items)

    def gc(self, max_bytes: int) -> dict:
        removed, freed = self._evict(max_bytes)
        return {"removed": removed, "freed_bytes": freed, "bytes": self._bytes, "entries": len(self._items)}

    def verify(self) -> list[tuple[str, str]]:
        if self.fingerprint is None:
            return []
        return [(k, "foreign model fingerprint") for k, kv in self._items.items() if kv.fingerprint != self.fingerprint]

    def stats(self) -> dict:
        tokens = sum(kv.n_tokens for kv in self._items.values())
        stored = sum(stored_nbytes(kv, self.storage_dtype) for kv in self._items.values())
        per = {self.storage_dtype: {"entries": len(self._items), "bytes": stored, "tokens": tokens,
                                    "bytes_per_token": stored / tokens if tokens else 0.0}} if self._items else {}
        by_model = group_by_model([(kv.fingerprint, stored_nbytes(kv, self.storage_dtype), kv.n_tokens)
                                   for kv in self._items.values()], self.models())
        return {**super().stats(), "entries": len(self._items), "bytes": self._bytes, "resident_bytes": self._bytes,
                "max_bytes": self.max_bytes, **self._policy.describe(), "by_dtype": per, "by_model": by_model,
                "pinned": len(self._meta.get("pins", {}))}

    def meta_put(self, ns: str, name: str, value: dict) -> None:
        check_meta(ns, name)
        self._meta.setdefault(ns, {})[name] = dict(value)

    def meta_get(self, ns: str, name: str) -> dict | None:
        check_meta(ns, name)
        v = self._meta.get(ns, {}).get(name)
        return dict(v) if v is not None else None

    def meta_delete(self, ns: str, name: str) -> bool:
        check_meta(ns, name)
        return self._meta.get(ns, {}).pop(name, None) is not None

    def meta_list(self, ns: str) -> dict[str, dict]:
        check_meta(ns)
        return {k: dict(v) for k, v in self._meta.get(ns, {}).items()}
