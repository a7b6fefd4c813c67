"""Chunk affinity on live replicas: the simulator's `ChunkAffinity`, unchanged, over replicas named by strings
(Ray Serve replica ids), fed by the digests the replicas report. No Ray here, so the choice is tested without
a cluster; `kvstitch.serve.ray_router` plugs it into Ray Serve.

The routing key is cheap and request-side: a passage's text hash (`passage_key`) with its tokens estimated from
its UTF-8 bytes, so the router needs no tokenizer. A replica maps each passage it served to the store key of its
chunk cache and reports, in its digest, the passage keys whose cache its memory tier still holds: a chunk it
evicted drops out of its next digest. Requests without inline ``documents`` (``document_ids``, ``collection``,
plain chat) carry no key and are routed by power-of-two choices.
"""

from __future__ import annotations

import hashlib
from typing import Iterable

from .router import ChunkAffinity, RecentLoad, Request

ROUTERS: dict = {}  # deployment name -> its live router in this process (the ingress reads the replicas' reports)
BYTES_PER_TOKEN = 4  # a rough tokens-per-byte estimate: it only weighs passages against each other


def passage_key(text: str) -> str:
    """The routing key of a passage: a hash of its text (stable across processes, unlike `hash`)."""
    return hashlib.blake2b(text.encode("utf-8"), digest_size=8).hexdigest()


def request_chunks(documents) -> tuple:
    """``((passage key, estimated tokens), ...)`` of a request's inline passages; () when it has none."""
    if not isinstance(documents, list):
        return ()
    return tuple((passage_key(d), max(1, len(d.encode("utf-8")) // BYTES_PER_TOKEN))
                 for d in documents if isinstance(d, str) and d)


class LiveRouter:
    """`ChunkAffinity` over named replicas. `sync` tells it the live replicas and their last reports
    (``{"digest": keys or BloomFilter, "version": n}``); `rank` orders candidates for a request (the choice
    first); `placed` / `done` count the requests in flight at each replica (its queue)."""

    def __init__(self, replicas: int = 2, seed: int = 0, lam: float = 0.5, slack: float | None = 0.1,
                 half_life_per_replica: float = 32.0) -> None:
        self.router = ChunkAffinity(0, seed=seed, lam=lam, slack=slack)
        # members come and go: size the recent-load window for the expected count, as the simulator does
        self.router.recent = RecentLoad(half_life_per_replica * max(1, replicas))
        self.index: dict[str, int] = {}
        self.names: dict[int, str] = {}
        self.versions: dict[str, object] = {}
        self._next = 0

    # membership and reports
    def sync(self, reports: dict[str, dict | None]) -> None:
        """`reports`: every live replica -> its last report (None or {} before its first). Replicas not named
        are gone: forgotten, their held chunks with them; a returning replica starts from its next digest."""
        for name in [n for n in self.index if n not in reports]:
            self.remove(name)
        for name, rep in reports.items():
            r = self.index.get(name)
            if r is None:
                r = self._add(name)
            rep = rep or {}
            if "digest" in rep and rep.get("version") != self.versions.get(name):
                self.versions[name] = rep.get("version")
                self.router.report_digest(r, rep["digest"])

    def _add(self, name: str) -> int:
        r = self._next
        self._next += 1
        self.index[name], self.names[r] = r, name
        self.router.add_replica(r)
        return r

    def remove(self, name: str) -> None:
        r = self.index.pop(name, None)
        if r is not None:
            self.names.pop(r, None)
            self.versions.pop(name, None)
            self.router.remove_replica(r)
            self.router.queue.pop(r, None)

    # routing
    def choose(self, chunks: Iterable) -> str | None:
        """The replica chunk affinity picks for a request of `chunks` ((key, tokens) pairs); None if none live."""
        if not self.router.alive:
            return None
        return self.names[self.router.choose(Request(tuple(chunks)))]

    def rank(self, chunks: Iterable, candidates: list[str]) -> list[str]:
        """`candidates` in order of preference: the choice first, then the shorter queues."""
        first = self.choose(chunks)
        queue = self.router.queue
        rest = sorted((c for c in candidates if c != first), key=lambda c: queue.get(self.index.get(c, -1), 0))
        return ([first] if first in candidates else []) + rest

    def held(self, chunks: Iterable) -> dict[str, int]:
        """Replica -> tokens of `chunks` its last report says it holds (replicas holding any)."""
        got = self.router.view.held_tokens(tuple(chunks), self.router.alive)
        return {self.names[r]: t for r, t in got.items()}

    def placed(self, name: str) -> None:
        r = self.index.get(name)
        if r is not None:
            self.router.record(r)

    def done(self, name: str) -> None:
        r = self.index.get(name)
        if r is not None:
            self.router.done(r)
