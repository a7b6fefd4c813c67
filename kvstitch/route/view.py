"""What the router knows each replica holds, learned only from the replicas' own reports.

Two kinds of report: events (the keys a replica admitted and evicted, as its `MemoryTier` emits them) and
a periodic digest (the set of keys it holds, or a `BloomFilter` of them when the set is too large to send).
Exact reports feed an inverted index (key -> replicas), so scoring a request costs O(its chunks x holders);
a Bloom digest cannot be enumerated, so each Bloom replica is tested per chunk (O(chunks x replicas)) and
a false positive only costs a wasted preference, never a wrong answer.
"""

from __future__ import annotations

import functools
import hashlib
import math
from typing import Hashable, Iterable

Key = Hashable


@functools.lru_cache(maxsize=1 << 16)
def _positions(key: str, n_bits: int, n_hashes: int) -> tuple[int, ...]:
    d = hashlib.blake2b(key.encode(), digest_size=16).digest()
    h1, h2 = int.from_bytes(d[:8], "little"), int.from_bytes(d[8:], "little") | 1
    return tuple((h1 + i * h2) % n_bits for i in range(n_hashes))  # double hashing


class BloomFilter:
    """A Bloom filter over keys (their `str`), sized for `capacity` keys at false-positive rate `fp_rate`."""

    def __init__(self, capacity: int, fp_rate: float = 0.01) -> None:
        n = max(1, int(capacity))
        self.n_bits = max(8, int(-n * math.log(fp_rate) / math.log(2) ** 2))
        self.n_hashes = max(1, round(self.n_bits / n * math.log(2)))
        self.bits = bytearray((self.n_bits + 7) // 8)

    @classmethod
    def of(cls, keys: Iterable[Key], capacity: int | None = None, fp_rate: float = 0.01) -> "BloomFilter":
        """A filter of `keys`; one `capacity` for all replicas lets a key's bit positions be hashed once."""
        keys = list(keys)
        bf = cls(capacity or len(keys), fp_rate)
        for k in keys:
            bf.add(k)
        return bf

    def _positions(self, key: Key) -> tuple[int, ...]:
        return _positions(str(key), self.n_bits, self.n_hashes)

    def add(self, key: Key) -> None:
        for p in self._positions(key):
            self.bits[p >> 3] |= 1 << (p & 7)

    def __contains__(self, key: Key) -> bool:
        return all(self.bits[p >> 3] & (1 << (p & 7)) for p in self._positions(key))

    @property
    def nbytes(self) -> int:
        return len(self.bits)


class HoldingsView:
    """The router's picture of every replica's memory tier."""

    def __init__(self) -> None:
        self.holders: dict[Key, set[int]] = {}  # exact reports, inverted
        self.keys: dict[int, set] = {}
        self.blooms: dict[int, BloomFilter] = {}

    def apply_events(self, replica: int, admitted: Iterable = (), evicted: Iterable = ()) -> None:
        """`admitted`: (key, tokens) pairs or keys; `evicted`: keys. They update the exact picture only: a Bloom
        digest cannot forget a key, so it stays as sent until the next digest replaces it."""
        held = self.keys.setdefault(replica, set())
        for item in admitted:
            key = item[0] if isinstance(item, tuple) else item
            held.add(key)
            self.holders.setdefault(key, set()).add(replica)
        for key in evicted:
            held.discard(key)
            self._unhold(key, replica)

    def apply_digest(self, replica: int, digest) -> None:
        """Replace the replica's picture: a set of keys (exact) or a `BloomFilter`."""
        self.forget(replica)
        if isinstance(digest, BloomFilter):
            self.blooms[replica] = digest
        else:
            self.apply_events(replica, admitted=digest)

    def forget(self, replica: int) -> None:
        """Drop all knowledge of `replica` (it died, or a digest replaces its picture)."""
        for key in self.keys.pop(replica, ()):
            self._unhold(key, replica)
        self.blooms.pop(replica, None)

    def _unhold(self, key: Key, replica: int) -> None:
        reps = self.holders.get(key)
        if reps is not None:
            reps.discard(replica)
            if not reps:
                del self.holders[key]

    def held_tokens(self, chunks, alive) -> dict[int, int]:
        """Replica -> tokens of `chunks` ((key, tokens) pairs) it holds, for replicas in `alive` holding any."""
        out: dict[int, int] = {}
        for key, tokens in chunks:
            for r in self.holders.get(key, ()):
                if r in alive:
                    out[r] = out.get(r, 0) + tokens
        for r, bf in self.blooms.items():
            if r in alive:
                got = sum(t for k, t in chunks if k in bf)
                if got:
                    out[r] = out.get(r, 0) + got
        return out
