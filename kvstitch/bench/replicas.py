"""`kvstitch bench replicas`: chunk-affinity routing against Ray Serve's default router, measured live.

One local Ray (``num_cpus`` = replicas x threads, the HTTP endpoint on loopback) runs the replicated app of
`kvstitch serve --replicas` twice over the same model: once routed by chunk affinity
(`kvstitch.serve.ray_router`), once by Serve's default router (power of two choices). Each replica's store is
a memory tier of its own (`replica_trace.tier_bytes`: a third of the trace's working set) in front of one shared
directory store, which holds every passage's cache before the trace starts (precomputed here, by the same
engine that then serves every request alone as the reference). So a passage is a local hit when the
answering replica's memory tier holds it, else a load from the shared store; nothing is computed.

The trace (`replica_trace`) goes to the one endpoint as streamed chat requests, ``concurrency`` at a time.
Per request: the replica that answered (``X-Kvstitch-Replica``), where each passage's cache came from (the
answer's ``kvstitch.chunk_sources``), TTFT at the client (request sent -> first answer text) and at the server,
and the answer, compared with the same request served by one single server (greedy, so equal is exact).
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import tempfile
import time
from pathlib import Path

from kvstitch.core.errors import InputError
from kvstitch.engine.request import DEFAULT_METHOD

from .replica_trace import (TIER_SHARE, ideal_hit_rate, router_row, squad_pool, tier_bytes, token_bytes, trace_bodies,
                            verdict, working_set)

ROUTERS = ("chunk-affinity", "default")  # measured in this order, each on fresh replicas
APP_OPTIONS = dict(default_method=DEFAULT_METHOD, default_ratio=0.2, max_queue=64, model_name="bench", max_batch=8)


def load_replica_engine(model, shared_dir: str, memory_bytes: int, dtype=None):
    """A replica's engine: the shared directory store behind a memory tier of ``memory_bytes`` (no budget on
    the shared store: it keeps the whole working set)."""
    from kvstitch.engine import Engine
    from kvstitch.store import open_store

    store = open_store(f"tiered:{shared_dir}", memory_bytes=memory_bytes)
    # every chunk through the store
    eng = Engine.load(model, store=store, cold_path="stitched", dtype=dtype, stitch_adapter=None)
    if eng.store.compute_dtype is None:
        eng.store.compute_dtype = eng.dtype
    return eng


def passage_token_bytes(engine) -> int:
    """Bytes of one token of a chunk cache in a replica's memory tier (the engine's dtype)."""
    ad = engine.adapter
    return token_bytes(ad.num_layers, ad.num_kv_heads, ad.head_dim, engine.dtype.itemsize)


async def _one(client, body: dict) -> dict:
    """One streamed request -> {status, replica, text, ttft_s, server_ttft_s, chunk_sources}."""
    t0 = time.perf_counter()
    async with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as resp:
        out = {"status": resp.status_code, "replica": resp.headers.get("x-kvstitch-replica")}
        if resp.status_code != 200:
            out["error"] = (await resp.aread()).decode("utf-8", "replace")[:300]
            return out
        text, ttft, ext = "", None, {}
        async for line in resp.aiter_lines():
            if not line.startswith("data: {"):
                continue
            ev = json.loads(line[6:])
            if "error" in ev:
                return {**out, "status": 500, "error": ev["error"].get("message")}
            for ch in ev.get("choices", []):
                if ch.get("delta", {}).get("content"):
                    ttft = ttft if ttft is not None else time.perf_counter() - t0
                    text += ch["delta"]["content"]
            ext = ev.get("kvstitch", ext)
        if ttft is None:  # an empty answer: its end is its first token
            ttft = time.perf_counter() - t0
    return {**out, "text": text, "ttft_s": ttft, "server_ttft_s": ext.get("ttft_s"),
            "chunk_sources": ext.get("chunk_sources")}


async def send_trace(url: str, bodies: list[dict], concurrency: int = 1, interval_s: float = 0.0,
                     deadline_s: float = 3600.0) -> list[dict | None]:
    """The bodies in order, ``concurrency`` clients, each pausing ``interval_s`` between its requests; requests
    not started within ``deadline_s`` are left out (None)."""
    import httpx

    todo = list(enumerate(bodies))
    results: list[dict | None] = [None] * len(bodies)
    t0 = time.monotonic()

    async def client_loop(client):
        while todo and time.monotonic() - t0 < deadline_s:
            i, body = todo.pop(0)
            try:
                results[i] = await _one(client, body)
            except httpx.HTTPError as e:
                results[i] = {"status": 0, "error": f"{type(e).__name__}: {e}"}
            if interval_s:
                await asyncio.sleep(interval_s)

    async with httpx.AsyncClient(base_url=url, timeout=600.0) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(max(1, concurrency))))
    return results


def reference_answers(engine, bodies: list[dict], log) -> list[str | None]:
    """Every request served by one single server (in process) over ``engine``, one at a time."""
    from kvstitch.serve.server import create_app
    from kvstitch.serve.testing import ServerThread

    t0 = time.perf_counter()
    with ServerThread(create_app(engine, **APP_OPTIONS)) as srv:
        got = asyncio.run(send_trace(srv.url, bodies))
    bad = [r for r in got if not r or r["status"] != 200]
    if bad:
        raise RuntimeError(f"the single server failed a request: {bad[0]}")
    log(f"reference: {len(bodies)} requests on one server in {time.perf_counter() - t0:.1f} s")
    return [r["text"] for r in got]


def _start_ray(cpus: int, threads: int) -> None:
    import ray

    root = str(Path(__file__).resolve().parents[2])  # the replicas import kvstitch from this tree
    env = {"PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p),
           "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False, object_store_memory=128 << 20,
             runtime_env={"env_vars": env})


def _port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_router(router: str, load, bodies: list[dict], port: int, replicas: int, threads: int, concurrency: int,
               interval_s: float, deadline_s: float, router_options: dict | None, log) -> list[dict | None]:
    """Deploy the app with ``router`` on fresh replicas (empty memory tiers), send the trace, tear it down."""
    from ray import serve

    from kvstitch.serve.replicas import DEFAULT_ROUTER_CLASS, ROUTER_CLASS, build_app

    cls = ROUTER_CLASS if router == "chunk-affinity" else DEFAULT_ROUTER_CLASS
    app = build_app(load, APP_OPTIONS, replicas, replica_cpus=threads, stats_period_s=0.5, accept_timeout_s=300.0,
                    router_options=router_options, router_class=cls)
    t0 = time.perf_counter()
    serve.run(app, name="kvstitch", route_prefix="/", blocking=False)
    log(f"{router}: {replicas} replicas up in {time.perf_counter() - t0:.1f} s")
    try:
        t0 = time.perf_counter()
        got = asyncio.run(send_trace(f"http://127.0.0.1:{port}", bodies, concurrency, interval_s, deadline_s))
        log(f"{router}: {sum(r is not None for r in got)} requests in {time.perf_counter() - t0:.1f} s")
        return got
    finally:
        serve.delete("kvstitch")


def _trace(engine, n_requests: int, n_docs: int, k: int, zipf: float, seed: int, per_doc: int, max_tokens: int,
           share: float, mix: float, replicas: int) -> tuple[list[dict], dict]:
    """The bodies, the sizing of the memory tiers and the ideal's hit rate (`meta` fields)."""
    bodies = trace_bodies(squad_pool(n_docs, per_doc, seed), n_requests, k, zipf, seed, max_tokens, mix)
    tokens_of = functools.lru_cache(maxsize=None)(lambda text: engine.builder.encode_chunk(text).numel())
    ws = working_set(bodies, tokens_of)
    per_token = passage_token_bytes(engine)
    layout = engine.layout(None, bodies[0]["documents"], bodies[0]["messages"])
    system = layout.chunk_ids[0].numel()  # segment 0, which every request shares
    memory = tier_bytes(ws["tokens"], per_token, share, reserve_tokens=system)
    ideal = ideal_hit_rate(bodies, tokens_of, per_token, replicas * (memory - system * per_token))
    return bodies, {"ideal_hit_rate": ideal, "working_set_passages": ws["passages"], "working_set_tokens": ws["tokens"],
                    "token_bytes": per_token, "working_set_bytes": ws["tokens"] * per_token,
                    "system_tokens": system, "tier_share": share, "memory_bytes": memory,
                    "engine_dtype": str(engine.dtype).removeprefix("torch.")}


