"""A replica's memory tier in the routing model: a token budget of chunk caches under a pluggable eviction policy.

The tier owns sizes and the budget; the policy owns only the order of eviction, through three calls
(`EvictionPolicy`), so any policy object with them (LRU here, S3-FIFO or others elsewhere) plugs in.
Every admission and eviction is reported to the tier's listeners: that is how a router learns what a
replica holds (`HoldingsView.apply_events`), never by guessing.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Hashable, Iterable, Protocol

Key = Hashable
Listener = Callable[[list, list], None]  # (admitted [(key, tokens)], evicted [key])


class EvictionPolicy(Protocol):
    def admit(self, key: Key, size: int) -> None:
        """`key` (of `size` tokens) is now cached."""

    def lookup(self, key: Key) -> bool:
        """An access to a cached key (policies record recency / frequency here)."""

    def evict(self) -> Key:
        """Choose a cached key to drop, forget it and return it."""


class LRU:
    """Least recently used."""

    def __init__(self) -> None:
        self._order: OrderedDict = OrderedDict()

    def admit(self, key: Key, size: int) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def lookup(self, key: Key) -> bool:
        if key not in self._order:
            return False
        self._order.move_to_end(key)
        return True

    def evict(self) -> Key:
        return self._order.popitem(last=False)[0]

    def __len__(self) -> int:
        return len(self._order)


class MemoryTier:
    """Chunk caches up to `capacity` tokens; `policy` (default LRU) picks the victims."""

    def __init__(self, capacity: int, policy: EvictionPolicy | None = None) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0 tokens, got {capacity}")
        self.capacity = int(capacity)
        self.policy = policy if policy is not None else LRU()
        self.sizes: dict = {}
        self.used = 0
        self.listeners: list[Listener] = []

    def __contains__(self, key: Key) -> bool:
        return key in self.sizes

    def __len__(self) -> int:
        return len(self.sizes)

    def keys(self) -> set:
        return set(self.sizes)

    def lookup(self, key: Key) -> bool:
        """True (and an access recorded) if `key` is held."""
        if key not in self.sizes:
            return False
        self.policy.lookup(key)
        return True

    def admit_many(self, items: Iterable[tuple[Key, int]]) -> list:
        """Admit (key, tokens) pairs, evict down to the budget, report both; returns the evicted keys.

        A chunk larger than the whole tier is not admitted (it would only flush everything else)."""
        admitted, evicted = [], []
        for key, tokens in items:
            if key in self.sizes or tokens > self.capacity:
                continue
            self.policy.admit(key, tokens)
            self.sizes[key] = tokens
            self.used += tokens
            admitted.append((key, tokens))
        while self.used > self.capacity:
            victim = self.policy.evict()
            self.used -= self.sizes.pop(victim)
            evicted.append(victim)
        # a key admitted and evicted in one call was never visible: report neither
        new, gone = {k for k, _ in admitted}, set(evicted)
        admitted = [(k, t) for k, t in admitted if k not in gone]
        evicted = [k for k in evicted if k not in new]
        self._report(admitted, evicted)
        return evicted

    def clear(self) -> None:
        """Drop everything (a restarted replica), reported as evictions."""
        evicted = list(self.sizes)
        while self.sizes:
            self.used -= self.sizes.pop(self.policy.evict())
        self._report([], evicted)

    def _report(self, admitted: list, evicted: list) -> None:
        if admitted or evicted:
            for fn in self.listeners:
                fn(admitted, evicted)
