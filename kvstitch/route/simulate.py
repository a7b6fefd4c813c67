"""Replay a request trace through a router and N replicas' memory tiers, with a queue per replica.

The model: the popular documents' chunks were precomputed into the shared chunk store (Redis, disk) before
the trace starts; a novel document's chunks are in no store and are computed on the replica that gets them.
Requests arrive as a Poisson process at `utilization` x the replicas' service capacity; each replica serves
its requests one at a time, first come first served (CPU prefill uses the whole replica), in

    service = base x context + fetch x (tokens in the shared store, not in the tier) + recompute x (tokens in no store)

(`costs.CostModel`), and TTFT = queueing wait + service. A replica admits the chunks it had to fetch or
compute into its memory tier, whose admissions and evictions reach the router as events (or, with
`report="digest"` / `"bloom"`, a digest of every replica every `digest_every` requests). The "ideal" policy is
one memory tier of the total size shared by all replicas with one central queue: no routing, nothing held twice.
"""

from __future__ import annotations

import heapq
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from .costs import CostModel
from .router import ROUTERS, Request
from .tier import LRU, MemoryTier
from .trace import doc_of, precomputed, topic_of
from .view import BloomFilter

POLICIES = ("ideal", *ROUTERS)


@dataclass(frozen=True)
class SimConfig:
    n_replicas: int = 8
    tier_tokens: int = 65_536  # per replica
    utilization: float = 0.7
    warmup: float = 0.25  # share of the trace not measured (tiers filling)
    report: str = "events"  # "events", "digest" (key sets) or "bloom"
    digest_every: int = 0  # requests between digests; 0 = one per replica count
    seed: int = 0
    router_options: dict = field(default_factory=dict, compare=False)


def arrival_times(trace: list[Request], cfg: SimConfig, costs: CostModel) -> np.ndarray:
    """Poisson arrivals at `cfg.utilization` of the replicas' capacity, the mean service counted as if
    nothing were held locally (the routers' common upper bound)."""
    service = [costs.service_s(r.tokens, sum(t for k, t in r.chunks if precomputed(k)),
                               sum(t for k, t in r.chunks if not precomputed(k))) for r in trace]
    rate = cfg.utilization * cfg.n_replicas / float(np.mean(service))
    gaps = np.random.default_rng(cfg.seed + 7).exponential(1.0 / rate, size=len(trace))
    return np.cumsum(gaps)


