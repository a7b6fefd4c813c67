"""`kvstitch bench serve`: a real server on loopback under concurrent load (continuous batching).

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

Long contexts and sparse decode: with ``context`` every request has documents of its own (a RULER-style
sample of ``context`` tokens, seeded by the request's index, so nothing is shared across requests) and asks
for a long answer of ``max_tokens``; with several ``decode`` policies (``dense``, or sparse specs) each runs
the whole concurrency sweep on a server of its own, and its answers are compared with the same request
decoded alone *with that policy* (its concurrency-1 row when the sweep has one). Such rows add the decode
side: TPOT p50/p95 (client side: the time between the first and the last streamed token over the tokens
between them), the attention recall the server sampled (``recall_sample`` of the sparse passes), the
selected-token fraction, the peak resident memory of the process during the row and the KV pool's peak
reservation, and ``vs_dense``: completion tokens/s over dense decode's at the same concurrency. Beside
``decode_vs_dense`` stands ``bound``: the bytes-read bound of that speed-up for the row's model, mean decode
batch, context (+ half the answer) and budget (`kvstitch.bench.bound`; its bytes in the ``bound_*`` fields).
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import threading
import time

from kvstitch.decode.policies import is_dense, make_policy
from .ttft import context_of_length
from kvstitch.engine.request import new_decoder
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


LONG_QUESTION = ("Go through the passages one by one and, for each, write a detailed paragraph on what it says, "
                 "quoting every number it mentions.")
DENSE = "dense"  # the server's name for dense decode (rows written before it say "full": `is_dense` reads both)


def long_context_mix(engine, n_requests: int, context: int, doc_tokens: int = 256, max_tokens: int = 128,
                     methods: tuple[str, ...] = ("prophet",), ratio: float = 0.2, seed: int = 0) -> list[dict]:
    """Bodies with documents of their own: request i's are a ``context``-token sample seeded ``seed + i``,
    its question asks for a long answer, and every answer is ``max_tokens`` long (``min_tokens``: EOS masked
    before), so every policy decodes the same number of steps."""
    bodies = []
    for i in range(n_requests):
        _, chunks = context_of_length(engine, context, chunk_tokens=doc_tokens, seed=seed + i)
        bodies.append({"model": "bench", "messages": [{"role": "user", "content": LONG_QUESTION}],
                       "documents": chunks, "method": methods[i % len(methods)], "ratio": ratio,
                       "temperature": 0, "max_tokens": max_tokens, "min_tokens": max_tokens})
    return bodies


class PeakRSS:
    """The process's peak resident memory while active, sampled every ``interval`` s from /proc (Linux; the
    row's own peak, not the process's lifetime peak that getrusage gives). Elsewhere ``peak`` stays None."""

    def __init__(self, interval: float = 0.05) -> None:
        self.interval, self.peak = interval, None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @staticmethod
    def rss() -> int | None:
        try:
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            return None

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            now = self.rss()
            if now is not None:
                self.peak = max(self.peak or 0, now)

    def __enter__(self) -> "PeakRSS":
        self.peak = self.rss()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


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
            ttft, text, tokens, first, last = None, "", 0, None, None
            async for line in resp.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                now = time.perf_counter()
                if ttft is None:
                    ttft = now - t0
                ev = json.loads(line[6:])
                if "error" in ev:
                    return {"status": 500, "n_429": n_429, "error": ev["error"]["message"]}
                for ch in ev.get("choices", []):
                    if ch["delta"].get("content"):
                        text += ch["delta"]["content"]
                        first, last = first or now, now
                if ev.get("usage"):
                    tokens = ev["usage"]["completion_tokens"]
            # TPOT: first to last streamed content over the tokens after the first (text deltas may hold a few)
            tpot = (last - first) / (tokens - 1) if first is not None and last > first and tokens > 1 else None
            return {"status": 200, "text": text, "completion_tokens": tokens, "ttft_s": ttft, "tpot_s": tpot,
                    "n_429": n_429}


async def run_load(url: str, bodies: list[dict], concurrency: int, max_retry_s: float = 2.0,
                   timeout: float = 600.0) -> tuple[list[dict], float]:
    """Send ``bodies`` with ``concurrency`` clients (each takes the next request when done) -> (results, wall s)."""
    from kvstitch.core.extras import require

    httpx = require("httpx", "serve", "kvstitch bench serve")

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


_HISTOGRAMS = {"kvstitch_recompute_batch_size": "prefill_batch", "kvstitch_batch_size": "decode_batch",
               "kvstitch_decode_recall": "recall"}
_COUNTERS = ("kvstitch_decode_selected_tokens_total", "kvstitch_decode_context_tokens_total",
             "kvstitch_decode_timed_tokens_total")


def _batch_means(metrics, before: dict | None = None) -> dict:
    """The server's histogram totals and sparse-decode counters; with ``before``: the row's means over the
    interval (``prefill_batch``, ``decode_batch``, ``recall``), its ``selected_fraction`` and its decode
    throughput ``decode_tok_per_s``: tokens of the timed decode passes over their time (the server's clock:
    prefill and queueing left out, unlike ``completion_tokens_per_s``)."""
    now = ({k: metrics.hist_totals(k) for k in [*_HISTOGRAMS, "kvstitch_decode_pass_seconds"]}
           | {k: metrics.get(k) for k in _COUNTERS})
    if before is None:
        return now
    means = {}
    for k, name in _HISTOGRAMS.items():
        (s, c), (s0, c0) = now[k], before[k]
        means[name] = (s - s0) / (c - c0) if c > c0 else float("nan")
    sel, ctx, timed = (now[k] - before[k] for k in _COUNTERS)
    means["selected_fraction"] = sel / ctx if ctx else float("nan")
    seconds = now["kvstitch_decode_pass_seconds"][0] - before["kvstitch_decode_pass_seconds"][0]
    means["decode_tok_per_s"] = timed / seconds if seconds > 0 else float("nan")
    return means


def _row(server: str, concurrency: int, results: list[dict], wall: float, reference: list[str] | None) -> dict:
    ok = [r for r in results if r and r["status"] == 200]
    ttfts = [r["ttft_s"] for r in ok if r.get("ttft_s") is not None]
    tpots = [r["tpot_s"] for r in ok if r.get("tpot_s") is not None]
    tokens = sum(r["completion_tokens"] for r in ok)
    attempts = sum(1 + r["n_429"] for r in results if r)
    n_429 = sum(r["n_429"] for r in results if r)
    mismatches, differ = None, []
    if reference is not None:
        for i, (r, ref) in enumerate(zip(results, reference)):
            got = r.get("text") if r and r["status"] == 200 else None
            if got is None or got != ref:
                got, ref = got or "", ref or ""  # where the answer left the one given alone (token ties show up late in long answers)
                at = next((j for j, (a, b) in enumerate(zip(got, ref)) if a != b), min(len(got), len(ref)))
                differ.append({"request": i, "first_difference_at_char": at, "alone": ref[max(0, at - 40):at + 40],
                               "got": got[max(0, at - 40):at + 40]})
        mismatches = len(differ)
    return {"server": server, "concurrency": concurrency, "requests": len(results), "answered": len(ok),
            "lost": len(results) - len(ok), "wall_s": wall, "requests_per_s": len(ok) / wall,
            "completion_tokens": tokens, "completion_tokens_per_s": tokens / wall,
            "ttft_p50_s": _pct(ttfts, 0.5), "ttft_p95_s": _pct(ttfts, 0.95),
            "ttft_mean_s": statistics.fmean(ttfts) if ttfts else float("nan"),
            "tpot_p50_s": _pct(tpots, 0.5), "tpot_p95_s": _pct(tpots, 0.95),
            "n_429": n_429, "rate_429": n_429 / attempts if attempts else 0.0,
            "answers_equal_alone": mismatches == 0 if mismatches is not None else None, "mismatches": mismatches,
            "differ": differ}


def bench_serve(engine, concurrency: list[int], n_requests: int = 32, docs: int = 8, doc_tokens: int = 256,
                docs_per_request: int = 4, max_tokens: int = 32, methods: tuple[str, ...] = ("prophet", "random"),
                ratio: float = 0.2, max_batch: int = 16, max_queue: int | None = None, serial: bool = True,
                log=None, decode: tuple[str, ...] = (DENSE,), context: int | None = None,
                kv_budget: int | None = None, kv_pool_bytes: int | None = None,
                recall_sample: float = 0.05) -> list[dict]:
    """Rows per decode policy and concurrency (batched server) + the serial server at the highest concurrency
    (dense decode only; see the module doc)."""
    from kvstitch.serve.server import create_app
    from kvstitch.serve.testing import ServerThread

    log = log or (lambda msg: None)
    decode = _check_levels(concurrency, decode)
    if context is not None:
        bodies = long_context_mix(engine, n_requests, context, doc_tokens, max_tokens, methods, ratio)
    else:
        bodies = request_mix(engine, n_requests, docs, doc_tokens, docs_per_request, max_tokens, methods, ratio)
    log(f"warming the store: {warm_store(engine, bodies)} chunks computed")
    max_queue = max_queue if max_queue is not None else max(n_requests, max(concurrency))

    apps = []

    def server(batch: int):
        apps.append(create_app(engine, default_method=methods[0], default_ratio=ratio, max_queue=max_queue,
                               model_name="bench", max_batch=batch, kv_pool_bytes=kv_pool_bytes,
                               recall_sample=recall_sample))
        return ServerThread(apps[-1])

    def measure(srv, label: str, policy: str, c: int, todo: list[dict],
                reference: list[str] | None) -> tuple[dict, list[str | None]]:
        before = _batch_means(apps[-1].state.metrics)
        with PeakRSS() as mem:
            results, wall = asyncio.run(run_load(srv.url, todo, c))
        row = _row(label, c, results, wall, reference)
        pool = apps[-1].state.worker.pool
        row.update(_batch_means(apps[-1].state.metrics, before), decode=policy, peak_rss_bytes=mem.peak,
                   kv_pool_peak_bytes=pool.peak, kv_pool_limit_bytes=pool.limit, kv_pool_waits=pool.waits)
        log(f"{policy} decode, concurrency {c}: {row['completion_tokens_per_s']:.2f} tok/s, "
            f"TPOT p50 {row['tpot_p50_s']:.3f} s, {wall:.1f} s")
        return row, [r.get("text") if r else None for r in results]

    rows = []
    for policy in decode:
        todo = [b if is_dense(policy) else {**b, "decode": policy, **({"kv_budget": kv_budget} if kv_budget else {})}
                for b in bodies]
        with server(max_batch) as srv:
            alone = _alone(srv, todo, policy, log) if 1 not in concurrency else None
            for c in sorted(concurrency):
                row, texts = measure(srv, f"batched (max_batch={max_batch})", policy, c, todo, alone)
                if c == 1:
                    alone = texts
                    row.update(answers_equal_alone=True, mismatches=0)  # it is the reference
                rows.append(row)
        if serial and max_batch > 1 and is_dense(policy):
            with server(1) as srv:
                rows.append(measure(srv, "serial (max_batch=1)", policy, max(concurrency), todo, alone)[0])
            _speedup_vs_serial(rows, policy, max(concurrency))
    _add_bounds(engine, rows, context or docs_per_request * doc_tokens, max_tokens, kv_budget)
    _vs_dense(rows)
    return rows


def _check_levels(concurrency: list[int], decode: tuple[str, ...]) -> tuple[str, ...]:
    """Checks the concurrency levels and decode policies -> the policies as canonical specs (the rows' labels)."""
    from kvstitch.core.errors import InputError

    if not concurrency or min(concurrency) < 1:
        raise InputError(f"concurrency levels must be positive, got {concurrency}")
    if not decode:
        raise InputError("name at least one decode policy (dense, or a sparse one such as prkv)")
    return tuple(dict.fromkeys(make_policy(p).spec for p in decode))


def _alone(srv, todo: list[dict], policy: str, log) -> list[str]:
    """The reference answers: each request alone, with this policy."""
    ref, wall = asyncio.run(run_load(srv.url, todo, 1))
    if any(r["status"] != 200 for r in ref):
        raise RuntimeError(f"a reference request failed: {[r for r in ref if r['status'] != 200][:1]}")
    log(f"{policy} decode, reference (each request alone): {wall:.1f} s")
    return [r["text"] for r in ref]


def _speedup_vs_serial(rows: list[dict], policy: str, concurrency: int) -> None:
    """The batched rows of ``policy`` at ``concurrency`` against the serial row just measured (the last one)."""
    base = rows[-1]["completion_tokens_per_s"]
    for r in rows[:-1]:
        if r["decode"] == policy and r["concurrency"] == concurrency and base > 0:
            r["speedup_vs_serial"] = r["completion_tokens_per_s"] / base


def _vs_dense(rows: list[dict]) -> None:
    """Each row against the batched dense row at its concurrency: end to end (completion tokens/s) and decode
    alone (the decode passes' throughput)."""
    dense = {r["concurrency"]: r for r in rows if is_dense(r["decode"]) and r["server"].startswith("batched")}
    for r in rows:
        d = dense.get(r["concurrency"])
        if d is not None:
            r["vs_dense"] = r["completion_tokens_per_s"] / d["completion_tokens_per_s"]
            r["decode_vs_dense"] = r["decode_tok_per_s"] / d["decode_tok_per_s"]


def _add_bounds(engine, rows: list[dict], context: int, max_tokens: int, kv_budget: int | None) -> None:
    """Each sparse row's bytes-read bound (`bench.bound`): at the row's mean decode batch, a cache of the
    context plus half the answer (its mean length over the decode) and the policy's ``k + window``."""
    from .bound import bytes_bound, model_bytes

    m = model_bytes(engine)
    caps: dict[str, int] = {}
    for r in rows:
        policy = r.get("decode", DENSE)
        if is_dense(policy):
            continue
        if policy not in caps:
            caps[policy] = new_decoder(engine, policy, kv_budget).cap
        batch = r.get("decode_batch")
        batch = batch if batch is not None and batch == batch else r["concurrency"]
        r.update(bytes_bound(m, context + max_tokens // 2, batch, caps[policy]))


def serve_table(rows: list[dict]) -> str:
    sparse = any(not is_dense(r.get("decode", DENSE)) for r in rows)
    head = ("| server | decode | concurrency | requests | answered | req/s | completion tok/s | TTFT p50 (s) | "
            "TTFT p95 (s) | TPOT p50 (s) | TPOT p95 (s) | 429 rate | prefill batch | decode batch | equal to alone | "
            "vs serial |")
    extra = (" decode tok/s | recall | selected | peak RSS (GiB) | KV pool peak (GiB) | pool waits | vs dense | "
             "decode vs dense | bytes bound |") if sparse else ""
    cols = head.count("|") - 1 + extra.count("|")
    lines = [head + extra, "|" + "---|" * cols]

    def num(v, fmt: str) -> str:
        return "-" if v is None or v != v else format(v, fmt)

    for r in rows:
        eq = "-" if r["answers_equal_alone"] is None else ("yes" if r["answers_equal_alone"] else
                                                            f"no ({r['mismatches']} differ)")
        vs = f"{r['speedup_vs_serial']:.2f}x" if "speedup_vs_serial" in r else "-"
        line = (f"| {r['server']} | {r.get('decode', DENSE)} | {r['concurrency']} | {r['requests']} | {r['answered']} | "
                f"{r['requests_per_s']:.3f} | {r['completion_tokens_per_s']:.2f} | {r['ttft_p50_s']:.3f} | "
                f"{r['ttft_p95_s']:.3f} | {num(r.get('tpot_p50_s'), '.3f')} | {num(r.get('tpot_p95_s'), '.3f')} | "
                f"{r['rate_429']:.2%} | {num(r.get('prefill_batch'), '.2f')} | {num(r.get('decode_batch'), '.2f')} | "
                f"{eq} | {vs} |")
        if sparse:
            gib = lambda v: None if v is None else v / 2**30  # noqa: E731
            line += (f" {num(r.get('decode_tok_per_s'), '.2f')} | {num(r.get('recall'), '.3f')} | "
                     f"{num(r.get('selected_fraction'), '.3f')} | {num(gib(r.get('peak_rss_bytes')), '.2f')} | "
                     f"{num(gib(r.get('kv_pool_peak_bytes')), '.2f')} | {r.get('kv_pool_waits', 0)} | "
                     f"{num(r.get('vs_dense'), '.2f')} | {num(r.get('decode_vs_dense'), '.2f')} | "
                     f"{num(r.get('bound'), '.2f')} |")
        lines.append(line)
    return "\n".join(lines)
