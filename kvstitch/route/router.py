"""Request routing over N kvstitch replicas: chunk affinity and the baselines, behind one interface.

A router is told the replicas (`add_replica` / `remove_replica`), what they hold (`report_events` /
`report_digest`, from the replicas themselves) and when a request it sent is done (`done`); `route(request)`
returns a live replica. Queue length is the router's own count of requests in flight at each replica.

`ChunkAffinity` scores each candidate replica r by

    score(r) = held_tokens(r) - lam * queue(r) * mean_request_tokens

(held_tokens: the request's context tokens r's memory tier holds; one queued request costs `lam` times a
mean request's context), over the replicas holding any chunk plus a power-of-two pair; when no replica holds
anything it is plain power-of-two choices. Affinity alone would pile popular chunks onto one replica, so the
affinity routers also bound each replica's recent request rate (consistent hashing with bounded loads): a
replica whose exponentially decayed request count exceeds (1 + slack) x the mean + 1 is not eligible, and its
popular chunks spill to, and are then replicated on, others.
"""

from __future__ import annotations

import bisect
import hashlib
import random
from dataclasses import dataclass

from .view import HoldingsView


@dataclass(frozen=True)
class Request:
    chunks: tuple  # ((key, tokens), ...) in prompt order

    @property
    def tokens(self) -> int:
        return sum(t for _, t in self.chunks)


class RecentLoad:
    """Exponentially decayed request count per replica (half-life in routed requests)."""

    def __init__(self, half_life: float) -> None:
        self.g = 0.5 ** (1.0 / max(1.0, half_life))
        self.val: dict[int, float] = {}
        self.stamp: dict[int, int] = {}
        self.t = 0
        self.total = 0.0

    def get(self, r: int) -> float:
        return self.val.get(r, 0.0) * self.g ** (self.t - self.stamp.get(r, self.t))

    def add(self, r: int) -> None:
        self.val[r], self.stamp[r] = self.get(r) + 1.0, self.t
        self.total = (self.total + 1.0) * self.g  # every value decays one step; `get` applies it lazily via `t`
        self.t += 1

    def drop(self, r: int) -> None:
        self.total = max(0.0, self.total - self.get(r))
        self.val.pop(r, None)
        self.stamp.pop(r, None)


class Router:
    name = "base"

    def __init__(self, n_replicas: int, seed: int = 0, slack: float | None = None,
                 half_life_per_replica: float = 32.0) -> None:
        self.rng = random.Random(seed)
        self.view = HoldingsView()
        self.queue: dict[int, int] = {}
        self.alive: set[int] = set()
        self._order: list[int] = []
        self.slack = slack
        self.recent = RecentLoad(half_life_per_replica * n_replicas)
        self.routed = 0
        for r in range(n_replicas):
            self.add_replica(r)

    # membership and reports
    def add_replica(self, r: int) -> None:
        """A replica joins (or returns): routable at once, attracting chunks once it reports what it holds."""
        self.alive.add(r)
        self.queue[r] = 0
        self._order = sorted(self.alive)
        self._added(r)

    def remove_replica(self, r: int) -> None:
        """A replica died or left: never chosen again until re-added; what it held is forgotten."""
        self.alive.discard(r)
        self._order = sorted(self.alive)
        self.view.forget(r)
        self.recent.drop(r)

    def report_events(self, r: int, admitted=(), evicted=()) -> None:
        if r in self.alive:
            self.view.apply_events(r, admitted, evicted)

    def report_digest(self, r: int, digest) -> None:
        if r in self.alive:
            self.view.apply_digest(r, digest)

    def done(self, r: int) -> None:
        if self.queue.get(r, 0) > 0:
            self.queue[r] -= 1

    # routing
    def route(self, req: Request) -> int:
        if not self.alive:
            raise RuntimeError("no live replica to route to")
        r = self.choose(req)
        assert r in self.alive
        self.record(r)
        return r

    def record(self, r: int) -> None:
        """Count a request sent to `r` (`route` does; a live router, whose framework makes the final pick, calls it
        once the request is placed)."""
        if r in self.alive:
            self.queue[r] += 1
            self.recent.add(r)
            self.routed += 1

    def choose(self, req: Request) -> int:
        raise NotImplementedError

    def _added(self, r: int) -> None:
        pass

    def eligible(self, r: int) -> bool:
        if self.slack is None:
            return True
        return self.recent.get(r) + 1.0 <= (1.0 + self.slack) * (self.recent.total + 1.0) / len(self.alive) + 1.0

    def least_loaded(self) -> int:
        return min(self._order, key=lambda r: (self.recent.get(r), self.queue[r]))

    def pair(self) -> list[int]:
        return self.rng.sample(self._order, 2) if len(self._order) > 1 else list(self._order)

    def two_choices(self) -> int:
        """Two random live replicas, the shorter queue (ties at random); eligible ones only, redrawn a few times."""
        for _ in range(4):
            ok = [r for r in self.pair() if self.eligible(r)]
            if ok:
                return min(ok, key=lambda r: (self.queue[r], self.rng.random()))
        return self.least_loaded()


