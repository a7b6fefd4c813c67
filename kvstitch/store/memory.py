"""In-process LRU store bounded by bytes (the front tier of a tiered store).

It keeps what a disk/Redis `get` would return for the same storage dtype (float16 cast, or int8
quantize->dequantize), so a hit gives the same numbers whichever tier served it. Returned tensors are
shared with the store: callers must not modify them in place.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from ..chunk import ChunkKV
from .base import ChunkStore, check_key
from .codec import check_storage_dtype, roundtrip, stored_nbytes


class MemoryStore(ChunkStore):
    def __init__(self, max_bytes: int = 4 << 30, storage_dtype: str = "float16",
                 compute_dtype: torch.dtype | None = None, fingerprint: str | None = None) -> None:
        super().__init__()
        self.max_bytes = max_bytes
        self.storage_dtype = check_storage_dtype(storage_dtype)
        self.compute_dtype = compute_dtype
        self.fingerprint = fingerprint
        self._items: OrderedDict[str, ChunkKV] = OrderedDict()
        self._bytes = 0

    def __repr__(self) -> str:
        return f"MemoryStore(max_bytes={self.max_bytes}, storage_dtype={self.storage_dtype!r})"

    def get(self, key: str) -> ChunkKV | None:
        kv = self._items.get(check_key(key))
        if kv is None:
            return None
        if self.fingerprint is not None and kv.fingerprint != self.fingerprint:
            self._report(key, f"foreign model: entry fingerprint {kv.fingerprint[:24]!r}")
            return None
        self._items.move_to_end(key)
        return kv

    def put(self, key: str, kv: ChunkKV) -> None:
        self.put_loaded(key, roundtrip(kv, self.storage_dtype, self.compute_dtype))

    def put_loaded(self, key: str, kv: ChunkKV) -> None:
        """Insert a chunk that is already in returned form (a lower tier's `get` result): no re-quantizing."""
        check_key(key)
        self.delete(key)
        self._items[key] = kv
        self._bytes += kv.nbytes
        while self._bytes > self.max_bytes and len(self._items) > 1:
            _, old = self._items.popitem(last=False)
            self._bytes -= old.nbytes

    def __contains__(self, key: str) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)

    def delete(self, key: str) -> bool:
        old = self._items.pop(key, None)
        if old is not None:
            self._bytes -= old.nbytes
        return old is not None

    def keys(self) -> list[str]:
        return list(self._items)

    def gc(self, max_bytes: int) -> dict:
        removed = freed = 0
        while self._bytes > max_bytes and self._items:
            _, old = self._items.popitem(last=False)
            self._bytes -= old.nbytes
            removed, freed = removed + 1, freed + old.nbytes
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
        return {**super().stats(), "entries": len(self._items), "bytes": self._bytes, "resident_bytes": self._bytes,
                "max_bytes": self.max_bytes, "by_dtype": per}
