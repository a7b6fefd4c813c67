"""Eviction policies for the memory tier: which resident keys go when a byte budget is exceeded.

A policy tracks keys and their sizes only (the store keeps the values). ``evict(budget, pinned, keep)``
removes and returns keys until at most ``budget`` bytes remain, never a key for which ``pinned(key)`` is
true nor ``keep`` (the entry just written); it stops early when only those are left.

- ``LRUPolicy``: least recently used first. A stream of one-off chunks pushes a reused set out.
- ``S3FIFOPolicy``: S3-FIFO (Yang et al., SOSP'23), size-aware. New keys enter a small FIFO (10% of the
  budget); one that is read while there moves to the main FIFO when it reaches the head, the others leave
  and their keys are remembered in a ghost FIFO. A key put again while remembered goes straight to main.
  Main is a CLOCK with a 2-bit counter: a read key is reinserted, an unread one evicted. One-off chunks
  thus pass through the small queue without displacing what is reused.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable

from kvstitch.core.errors import StoreError

POLICIES = ("s3fifo", "lru")

_MAX_FREQ = 3  # a 2-bit counter


def _never(key: str) -> bool:
    return False


class LRUPolicy:
    name = "lru"

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._sizes: OrderedDict[str, int] = OrderedDict()  # least recently used first
        self.bytes = 0

    def __contains__(self, key: str) -> bool:
        return key in self._sizes

    def __len__(self) -> int:
        return len(self._sizes)

    def admit(self, key: str, size: int) -> None:
        """Insert `key`, or update its size and count the write as a use."""
        self.bytes += size - self._sizes.pop(key, 0)
        self._sizes[key] = size

    def touch(self, key: str) -> None:
        if key in self._sizes:
            self._sizes.move_to_end(key)

    def resize(self, key: str, size: int) -> None:
        if key in self._sizes:
            self.bytes += size - self._sizes[key]
            self._sizes[key] = size

    def discard(self, key: str) -> bool:
        size = self._sizes.pop(key, None)
        if size is None:
            return False
        self.bytes -= size
        return True

    def evict(self, budget: int, pinned: Callable[[str], bool] = _never, keep: str | None = None) -> list[str]:
        out, freed = [], 0
        for k, size in self._sizes.items():  # oldest first; stops at the first that suffice
            if self.bytes - freed <= budget:
                break
            if k != keep and not pinned(k):
                out.append(k)
                freed += size
        for k in out:
            self.discard(k)
        return out

    def describe(self) -> dict:
        return {"policy": self.name}


class S3FIFOPolicy:
    name = "s3fifo"

    def __init__(self, capacity: int, small_ratio: float = 0.1, ghost_ratio: float = 0.9) -> None:
        self.capacity = capacity
        self.small_ratio = small_ratio
        self.ghost_ratio = ghost_ratio
        # key -> [size, freq], head (oldest) first
        self._small: OrderedDict[str, list[int]] = OrderedDict()
        self._main: OrderedDict[str, list[int]] = OrderedDict()
        self._ghost: OrderedDict[str, int] = OrderedDict()  # key -> size; keys only, no values
        self._small_bytes = self._main_bytes = self._ghost_bytes = 0

    @property
    def bytes(self) -> int:
        return self._small_bytes + self._main_bytes

    def __contains__(self, key: str) -> bool:
        return key in self._small or key in self._main

    def __len__(self) -> int:
        return len(self._small) + len(self._main)

    def queue_of(self, key: str) -> str | None:
        """The queue holding `key`: "small", "main", "ghost" (evicted, remembered) or None."""
        if key in self._small:
            return "small"
        if key in self._main:
            return "main"
        return "ghost" if key in self._ghost else None

    def admit(self, key: str, size: int) -> None:
        """Insert `key` (into main if the ghost remembers it, else small), or update a resident one's size
        and count the write as a read."""
        for q in (self._small, self._main):
            e = q.get(key)
            if e is not None:
                self._add_bytes(q, size - e[0])
                e[0], e[1] = size, min(e[1] + 1, _MAX_FREQ)
                return
        remembered = self._ghost.pop(key, None)
        if remembered is not None:
            self._ghost_bytes -= remembered
            self._main[key] = [size, 0]
            self._main_bytes += size
        else:
            self._small[key] = [size, 0]
            self._small_bytes += size

    def touch(self, key: str) -> None:
        e = self._small.get(key) or self._main.get(key)
        if e is not None:
            e[1] = min(e[1] + 1, _MAX_FREQ)

    def resize(self, key: str, size: int) -> None:
        for q in (self._small, self._main):
            e = q.get(key)
            if e is not None:
                self._add_bytes(q, size - e[0])
                e[0] = size

    def discard(self, key: str) -> bool:
        for q in (self._small, self._main):
            e = q.pop(key, None)
            if e is not None:
                self._add_bytes(q, -e[0])
                return True
        return False

    def _add_bytes(self, q: OrderedDict, delta: int) -> None:
        if q is self._small:
            self._small_bytes += delta
        else:
            self._main_bytes += delta

    def evict(self, budget: int, pinned: Callable[[str], bool] = _never, keep: str | None = None) -> list[str]:
        out = []
        while self.bytes > budget:
            k = None
            if self._small_bytes > self.small_ratio * self.capacity or not self._main:
                k = self._evict_small(pinned, keep)
            if k is None:
                k = self._evict_main(pinned, keep)
            if k is None:
                k = self._evict_small(pinned, keep)  # main held nothing evictable
            if k is None:
                break  # only pinned entries and `keep` are left
            out.append(k)
        return out

    def _evict_small(self, pinned, keep) -> str | None:
        for _ in range(len(self._small)):
            k, e = self._small.popitem(last=False)
            self._small_bytes -= e[0]
            if k == keep:  # the newest entry: back to the tail, still on probation
                self._small[k] = e
                self._small_bytes += e[0]
            elif e[1] > 0 or pinned(k):  # read while on probation (or pinned: reused by definition)
                e[1] = 0
                self._main[k] = e
                self._main_bytes += e[0]
            else:
                self._remember(k, e[0])
                return k
        return None

    def _evict_main(self, pinned, keep) -> str | None:
        # each unpinned key is reinserted at most _MAX_FREQ times before it goes
        for _ in range((_MAX_FREQ + 1) * len(self._main)):
            k, e = self._main.popitem(last=False)
            if k == keep or pinned(k):
                self._main[k] = e
            elif e[1] > 0:
                e[1] -= 1
                self._main[k] = e
            else:
                self._main_bytes -= e[0]
                return k
        return None

    def _remember(self, key: str, size: int) -> None:
        self._ghost[key] = size
        self._ghost_bytes += size
        while self._ghost and self._ghost_bytes > self.ghost_ratio * self.capacity:
            self._ghost_bytes -= self._ghost.popitem(last=False)[1]

    def describe(self) -> dict:
        return {"policy": self.name, "small_bytes": self._small_bytes, "main_bytes": self._main_bytes,
                "ghost_keys": len(self._ghost)}


def make_policy(name: str, capacity: int):
    if name == "s3fifo":
        return S3FIFOPolicy(capacity)
    if name == "lru":
        return LRUPolicy(capacity)
    raise StoreError(f"unknown memory-tier policy {name!r}; known: {', '.join(POLICIES)}")
