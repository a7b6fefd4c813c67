"""Tiers composed front to back (memory -> disk -> Redis): write-through, promote on hit, degrade on error.

LMCache lesson: a cache that is not written back, or that takes the request down when a remote tier is
down, is worse than none. Here every `put` goes to every tier; a hit in tier i is copied into tiers
0..i-1; a tier that raises `StoreError` is logged once, skipped for `retry_after_s`, and the lookup
goes on (ultimately a miss: the caller recomputes).
"""

from __future__ import annotations

import logging
import time

import torch

from kvstitch.core.chunk import ChunkKV
from kvstitch.core.errors import StoreError
from .base import ChunkStore, check_key
from .codec import roundtrip
from .memory import MemoryStore

log = logging.getLogger("kvstitch.store")


class TieredStore(ChunkStore):
    def __init__(self, tiers: list[ChunkStore], retry_after_s: float = 30.0) -> None:
        super().__init__()
        if not tiers:
            raise StoreError("a tiered store needs at least one tier")
        dtypes = {t.storage_dtype for t in tiers}
        if len(dtypes) != 1:
            raise StoreError(f"tiers disagree on storage dtype ({sorted(dtypes)}): a hit would depend on the tier")
        self.tiers = list(tiers)
        self.storage_dtype = dtypes.pop()
        self.retry_after_s = retry_after_s
        self.tier_hits = [0] * len(tiers)
        self.tier_errors: list[str] = []
        self._down_until = [0.0] * len(tiers)

    def __repr__(self) -> str:
        return f"TieredStore({self.tiers!r})"

    # settings apply to every tier
    @property
    def fingerprint(self) -> str | None:
        return self.tiers[0].fingerprint

    @fingerprint.setter
    def fingerprint(self, fp: str | None) -> None:
        for t in self.tiers:
            t.fingerprint = fp

    @property
    def compute_dtype(self) -> torch.dtype | None:
        return self.tiers[0].compute_dtype

    @compute_dtype.setter
    def compute_dtype(self, dt: torch.dtype | None) -> None:
        for t in self.tiers:
            t.compute_dtype = dt

    @property
    def problems(self) -> list[str]:
        return [p for t in self.tiers for p in t.problems]

    def _up(self, i: int) -> bool:
        return time.monotonic() >= self._down_until[i]

    def _fail(self, i: int, err: Exception) -> None:
        self._down_until[i] = time.monotonic() + self.retry_after_s
        msg = f"tier {i} ({self.tiers[i]!r}) failed: {err}"
        self.tier_errors.append(msg)
        log.warning("kvstitch store: %s; skipping it for %.0fs (misses are recomputed)", msg, self.retry_after_s)

    def get(self, key: str) -> ChunkKV | None:
        check_key(key)
        for i, tier in enumerate(self.tiers):
            if not self._up(i):
                continue
            try:
                kv = tier.get(key)
            except StoreError as e:
                self._fail(i, e)
                continue
            if kv is not None:
                self.tier_hits[i] += 1
                self._promote(key, kv, i)
                return kv
        return None

    def _promote(self, key: str, kv: ChunkKV, upto: int) -> None:
        for j in range(upto):
            if not self._up(j):
                continue
            try:
                t = self.tiers[j]
                t.put_loaded(key, kv) if isinstance(t, MemoryStore) else t.put(key, kv)
            except StoreError as e:
                self._fail(j, e)

    def put(self, key: str, kv: ChunkKV) -> None:
        check_key(key)
        loaded, ok, errors = None, 0, []
        for i, tier in enumerate(self.tiers):
            if not self._up(i):
                continue
            try:
                if isinstance(tier, MemoryStore):
                    loaded = loaded or roundtrip(kv, self.storage_dtype, tier.compute_dtype)
                    tier.put_loaded(key, loaded)
                else:
                    tier.put(key, kv)
                ok += 1
            except StoreError as e:
                errors.append(e)
                self._fail(i, e)
        if not ok and errors:
            raise StoreError(f"no tier accepted the entry: {errors[-1]}")

    def add_anchors(self, key: str, scores: torch.Tensor, tag: str) -> bool:
        done = False
        for i, tier in enumerate(self.tiers):
            if self._up(i):
                try:
                    done = tier.add_anchors(key, scores, tag) or done
                except StoreError as e:
                    self._fail(i, e)
        return done

    def __contains__(self, key: str) -> bool:
        for i, t in enumerate(self.tiers):
            if self._up(i):
                try:
                    if key in t:
                        return True
                except StoreError as e:
                    self._fail(i, e)
        return False

    def delete(self, key: str) -> bool:
        found = False
        for t in self.tiers:
            found = t.delete(key) or found
        return found

    def keys(self) -> list[str]:
        return sorted({k for t in self.tiers for k in t.keys()})

    def verify(self) -> list[tuple[str, str]]:
        return [p for t in self.tiers for p in t.verify()]

    def gc(self, max_bytes: int) -> dict:
        """Trim every tier to `max_bytes` (each tier has its own budget)."""
        return {"tiers": [t.gc(max_bytes) for t in self.tiers]}

    def stats(self) -> dict:
        per = []
        for i, t in enumerate(self.tiers):
            try:
                s = t.stats()
            except StoreError as e:
                s = {"backend": type(t).__name__, "error": str(e)}
            per.append({**s, "tier_hits": self.tier_hits[i]})
        return {**super().stats(), "tiers": per, "tier_errors": len(self.tier_errors)}

    def close(self) -> None:
        for t in self.tiers:
            t.close()

    # metadata (pins, models, documents) goes to every tier, so each one's eviction honours the pins
    def meta_put(self, ns: str, name: str, value: dict) -> None:
        ok, errors = 0, []
        for i, t in enumerate(self.tiers):
            if not self._up(i):
                continue
            try:
                t.meta_put(ns, name, value)
                ok += 1
            except NotImplementedError:
                continue
            except StoreError as e:
                errors.append(e)
                self._fail(i, e)
        if not ok and errors:
            raise StoreError(f"no tier accepted the metadata: {errors[-1]}")

    def meta_get(self, ns: str, name: str) -> dict | None:
        for i, t in enumerate(self.tiers):
            if self._up(i):
                try:
                    v = t.meta_get(ns, name)
                except StoreError as e:
                    self._fail(i, e)
                    continue
                if v is not None:
                    return v
        return None

    def meta_delete(self, ns: str, name: str) -> bool:
        found = False
        for i, t in enumerate(self.tiers):
            try:
                found = t.meta_delete(ns, name) or found
            except StoreError as e:
                self._fail(i, e)
        return found

    def meta_list(self, ns: str) -> dict[str, dict]:
        out: dict[str, dict] = {}
        for i, t in enumerate(self.tiers):
            if self._up(i):
                try:
                    for k, v in t.meta_list(ns).items():
                        out.setdefault(k, v)
                except StoreError as e:
                    self._fail(i, e)
        return out
