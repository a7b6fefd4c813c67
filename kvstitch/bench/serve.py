"""`kvstitch bench serve`: a real server on loopback under concurrent load (continuous batching, #14).

A fixed request mix over a shared document set (RULER-style passages, ``docs`` chunks; request i asks one
of a few questions over ``docs_per_request`` of them, methods cycling over ``methods``), the store warmed
first. Every request is served once alone (serially) for the reference answer; then, for each
concurrency c, all requests are sent by c concurrent streaming clients. Per row: requests/s, completion
tokens/s, client-side TTFT p50/p95 (request sent -> first SSE event, i.e. queue wait + prefill + first
token), the 429 rate (a 429 is retried after its Retry-After, so no request is lost) and whether every
answer equals the same request served alone (greedy). With ``serial`` the highest concurrency is also run
against a serial server (``max_batch=1``) on the same engine: ``speedup_vs_serial`` is the batched
server's completion tokens/s over the serial server's. ``prefill_batch`` / ``decode_batch``: the mean number of
requests per packed recompute pass / per batched decode pass during the row (the server's own histograms).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time

from .ttft import context_of_length
from kvstitch.engine.precompute import ensure_chunks

QUESTIONS = ["Summarize the passages in one sentence.", "Which numbers are mentioned in the passages?",
             "What is the main topic of the first passage?"]


def request_mix(engine, n_requests: int, docs: int = 8, doc_tokens: int = 256, docs_per_request: int = 4,
                max_tokens: int = 32, methods: tuple[str, ...] = ("prophet", "random"),
                ratio: float = 0.2) -> list[dict]:
    """The fixed request bodies (OpenAI chat + kvstitch extensions)."""
    question, chunks = context_of_length(engine, docs * doc_tokens, chunk_tokens=doc_tokens)
    chunks = chunks[:docs]
    k = min(docs_per_request, len(chunks))
    bodies = []
    for i in range(n_requests):
        q = [question, *QUESTIONS][i % (1 + len(QUESTIONS))]
        start = (i * 3) % len(chunks)
        documents = [chunks[(start + j) % len(chunks)] for j in range(k)]
        bodies.append({"model": "bench", "messages": [{"role": "user", "content": q}], "documents": documents,
                       "method": methods[i % len(methods)], "ratio": ratio, "temperature": 0,
                       "max_tokens": max_tokens if i % 2 == 0 else max(1, max_tokens // 2)})
    return bodies


def warm_store(engine, bodies: list[dict]) -> int:
    """Precompute every request's chunks (and its system segment) -> the number computed."""
    computed = 0
    for b in bodies:
        layout = engine.layout(None, b["documents"], b["messages"])
        computed += ensure_chunks(engine, layout.chunk_ids, prefix_ids=layout.prefix_ids).computed
    return computed


async def _one(client, body: dict, max_retry_s: float) -> dict:
    """One streamed request (retried on 429) -> {text, completion_tokens, ttft_s, n_429, status}."""
    n_429 = 0
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    while True:
        t0 = time.perf_counter()
        async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
            if resp.status_code == 429:
                await resp.aread()
                n_429 += 1
                await asyncio.sleep(min(max_retry_s, float(resp.headers.get("retry-after", "1"))))
                continue
            if resp.status_code != 200:
                await resp.aread()
                return {"status": resp.status_code, "n_429": n_429, "error": resp.text[:200]}
            ttft, text, tokens = None, "", 0
            async for line in resp.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                if ttft is None:
                    ttft = time.perf_counter() - t0
                ev = json.loads(line[6:])
                if "error" in ev:
                    return {"status": 500, "n_429": n_429, "error": ev["error"]["message"]}
                for ch in ev.get("choices", []):
                    text += ch["delta"].get("content") or ""
                if ev.get("usage"):
                    tokens = ev["usage"]["completion_tokens"]
            return {"status": 200, "text": text, "completion_tokens": tokens, "ttft_s": ttft, "n_429": n_429}


async def run_load(url: str, bodies: list[dict], concurrency: int, max_retry_s: float = 2.0,
                   timeout: float = 600.0) -> tuple[list[dict], float]:
    """Send ``bodies`` with ``concurrency`` clients (each takes the next request when done) -> (results, wall s)."""
    import httpx

    todo = list(enumerate(bodies))
    results: list[dict | None] = [None] * len(bodies)
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)

    async def client_loop(client):
        while todo:
            i, body = todo.pop(0)
            results[i] = await _one(client, body, max_retry_s)

    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return results, wall


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def _batch_means(metrics, before: dict | None = None) -> dict:
    """{histogram: (sum, count)} of the server's batch-size histograms; with ``before``: the mean over the interval."""
    now = {k: metrics.hist_totals(k) for k in ("kvstitch_recompute_batch_size", "kvstitch_batch_size")}
    if before is None:
        return now
    means = {}
    for k, (s, c) in now.items():
        s0, c0 = before.get(k, (0.0, 0))
        means[k] = (s - s0) / (c - c0) if c > c0 else float("nan")
    return {"prefill_batch": means.get("kvstitch_recompute_batch_size", float("nan")),
            "decode_batch": means.get("kvstitch_batch_size", float("nan"))}