def _digest(tier: MemoryTier, kind: str):
    keys = tier.keys()
    return BloomFilter.of(keys, capacity=max(64, tier.capacity // 128)) if kind == "bloom" else keys


class _Servers:
    """Each replica's queue: when it is free next, and the router's completions to deliver."""

    def __init__(self, n: int, router) -> None:
        self.free_at = [0.0] * n
        self.router = router
        self.finishing: list[tuple[float, int]] = []
        self.idle = [(0.0, r) for r in range(n)]  # the central queue of the ideal policy

    def advance(self, now: float) -> None:
        while self.finishing and self.finishing[0][0] <= now:
            self.router.done(heapq.heappop(self.finishing)[1])

    def earliest(self) -> int:
        return heapq.heappop(self.idle)[1]

    def serve(self, r: int, now: float, service: float) -> float:
        finish = max(now, self.free_at[r]) + service
        self.free_at[r] = finish
        if self.router is not None:
            heapq.heappush(self.finishing, (finish, r))
        else:
            heapq.heappush(self.idle, (finish, r))
        return finish - now


class _Tally:
    """Measured totals: tokens by outcome; the stored ones also split by whether the chunk is of the request's
    own (main) document or retrieved from another one."""

    def __init__(self, n: int, costs: CostModel) -> None:
        self.costs = costs
        self.counts = np.zeros(n, dtype=np.int64)
        self.ttft: list[float] = []
        self.tok = dict.fromkeys(("context", "local", "fetched", "recomputed", "held_anywhere",
                                  "own", "own_local", "other", "other_local"), 0)

    def add(self, r: int, ttft: float, req: Request, local: set, held_anywhere: int, fetched: int, recomputed: int):
        self.counts[r] += 1
        self.ttft.append(ttft)
        own = topic_of(req)
        t = self.tok
        t["context"] += req.tokens
        t["fetched"] += fetched
        t["recomputed"] += recomputed
        t["held_anywhere"] += held_anywhere
        for key, tok in req.chunks:
            t["local"] += tok if key in local else 0
            if precomputed(key):  # a novel chunk is a miss for every policy: left out of the split
                kind = "own" if doc_of(key) == own else "other"
                t[kind] += tok
                t[kind + "_local"] += tok if key in local else 0

    def metrics(self, policy: str) -> dict:
        t, n_req, bpt = self.tok, int(self.counts.sum()), self.costs.bytes_per_token
        share = lambda a, b: t[a] / t[b] if t[b] else None  # noqa: E731
        return {
            "policy": policy, "requests": n_req, "context_tokens": t["context"],
            "local_hit": share("local", "context"), "held_anywhere": share("held_anywhere", "context"),
            "own_doc_hit": share("own_local", "own"), "other_doc_hit": share("other_local", "other"),
            "own_doc_share": share("own", "context"), "other_doc_share": share("other", "context"),
            "fetched_bytes": t["fetched"] * bpt, "fetched_mb_per_request": t["fetched"] * bpt / 1e6 / max(1, n_req),
            "recomputed_share": share("recomputed", "context"),
            "ttft_p50_s": float(np.percentile(self.ttft, 50)) if self.ttft else None,
            "ttft_p95_s": float(np.percentile(self.ttft, 95)) if self.ttft else None,
            "imbalance": float(self.counts.max() / self.counts.mean()) if n_req else None,
        }


def _tiers(policy: str, cfg: SimConfig, make_policy: Callable, held: Counter):
    """The router (None for the ideal) and the tiers, wired to report to it and to count copies held."""
    n = cfg.n_replicas
    router = None if policy == "ideal" else ROUTERS[policy](n, seed=cfg.seed, **cfg.router_options.get(policy, {}))
    tiers = [MemoryTier(n * cfg.tier_tokens, make_policy())] if router is None else \
        [MemoryTier(cfg.tier_tokens, make_policy()) for _ in range(n)]

    def count(admitted, evicted):
        held.update(k for k, _ in admitted)
        held.subtract(evicted)

    for r, tier in enumerate(tiers):
        tier.listeners.append(count)
        if router is not None and cfg.report == "events":
            tier.listeners.append(lambda a, e, r=r: router.report_events(r, a, e))
    return router, tiers


def simulate(policy: str, trace: list[Request], times, cfg: SimConfig, costs: CostModel,
             make_policy: Callable = LRU) -> dict:
    """Metrics of `policy` ("ideal" or a `ROUTERS` name) over `trace` arriving at `times`."""
    held: Counter = Counter()  # key -> tiers holding it
    router, tiers = _tiers(policy, cfg, make_policy, held)
    servers = _Servers(cfg.n_replicas, router)
    every, start = cfg.digest_every or cfg.n_replicas, int(cfg.warmup * len(trace))
    tally = _Tally(cfg.n_replicas, costs)
    for i, (req, now) in enumerate(zip(trace, times)):
        if router is not None:
            servers.advance(now)
            r = router.route(req)
            tier = tiers[r]
        else:
            r, tier = servers.earliest(), tiers[0]
        anywhere = sum(tok for key, tok in req.chunks if held[key] > 0)
        local = {key for key, _ in req.chunks if tier.lookup(key)}
        misses = [(key, tok) for key, tok in req.chunks if key not in local]
        fetched = sum(tok for key, tok in misses if precomputed(key))
        recomputed = sum(tok for key, tok in misses if not precomputed(key))
        tier.admit_many(misses)
        ttft = servers.serve(r, now, costs.service_s(req.tokens, fetched, recomputed))
        if router is not None and cfg.report != "events" and i % every == 0:
            for rr, t in enumerate(tiers):
                router.report_digest(rr, _digest(t, cfg.report))
        if i >= start:
            tally.add(r, ttft, req, local, anywhere, fetched, recomputed)
    return tally.metrics(policy)