class RoundRobin(Router):
    name = "round-robin"

    def choose(self, req: Request) -> int:
        return self._order[self.routed % len(self._order)]


class PowerOfTwo(Router):
    name = "power-of-two"

    def choose(self, req: Request) -> int:
        return self.two_choices()


def prefix_hash(chunks, n: int) -> int:
    """The hash chain over the first `n` chunk keys, in order (so a reordered or different prefix differs)."""
    h = b""
    for key, _ in chunks[:n]:
        h = hashlib.blake2b(h + str(key).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little")


class PrefixAffinity(Router):
    """Consistent hashing of the request's prefix hash chain (first `prefix_chunks` chunks), bounded loads:
    the first eligible replica clockwise on the ring, unless its queue is `queue_gap` or more longer than a
    power-of-two pick's (then that pick: prefix-cache routers fall back to load when queues are imbalanced).
    It keys on the prompt's prefix, as prefix-cache routers do, so the same chunks reordered or combined
    differently go elsewhere."""

    name = "prefix-affinity"

    def __init__(self, n_replicas: int, seed: int = 0, prefix_chunks: int = 1, vnodes: int = 64,
                 slack: float | None = 0.1, queue_gap: int | None = 2, **kw) -> None:
        self.prefix_chunks, self.vnodes, self.queue_gap = prefix_chunks, vnodes, queue_gap
        self._points: list[int] = []
        self._owners: list[int] = []
        self._on_ring: set[int] = set()
        super().__init__(n_replicas, seed, slack, **kw)

    def _added(self, r: int) -> None:
        if r in self._on_ring:
            return
        self._on_ring.add(r)
        for v in range(self.vnodes):
            p = prefix_hash(((f"replica-{r}-{v}", 0),), 1)
            i = bisect.bisect(self._points, p)
            self._points.insert(i, p)
            self._owners.insert(i, r)

    def choose(self, req: Request) -> int:
        r = self._ring_owner(prefix_hash(req.chunks, self.prefix_chunks))
        if self.queue_gap is not None and self.queue[r] >= self.queue_gap:
            alt = self.two_choices()
            if self.queue[r] - self.queue[alt] >= self.queue_gap:
                return alt
        return r

    def _ring_owner(self, h: int) -> int:
        i = bisect.bisect(self._points, h)
        n = len(self._points)
        for j in range(n):
            r = self._owners[(i + j) % n]
            if r in self.alive and self.eligible(r):
                return r
        return self.least_loaded()


class ChunkAffinity(Router):
    """Most held context tokens against queue length (module docstring); power-of-two when nothing is held."""

    name = "chunk-affinity"

    def __init__(self, n_replicas: int, seed: int = 0, lam: float = 0.5, slack: float | None = 0.1, **kw) -> None:
        self.lam = lam
        self.mean_tokens = 0.0
        super().__init__(n_replicas, seed, slack, **kw)

    def choose(self, req: Request) -> int:
        tokens = req.tokens
        self.mean_tokens = tokens if not self.routed else 0.99 * self.mean_tokens + 0.01 * tokens
        held = self.view.held_tokens(req.chunks, self.alive)
        if not held:
            return self.two_choices()
        cands = [r for r in set(held).union(self.pair()) if self.eligible(r)]
        if not cands:
            return self.two_choices()
        cost = self.lam * self.mean_tokens
        return max(cands, key=lambda r: (held.get(r, 0) - cost * self.queue[r], -self.queue[r], self.rng.random()))


ROUTERS = {cls.name: cls for cls in (RoundRobin, PowerOfTwo, PrefixAffinity, ChunkAffinity)}