def _row(server: str, concurrency: int, results: list[dict], wall: float, reference: list[str] | None) -> dict:
    ok = [r for r in results if r and r["status"] == 200]
    ttfts = [r["ttft_s"] for r in ok if r.get("ttft_s") is not None]
    tokens = sum(r["completion_tokens"] for r in ok)
    attempts = sum(1 + r["n_429"] for r in results if r)
    n_429 = sum(r["n_429"] for r in results if r)
    mismatches = None
    if reference is not None:
        mismatches = sum(1 for r, ref in zip(results, reference) if not r or r["status"] != 200 or r["text"] != ref)
    return {"server": server, "concurrency": concurrency, "requests": len(results), "answered": len(ok),
            "lost": len(results) - len(ok), "wall_s": wall, "requests_per_s": len(ok) / wall,
            "completion_tokens": tokens, "completion_tokens_per_s": tokens / wall,
            "ttft_p50_s": _pct(ttfts, 0.5), "ttft_p95_s": _pct(ttfts, 0.95),
            "ttft_mean_s": statistics.fmean(ttfts) if ttfts else float("nan"),
            "n_429": n_429, "rate_429": n_429 / attempts if attempts else 0.0,
            "answers_equal_alone": mismatches == 0 if mismatches is not None else None, "mismatches": mismatches}


def bench_serve(engine, concurrency: list[int], n_requests: int = 32, docs: int = 8, doc_tokens: int = 256,
                docs_per_request: int = 4, max_tokens: int = 32, methods: tuple[str, ...] = ("prophet", "random"),
                ratio: float = 0.2, max_batch: int = 16, max_queue: int | None = None, serial: bool = True,
                log=None) -> list[dict]:
    """Rows per concurrency (batched server) + the serial server at the highest concurrency (see module doc)."""
    from kvstitch.serve.server import ServerThread, create_app

    log = log or (lambda msg: None)
    bodies = request_mix(engine, n_requests, docs, doc_tokens, docs_per_request, max_tokens, methods, ratio)
    log(f"warming the store: {warm_store(engine, bodies)} chunks computed")
    max_queue = max_queue if max_queue is not None else max(n_requests, max(concurrency))

    apps = []

    def server(batch: int):
        apps.append(create_app(engine, default_method=methods[0], default_ratio=ratio, max_queue=max_queue,
                               model_name="bench", max_batch=batch))
        return ServerThread(apps[-1])

    rows = []
    with server(max_batch) as srv:
        ref, wall = asyncio.run(run_load(srv.url, bodies, 1))
        if any(r["status"] != 200 for r in ref):
            raise RuntimeError(f"a reference request failed: {[r for r in ref if r['status'] != 200][:1]}")
        reference = [r["text"] for r in ref]
        log(f"reference (each request alone): {wall:.1f} s")
        for c in concurrency:
            before = _batch_means(apps[-1].state.metrics)
            results, wall = asyncio.run(run_load(srv.url, bodies, c))
            rows.append(_row(f"batched (max_batch={max_batch})", c, results, wall, reference))
            rows[-1].update(_batch_means(apps[-1].state.metrics, before))
            log(f"concurrency {c}: {rows[-1]['completion_tokens_per_s']:.1f} tok/s, {wall:.1f} s")
    if serial and max_batch > 1:
        c = max(concurrency)
        with server(1) as srv:
            before = _batch_means(apps[-1].state.metrics)
            results, wall = asyncio.run(run_load(srv.url, bodies, c))
        rows.append(_row("serial (max_batch=1)", c, results, wall, reference))
        rows[-1].update(_batch_means(apps[-1].state.metrics, before))
        log(f"serial server, concurrency {c}: {rows[-1]['completion_tokens_per_s']:.1f} tok/s")
        base = rows[-1]["completion_tokens_per_s"]
        for r in rows[:-1]:
            if r["concurrency"] == c and base > 0:
                r["speedup_vs_serial"] = r["completion_tokens_per_s"] / base
    return rows


def serve_table(rows: list[dict]) -> str:
    lines = ["| server | concurrency | requests | answered | req/s | completion tok/s | TTFT p50 (s) | TTFT p95 (s) | "
             "429 rate | prefill batch | decode batch | equal to alone | vs serial |", "|" + "---|" * 13]
    for r in rows:
        eq = "-" if r["answers_equal_alone"] is None else ("yes" if r["answers_equal_alone"] else
                                                            f"no ({r['mismatches']} differ)")
        vs = f"{r['speedup_vs_serial']:.2f}x" if "speedup_vs_serial" in r else "-"
        lines.append(f"| {r['server']} | {r['concurrency']} | {r['requests']} | {r['answered']} | "
                     f"{r['requests_per_s']:.3f} | {r['completion_tokens_per_s']:.2f} | {r['ttft_p50_s']:.3f} | "
                     f"{r['ttft_p95_s']:.3f} | {r['rate_429']:.2%} | {r.get('prefill_batch', float('nan')):.2f} | "
                     f"{r.get('decode_batch', float('nan')):.2f} | {eq} | {vs} |")
    return "\n".join(lines)
