"""One model replica of `kvstitch serve --replicas`: the single server's app (`create_app`: auth, limits,
batching, streaming, /metrics, /documents) over its own engine, run in process for each request the ingress
forwards, plus the digest the chunk-affinity router reads.

The replica's store is the configured one (Redis, a shared directory) behind a memory tier of its own
(`replica_store`). After answering a request with inline passages it asks its engine, on the engine thread,
for the store key of each passage's chunk cache; its digest (`record_routing_stats`) is the passage keys whose
cache the memory tier holds at that moment, so the router learns what a replica holds from the replica.
Ray is not imported here: the class becomes a Ray Serve deployment in `kvstitch.serve.replicas`.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections import OrderedDict
from typing import Callable

from kvstitch.route.live import request_chunks
from kvstitch.route.view import BloomFilter

from .jobs import Job, QueueFull

CHAT_PATH = "/v1/chat/completions"
DIGEST_EXACT_MAX = 50_000  # passage keys sent as a set up to this; a Bloom filter above
KNOWN_MAX = 1 << 16  # passages remembered (their store keys), least recently served forgotten first


def replica_store(spec: str | None) -> str | None:
    """The store spec of one replica: the shared store behind a memory tier of the replica's own."""
    if spec is None or str(spec).strip() in ("", "memory") or str(spec).startswith("tiered:"):
        return spec  # memory alone, or tiers given (`open_store` puts a memory tier in front of them)
    return f"tiered:{spec}"


def memory_tier(store):
    """The `MemoryStore` in front of `store` (through the resilient wrapper and the tiers), or None."""
    from kvstitch.store import MemoryStore, TieredStore

    store = getattr(store, "inner", store)
    if isinstance(store, TieredStore):
        store = store.tiers[0]
    return store if isinstance(store, MemoryStore) else None


def passage_store_keys(engine, messages, documents) -> list[str]:
    """The store key of each passage's chunk cache in a chat request (segment 0 is the system prompt)."""
    layout = engine.builder.build_messages(messages, documents)
    return [engine.chunk_key(layout.prefix_ids, ids) for ids in layout.chunk_ids[1:]]


async def call_asgi(app, method: str, path: str, query: bytes, headers: list, body: bytes, client=None):
    """One HTTP request through `app` in process: yields ``("start", status, headers)``, then the body's bytes.
    Closing the generator early is the client going away: the app sees a disconnect and its task is cancelled."""
    out: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()
    sent = False

    async def receive():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def run():
        try:
            await app(scope, receive, out.put)
        finally:
            out.put_nowait(None)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": query, "root_path": "",
             "headers": [(bytes(k), bytes(v)) for k, v in headers], "client": tuple(client or ("127.0.0.1", 0)),
             "server": ("127.0.0.1", 80)}
    task = asyncio.create_task(run())
    try:
        while (msg := await out.get()) is not None:
            if msg["type"] == "http.response.start":
                yield ("start", msg["status"], [(k.decode("latin-1"), v.decode("latin-1"))
                                                for k, v in msg.get("headers", [])])
            elif msg["type"] == "http.response.body" and msg.get("body"):
                yield bytes(msg["body"])
        await task  # an error of the app itself
    finally:
        gone.set()
        if not task.done():
            task.cancel()


class PassageDigest:
    """Which passages a replica's memory tier holds: each passage it served, mapped to its chunk's store key."""

    def __init__(self, tier) -> None:
        self.tier = tier
        self.known: OrderedDict[str, str] = OrderedDict()  # passage key -> store key of its chunk cache
        self.version, self._last = 0, None

    def learn(self, chunks, store_keys) -> None:
        for (pkey, _), skey in zip(chunks, store_keys):
            self.known[pkey] = skey
            self.known.move_to_end(pkey)
        while len(self.known) > KNOWN_MAX:
            self.known.popitem(last=False)

    def keys(self) -> list[str]:
        """The passage keys whose chunk cache the memory tier holds now (a cold request's chunks may be stored
        later, while the replica is idle: the others are kept, not reported)."""
        if self.tier is None:
            return []
        return [p for p, s in self.known.items() if s in self.tier]

    def report(self) -> dict:
        """The digest (a key set, a Bloom filter when large); ``version`` changes only with its content."""
        keys = self.keys()
        if keys != self._last:
            self.version, self._last = self.version + 1, keys
        digest = keys if len(keys) <= DIGEST_EXACT_MAX else BloomFilter.of(keys)
        return {"digest": digest, "version": self.version, "held_passages": len(keys)}