def bench_replicas(model=None, dtype=None, n_requests: int = 80, n_docs: int = 16, k: int = 3, zipf: float = 1.0,
                   seed: int = 0, threads: int = 1, replicas: int = 2, per_doc: int = 6, max_tokens: int = 16,
                   concurrency: int = 1, interval_s: float = 0.0, deadline_s: float = 1800.0,
                   share: float = TIER_SHARE, mix: float = 0.2, router_options: dict | None = None,
                   log=None) -> tuple[list[dict], dict]:
    """(rows, meta): one row per router (`replica_trace.router_row`), the sizing and the verdict in meta."""
    import ray
    import torch
    from ray import serve

    from .serve import warm_store

    log = log or (lambda msg: None)
    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory(prefix="kvstitch-bench-replicas-") as shared:
        engine = load_replica_engine(model, shared, 1 << 30, dtype)
        bodies, meta = _trace(engine, n_requests, n_docs, k, zipf, seed, per_doc, max_tokens, share, mix, replicas)
        mib = meta["working_set_bytes"] / 2**20
        log(f"shared store: {warm_store(engine, bodies)} chunks precomputed; memory tier "
            f"{meta['memory_bytes'] / 2**20:.1f} MiB per replica ({share:.2f} of {mib:.1f} MiB over "
            f"{meta['working_set_passages']} passages)")
        reference = reference_answers(engine, bodies, log)
        del engine
        load = functools.partial(load_replica_engine, model, shared, meta["memory_bytes"], dtype)
        _start_ray(max(2, replicas * threads), threads)
        port = _port()
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            results = {r: run_router(r, load, bodies, port, replicas, threads, concurrency, interval_s, deadline_s,
                                     router_options, log) for r in ROUTERS}
        finally:
            serve.shutdown()
            ray.shutdown()
    rows = [router_row(r, got, reference, replicas) for r, got in results.items()]
    keep = ("status", "replica", "chunk_sources", "ttft_s", "server_ttft_s", "text", "error")
    for row, got in zip(rows, results.values()):  # what each request measured, in trace order
        row["per_request"] = [r and {k: r[k] for k in keep if k in r} for r in got]
    meta.update(model=model or "smollm2", dtype=str(dtype or "default"), replicas=replicas, threads=threads,
                requests=n_requests, docs=n_docs, passages_per_doc=per_doc, passages_per_request=k, zipf=zipf, mix=mix,
                seed=seed, max_tokens=max_tokens, concurrency=concurrency, interval_s=interval_s,
                reference_answers=reference, verdict=verdict(rows))
    return rows, meta


def add_ideal(path, log=None) -> dict:
    """A finished run's JSON (``path``) with the ideal's hit rate added to its meta, recomputed from its own trace
    settings (the model loads for its tokenizer and K/V size; nothing runs on Ray) -> the updated meta."""
    got = json.loads(Path(path).read_text())
    m = got["meta"]
    with tempfile.TemporaryDirectory(prefix="kvstitch-bench-replicas-") as shared:
        engine = load_replica_engine(None if m["model"] == "smollm2" else m["model"], shared, 1 << 30,
                                     None if m.get("dtype") in (None, "default") else m["dtype"])
        _, fresh = _trace(engine, m["requests"], m["docs"], m["passages_per_request"], m["zipf"], m["seed"],
                          m["passages_per_doc"], m["max_tokens"], m["tier_share"], m["mix"], m["replicas"])
    if fresh["memory_bytes"] != m["memory_bytes"]:
        raise InputError(f"{path}: the trace rebuilt does not size the tiers as the run did "
                         f"({fresh['memory_bytes']} vs {m['memory_bytes']} bytes)")
    m["ideal_hit_rate"] = fresh["ideal_hit_rate"]
    return got