class ModelReplica:
    """`load_engine()` -> the engine; `app_options`: `create_app`'s keyword arguments; `threads`: torch threads."""

    async def __init__(self, load_engine: Callable, app_options: dict, threads: int = 1) -> None:
        import torch

        from .server import create_app

        torch.set_num_threads(max(1, int(threads)))
        engine = await asyncio.get_running_loop().run_in_executor(None, load_engine)
        self.app = create_app(engine, **app_options)
        self.service = self.app.state.service
        self._lifespan = self.app.router.lifespan_context(self.app)  # starts the engine worker
        await self._lifespan.__aenter__()
        self.digest = PassageDigest(memory_tier(self.service.store))
        self._tasks: set = set()
        self.name = _replica_name()

    async def forward(self, method: str, path: str, query: bytes, headers: list, body: bytes, client=None,
                      route=()):
        """Serve one forwarded HTTP request: first ``{"replica": name}`` (accepted: from here a failure is this
        replica's), then what `call_asgi` yields. ``route`` is the router's (its passage keys)."""
        yield {"replica": self.name}
        status = None
        async for item in call_asgi(self.app, method, path, query, headers, body, client):
            if isinstance(item, tuple):
                status = item[1]
            yield item
        if status == 200 and method == "POST" and path == CHAT_PATH:
            task = asyncio.get_running_loop().create_task(self._learn(body))
            self._tasks.add(task)  # held until done (the loop keeps only a weak reference)
            task.add_done_callback(self._tasks.discard)

    async def _learn(self, body: bytes) -> None:
        """Remember the store key of each inline passage of an answered request (off the response path)."""
        try:
            req = json.loads(body)
            docs, messages = req.get("documents"), req.get("messages")
            chunks = request_chunks(docs)
            if not chunks or len(chunks) != len(docs):
                return
            keys = await self._on_engine(lambda eng: passage_store_keys(eng, messages, docs))
        except Exception:  # noqa: BLE001 - a digest that misses a passage only costs a preference
            return
        self.digest.learn(chunks, keys)

    async def _on_engine(self, fn):
        """`fn(engine)` on the engine thread (the tokenizer is the worker's), between its batches."""
        job = Job({}, asyncio.get_running_loop(), fn=fn)
        try:
            self.service.worker.submit(job)
        except QueueFull:
            return []
        result = None
        while True:
            kind, value = await job.events.get()
            if kind == "result":
                result = value
            elif kind == "done":
                return result or []

    def record_routing_stats(self) -> dict:
        """What the router and the ingress read (pulled by the Serve controller): the digest, this replica's
        health and its /metrics text."""
        body, _ = self.service.health()
        return {"replica": self.name, **self.digest.report(), "health": body, "metrics": self.service.metrics_text(),
                "tenants": getattr(self.service, "tenants", None) is not None}

    def ping(self) -> str:
        return self.name

    def check_health(self) -> None:
        """Ray Serve's health check: a dead engine worker fails it, and Serve replaces the replica."""
        body, status = self.service.health()
        if status != 200:
            raise RuntimeError(f"kvstitch replica unhealthy: {body}")

    async def __del__(self) -> None:
        if getattr(self, "_lifespan", None) is not None:  # stops the engine worker
            await self._lifespan.__aexit__(None, None, None)


def _replica_name() -> str:
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001 - outside Ray Serve (tests)
        return f"local-{os.getpid()}"
