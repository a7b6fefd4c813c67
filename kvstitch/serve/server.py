"""An OpenAI-compatible HTTP server over one `Engine` (FastAPI + uvicorn).

    kvstitch serve --model ... --store DIR --method prophet --ratio 0.2 --port 8000   (`kvstitch.cli.serve`)

Endpoints
    POST /v1/chat/completions   OpenAI chat completions (JSON, or SSE with ``"stream": true``)
    GET  /v1/models             the served model (+ methods, defaults and collections as an extension)
    GET  /v1/collections        the indexed collections this server can retrieve from
    GET  /health                {"status": "ok", ...}; 503 when the engine worker is dead
    GET  /metrics               Prometheus text format

Request extensions (top-level JSON fields; the OpenAI Python client sends them with ``extra_body=``):
    documents: [str]            the retrieved passages, in prompt order ...
    collection: str, top_k: int ... or retrieve the top-k chunks of an indexed collection (`kvstitch index`)
    method, ratio (or recompute_ratio), decode, kv_budget: per-request overrides; ``method`` is a spec string
                                ("deltaprop(base=infoflow,alpha_k=0.5)", see `kvstitch methods`); the older
                                ``method_options`` object is merged into it
The whole conversation is the prompt: the model's chat template over every message (system/developer,
user, assistant, tool results as text), the passages appended to the system message - after the system
prompt, before the conversation (`PromptBuilder.build_messages`). The system prompt is a stitched segment
with its own store key (cached like a chunk); history and the last user turn are recomputed and are what
query-driven selectors read. Retrieval from a collection searches with the last user message. Without
``documents`` and ``collection`` the request is plain chat: an ordinary full prefill (method "full").
``temperature`` defaults to 0 (greedy, as `Engine.generate`), ``seed`` to 0 (honoured when sampling).
``stop`` (a string or up to 4) cuts the text before the first stop string, with finish_reason "stop"
(streaming holds back text that may start a stop string). Every other parameter is a 400 naming it unless
listed in `CHAT_PARAMS`: ``n`` > 1, non-zero ``presence_penalty`` / ``frequency_penalty``, ``logprobs``,
``tools``, ``logit_bias``, a non-text ``response_format`` and unknown fields are refused, never ignored.

The response carries OpenAI's ``usage`` plus ``kvstitch: {ttft_s, queue_wait_s, store_hits, store_misses,
recomputed_tokens, context_tokens, method, ratio, decode, retrieved}`` (in the last SSE chunk when
streaming). Errors use OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``.

Concurrency: the model is not thread-safe, so one worker thread owns the engine. It serves up to
``max_batch`` jobs at once (continuous batching, `EngineWorker`): each round admits the queued jobs there is
room for, prepares each (load, stitch, select) and runs their recompute passes as one packed forward
(`Engine.recompute_batch`), then the jobs join the batch, whose dense decode steps run as one forward per token
(`Engine.decode_batch`; each request attends over its own cache, so its answer is the one it gets alone);
jobs whose decoding cannot batch (sparse decode, APE/A3 decode plans, guard="full") take one model step
per round. Between steps the worker checks each job's cancelled flag, which is set when the client
disconnects (SSE: the response task is cancelled; JSON: ``request.is_disconnected()`` is polled while
waiting). Behind a full batch at most ``max_queue`` jobs wait; more are refused with 429 and a
``Retry-After`` estimated from recent service times. /metrics reports the batch sizes.
"""

import asyncio
import json
import math
import queue
import random
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # fastapi is imported by create_app: `kvstitch` commands other than serve stay light
    from fastapi import FastAPI

import torch

from kvstitch.engine.budget import AutoBudget, parse_ratio
from kvstitch.engine.batch import DecodeStep, RecomputeStep
from kvstitch.decode.kvpool import KVPool, KVShape
from kvstitch.engine import STOP, GenerationRequest, GenerationResult
from kvstitch.core.errors import InputError, KVStitchError
from kvstitch.core.prompt import normalize_messages
from kvstitch.corpus.retrieval import CollectionCache, CollectionNotFound
from kvstitch.select import check_method, make_selector
from kvstitch.select import methods as registered_methods
from .core import ApiError, ClientGone, Job, QueueFull  # noqa: F401  (re-exported: tests, routers)
from .documents import DocumentService, documents_router, resolve_document_ids
from .security import SecurityConfig, install_security
from kvstitch.store.resilient import resilient

DEFAULT_MAX_TOKENS = 256
MAX_TOP_K = 64
MAX_STOP = 4
# every request field this server understands (anything else is a 400 naming it): OpenAI's, then ours
CHAT_PARAMS = {"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "stream",
               "stream_options", "stop", "n", "presence_penalty", "frequency_penalty", "logprobs", "top_logprobs",
               "tools", "functions", "tool_choice", "function_call", "response_format", "logit_bias", "user",
               "metadata", "store", "parallel_tool_calls",
               "documents", "collection", "top_k", "method", "ratio", "recompute_ratio", "decode", "kv_budget",
               "method_options", "guard", "auto", "min_tokens"}


def _input_error(e: InputError) -> ApiError:
    """An `InputError` as a 400: its type sets `code` and `param` (`kvstitch.core.errors`), never its message."""
    return ApiError(400, str(e), code=e.code, param=e.param)


# ---- metrics (Prometheus text, written by hand) ----------------------------------------------------
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
WAIT_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
RATIO_BUCKETS = (0.0, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
RECALL_BUCKETS = (0.5, 0.7, 0.8, 0.9, 0.95, 0.98, 0.99, 1.0)
PASS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class Metrics:
    """The server's counters, gauges and histograms on `prometheus_client` (thread-safe), in a registry of
    their own; `render()` gives the Prometheus text format."""

    HELP = {
        "kvstitch_http_requests_total": ("counter", "HTTP requests by path and status code"),
        "kvstitch_chat_requests_total": ("counter", "chat completions by outcome "
                                                    "(ok, invalid, rejected, cancelled, error)"),
        "kvstitch_chat_method_total": ("counter", "answered chat completions by selection method"),
        "kvstitch_rejected_total": ("counter", "requests refused with 429 (queue full)"),
        "kvstitch_cancelled_total": ("counter", "jobs stopped because the client disconnected"),
        "kvstitch_generated_tokens_total": ("counter", "tokens generated by the engine (cancelled jobs included)"),
        "kvstitch_prompt_tokens_total": ("counter", "prompt tokens of answered requests"),
        "kvstitch_completion_tokens_total": ("counter", "completion tokens of answered requests"),
        "kvstitch_store_hits_total": ("counter", "chunk caches found in the store"),
        "kvstitch_store_misses_total": ("counter", "chunk caches computed (not in the store)"),
        "kvstitch_recomputed_tokens_total": ("counter", "context tokens recomputed"),
        "kvstitch_context_tokens_total": ("counter", "context (passage) tokens served"),
        "kvstitch_queue_depth": ("gauge", "jobs waiting for the engine"),
        "kvstitch_busy": ("gauge", "1 while the engine is running a job"),
        "kvstitch_active_requests": ("gauge", "jobs in flight on the engine (the current batch)"),
        "kvstitch_max_batch": ("gauge", "jobs the engine serves at once (continuous batching)"),
        "kvstitch_batch_size": ("histogram", "requests per batched decode pass"),
        "kvstitch_decode_passes_total": ("counter", "batched decode passes (one forward each)"),
        "kvstitch_recompute_batch_size": ("histogram", "requests per packed recompute (prefill) pass"),
        "kvstitch_recompute_passes_total": ("counter", "packed recompute passes (one forward each)"),
        "kvstitch_deferred_chunks": ("gauge", "chunks cold requests left to precompute while idle"),
        "kvstitch_max_queue": ("gauge", "queue depth past which requests get 429"),
        "kvstitch_ttft_seconds": ("histogram", "engine time to first token (prefill: load, stitch, select, "
                                               "recompute), excluding the queue wait"),
        "kvstitch_queue_wait_seconds": ("histogram", "time a job waited in the queue"),
        "kvstitch_request_duration_seconds": ("histogram", "engine time of a whole answered job"),
        "kvstitch_recompute_ratio": ("histogram", "recomputed / context tokens per answered request"),
        "kvstitch_auto_requests_total": ("counter", "ratio=auto requests by outcome (converged, full_prefill "
                                                    "fallback, ceiling reached)"),
        "kvstitch_guard_checks_total": ("counter", "answers checked against full prefill (guard)"),
        "kvstitch_guard_disagreements_total": ("counter", "checked answers that differed from full prefill's "
                                                          "(the full-prefill answer was returned)"),
        "kvstitch_store_up": ("gauge", "1 while the chunk store answers, 0 while requests are served without it"),
        "kvstitch_store_degraded_ops_total": ("counter", "store reads/writes skipped because the store was down"),
        "kvstitch_store_outages_total": ("counter", "times the chunk store became unreachable"),
        "kvstitch_kv_pool_reserved_bytes": ("gauge", "K/V bytes reserved by the requests in flight (prompt + "
                                                     "max_tokens each, reserved at admission)"),
        "kvstitch_kv_pool_limit_bytes": ("gauge", "the KV pool limit (--kv-pool-bytes; 0 = none)"),
        "kvstitch_kv_pool_occupancy": ("gauge", "reserved / limit (0 without a limit)"),
        "kvstitch_kv_pool_peak_bytes": ("gauge", "the most K/V bytes ever reserved at once"),
        "kvstitch_kv_pool_waits_total": ("counter", "admissions deferred because the KV pool was full (the "
                                                    "request waited, nothing failed)"),
        "kvstitch_kv_offloaded_bytes": ("gauge", "K/V bytes in the host (offload) tier of the sparse decoders "
                                                 "in flight"),
        "kvstitch_kv_device_bytes": ("gauge", "bytes the sparse decoders in flight keep on the compute device "
                                              "(page bounds, working sets)"),
        "kvstitch_decode_selected_tokens_total": ("counter", "tokens attended by sparse decode steps (sum over "
                                                             "layers and steps)"),
        "kvstitch_decode_context_tokens_total": ("counter", "tokens dense attention would have read in the same "
                                                            "sparse decode steps"),
        "kvstitch_decode_selected_fraction": ("gauge", "selected / context tokens of sparse decode so far"),
        "kvstitch_decode_recall": ("histogram", "attention recall of sparse decode steps (PRKV Eq. 3, mean over "
                                                "layers and heads), on a sampled fraction of steps"),
        "kvstitch_decode_pass_seconds": ("histogram", "wall time of one batched decode pass (every request's next "
                                                      "token), the passes that measured recall left out"),
        "kvstitch_decode_timed_tokens_total": ("counter", "tokens decoded by the passes in "
                                                          "kvstitch_decode_pass_seconds (decode throughput = "
                                                          "this / the histogram's sum)"),
    }

    # counters with labels: their label names (every other counter has none)
    LABELS = {"kvstitch_http_requests_total": ("code", "path"), "kvstitch_chat_requests_total": ("outcome",),
              "kvstitch_chat_method_total": ("method",), "kvstitch_auto_requests_total": ("outcome",)}
    BUCKETS = {"kvstitch_ttft_seconds": TTFT_BUCKETS, "kvstitch_queue_wait_seconds": WAIT_BUCKETS,
               "kvstitch_request_duration_seconds": TTFT_BUCKETS + (60.0, 120.0),
               "kvstitch_recompute_ratio": RATIO_BUCKETS, "kvstitch_batch_size": BATCH_BUCKETS,
               "kvstitch_recompute_batch_size": BATCH_BUCKETS, "kvstitch_decode_recall": RECALL_BUCKETS,
               "kvstitch_decode_pass_seconds": PASS_BUCKETS}

    # counters whose value is read from the store at each scrape (set in `gauges` as callables)
    READ_COUNTERS = ("kvstitch_store_degraded_ops_total", "kvstitch_store_outages_total",
                     "kvstitch_kv_pool_waits_total")

    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics

        disable_created_metrics()  # no *_created series: /metrics keeps the series it always had
        self.registry = CollectorRegistry(auto_describe=False)  # one per server: tests run several
        self.gauges: dict[str, Any] = {}  # name -> callable or value, read at each scrape (`_GaugeCollector`)
        self.registry.register(_GaugeCollector(self))
        self._counters = {name: Counter(name, help_, self.LABELS.get(name, ()), registry=self.registry)
                          for name, (typ, help_) in self.HELP.items() if typ == "counter" and name not in self.READ_COUNTERS}
        self.hists = {name: Histogram(name, self.HELP[name][1], buckets=b, registry=self.registry)
                      for name, b in self.BUCKETS.items()}

    def _counter(self, name: str, labels: dict):
        if name not in self._counters:
            from prometheus_client import Counter

            self._counters[name] = Counter(name, name, tuple(sorted(labels)), registry=self.registry)
        c = self._counters[name]
        return c.labels(**{k: str(v) for k, v in labels.items()}) if labels else c

    def inc(self, name: str, value: float = 1, **labels) -> None:
        self._counter(name, labels).inc(value)

    def observe(self, name: str, value: float) -> None:
        self.hists[name].observe(value)

    def hist_totals(self, name: str) -> tuple[float, float]:
        """(sum, count) of a histogram's observations."""
        reg = self.registry
        return (reg.get_sample_value(f"{name}_sum") or 0.0, reg.get_sample_value(f"{name}_count") or 0.0)

    def get(self, name: str, **labels) -> float:
        return self.registry.get_sample_value(name, {k: str(v) for k, v in labels.items()}) or 0

    def render(self) -> str:
        """The Prometheus text format (`prometheus_client.generate_latest`)."""
        from prometheus_client import generate_latest

        return generate_latest(self.registry).decode()


class _GaugeCollector:
    """The server's gauges: values or callables in `Metrics.gauges`, read when /metrics is scraped."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        for name, v in sorted(self.metrics.gauges.items()):
            value = v() if callable(v) else v
            help_ = Metrics.HELP.get(name, ("gauge", name))[1]
            if name in Metrics.READ_COUNTERS:
                from prometheus_client.core import CounterMetricFamily

                yield CounterMetricFamily(name[:-len("_total")], help_, value=float(value))
            else:
                yield GaugeMetricFamily(name, help_, value=float(value))


# ---- the engine worker -----------------------------------------------------------------------------
_DONE = object()
_QUIT = object()
IDLE_PRECOMPUTE_CHUNKS = 8  # deferred cold chunks computed per idle slice (a new job waits at most one slice)
RECOMPUTE_PACK_TOKENS = 16384  # tokens per packed recompute pass (more passes are split: bounded activations)


class _Live:
    """A job in flight on the engine worker: its `Engine.stream` generator and its pending decode step."""

    def __init__(self, job: Job, gen, scan):
        self.job, self.gen, self.scan = job, gen, scan
        self.step = None  # a `DecodeStep` waiting for the next batched pass
        self.rstep = None  # a `RecomputeStep` (its prefill's recompute pass) waiting for the next packed pass
        self.send = None  # what to send the generator next (None, or STOP after a stop string)
        self.batched = False  # its decode steps come as `DecodeStep`s
        self.decoder = None  # its sparse decoder, once decoding through one (pool and selection metrics)


class EngineWorker:
    """One thread owns the engine and serves up to ``max_batch`` jobs at once (continuous batching).

    Each loop iteration: admit the queued jobs there is room for and prepare each (load, stitch, select) up to
    its recompute pass, run those passes packed in one forward (`Engine.recompute_batch`; passes that cannot
    pack - APE, ratio "auto" rounds - ran alone during the preparation), advance every job that has no pending
    step by one model step (jobs that cannot batch - sparse decode, a method's decode plan, guard="full" -
    decode one token at a time here), then run the pending dense decode steps of all the others in one
    forward (`Engine.decode_batch`). A job joins the batch after its prefill and
    leaves it when it finishes, is cancelled (checked after each of its tokens) or fails. ``max_batch=1`` is
    the serial server. While idle, the worker computes the chunks cold requests deferred (`kvstitch.engine.cold`)."""

    def __init__(self, engine, max_queue: int, metrics: Metrics, warmup: bool = False, max_batch: int = 1,
                 kv_pool_bytes: int | None = None, recall_sample: float = 0.0):
        if max_queue < 0:
            raise ValueError("max_queue must be >= 0")
        if max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        if not 0.0 <= recall_sample <= 1.0:
            raise InputError(f"the recall sample rate must be in [0, 1], got {recall_sample}")
        self.engine, self.max_queue, self.metrics, self.warmup = engine, max_queue, metrics, warmup
        self.max_batch = max_batch
        # the K/V of the jobs in flight share one byte budget: a job is admitted when its prompt + max_tokens fit
        self.pool = KVPool(kv_pool_bytes)
        self.kv_shape = _kv_shape(engine)
        self._held: Job | None = None  # the queue's head, waiting for room in the KV pool (nothing overtakes it)
        self.recall_sample = recall_sample  # share of sparse decode passes whose attention recall is measured
        self.selection = (0, 0)  # tokens sparse decode attended / dense decode would have, over every pass
        self._recall_rng = random.Random(0)
        self._q: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self.waiting = 0
        self.active: list = []  # `_Live` jobs in flight
        self._service_ema: float | None = None  # seconds per job
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.ready = threading.Event()

    # -- admission (event-loop thread) ---------------------------------------------------------
    def submit(self, job: Job) -> None:
        with self._lock:
            if self._stopping:
                raise QueueFull(5)
            # in the system: the waiting jobs + the running ones; max_queue of them may wait behind a full batch
            if self.waiting + len(self.active) > self.max_queue + self.max_batch - 1:
                raise QueueFull(self._retry_after())
            self.waiting += 1
        self._q.put(job)

    def _retry_after(self) -> int:
        per_job = self._service_ema if self._service_ema is not None else 1.0
        return int(min(60, max(1, math.ceil(per_job * (self.waiting + 1) / self.max_batch))))

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def busy(self) -> bool:
        return bool(self.active)

    @property
    def current(self) -> Job | None:
        """The oldest job in flight (None when idle)."""
        active = self.active
        return active[0].job if active else None

    def start(self) -> None:
        if self.alive:
            return
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="kvstitch-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        with self._lock:
            self._stopping = True
        for live in list(self.active):
            live.job.cancel()
        held, self._held = self._held, None
        if held is not None:
            held.cancel()
            held.emit("error", ApiError(503, "the server is shutting down", "server_error", "shutting_down"))
            held.emit("done")
        # cancel everything still queued, then the sentinel
        while True:
            try:
                job = self._q.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.cancel()
                job.emit("error", ApiError(503, "the server is shutting down", "server_error", "shutting_down"))
                job.emit("done")
        self._q.put(None)
        if self._thread is not None:
            self._thread.join(timeout)

    # -- the worker thread ---------------------------------------------------------------------
    def _run(self) -> None:
        if self.warmup:
            try:
                self.engine.generate("What is this?", ["A short passage to warm the model up."],
                                     method="naive", max_new_tokens=2)
            except Exception:  # noqa: BLE001 - warm-up is best effort
                pass
        self.ready.set()
        try:
            while True:
                job = self._next_job(block=not self.active)
                while job is not None:  # admit every queued job there is room for: their recompute passes pack
                    if job is _QUIT:
                        return
                    self._start(job)
                    job = self._next_job(block=False)
                self._advance()
        finally:
            for live in list(self.active):
                self._finish(live)

    def _next_job(self, block: bool):
        """The next queued job (None: none waiting, the batch is full, or the head of the queue waits for room
        in the KV pool); while idle, deferred chunks."""
        if len(self.active) >= self.max_batch:
            return None
        if self._held is not None:
            job = self._held
            if not self._admit(job):
                return None  # still no room: it waits (first in, first out) until a job in flight ends
            self._held = None
            with self._lock:
                self.waiting -= 1
            return job
        while True:
            try:
                job = self._q.get_nowait()
            except queue.Empty:
                if not block:
                    return None
                if not self._idle_precompute():
                    job = self._q.get()
                else:
                    continue
            if job is None:
                return _QUIT
            try:
                admitted = self._admit(job)
            except InputError as e:  # it cannot fit even alone: refused before anything is computed
                with self._lock:
                    self.waiting -= 1
                job.emit("error", _input_error(e))
                job.emit("done")
                continue
            if not admitted:
                self._held = job
                self.pool.waits += 1
                return None
            with self._lock:
                self.waiting -= 1
            return job

    def _admit(self, job: Job) -> bool:
        """Reserve the job's K/V (prompt + max_tokens) in the pool -> False when it must wait for room."""
        if job.fn is not None or job.cancelled.is_set() or self.kv_shape is None:
            return True
        need = job.kv_bytes
        if need is None:
            need = job.kv_bytes = self._kv_bytes(job)
        return self.pool.reserve(job, need)

    def _kv_bytes(self, job: Job) -> int:
        """The most K/V bytes ``job`` can hold. Its prompt is tokenized here (the layout is handed to the engine,
        so it is not tokenized twice); a prompt that cannot be laid out counts 0 (the engine reports why)."""
        kw = job.kwargs
        try:
            layout = kw.get("layout") or self.engine.layout(kw.get("question"), kw.get("chunks"), kw.get("messages"))
        except Exception:  # noqa: BLE001 - the engine raises the same error, as a 400, when the job starts
            return 0
        kw["layout"] = layout
        return self.kv_shape.request_bytes(layout.n_total, int(kw.get("max_new_tokens") or 0),
                                           sparse=kw.get("decode", "full") != "full",
                                           copies=2 if kw.get("guard") else 1)  # guard: a full prefill beside it

    def _idle_precompute(self) -> bool:
        """Compute a slice of the chunks cold requests deferred -> False when there is nothing to do."""
        deferred = getattr(self.engine, "deferred", None)
        if deferred is None or not len(deferred):
            return False
        try:
            self.engine.precompute_deferred(IDLE_PRECOMPUTE_CHUNKS)
        except Exception:  # noqa: BLE001 - a failed background precompute must not kill the worker
            return False
        return True

    def _start(self, job: Job) -> None:
        job.started_at = time.perf_counter()
        wait = job.started_at - job.enqueued_at
        if job.cancelled.is_set():
            self.pool.release(job)
            self.metrics.inc("kvstitch_cancelled_total")
            job.emit("done")
            return
        self.metrics.observe("kvstitch_queue_wait_seconds", wait)
        job.emit("started", wait)
        if job.fn is not None:
            try:
                job.emit("result", job.fn(self.engine))
            except Exception as e:  # noqa: BLE001
                job.emit("error", self._api_error(e))
            finally:
                job.emit("done")
            return
        scan = StopScanner(self.engine.tokenizer, self.engine.eos_ids, job.stop) if job.stop else None
        live = _Live(job, None, scan)
        self.active.append(live)
        try:
            live.gen = self.engine.steps(GenerationRequest(**job.kwargs),
                                         batch_decode=hasattr(self.engine, "decode_batch"),
                                         batch_prefill=hasattr(self.engine, "recompute_batch"))
        except Exception as e:  # noqa: BLE001
            job.emit("error", self._api_error(e))
            self._finish(live)
            return
        self._pump(live)  # the preparation up to its recompute pass (or, if it cannot pack, to the first token)

    def _pending(self, attr: str) -> list["_Live"]:
        """The live jobs waiting on a pass (``attr``: "rstep" or "step"); a job cancelled meanwhile leaves here."""
        pending = []
        for live in list(self.active):
            if getattr(live, attr) is None:
                continue
            if live.job.cancelled.is_set():  # left before its pass ran
                self.metrics.inc("kvstitch_cancelled_total")
                self._finish(live)
                continue
            pending.append(live)
        return pending

    def _run_pass(self, jobs: list["_Live"], attr: str, run, size_metric: str, count_metric: str) -> None:
        """One forward for the pending steps (``attr``) of ``jobs`` (``run``: the engine's batched call), then
        hand each job its logits; a failed pass fails its jobs, not the worker."""
        try:
            logits = run([getattr(live, attr) for live in jobs])
        except Exception as e:  # noqa: BLE001
            for live in jobs:
                live.job.emit("error", self._api_error(e))
                self._finish(live)
            return
        self.metrics.observe(size_metric, len(jobs))
        self.metrics.inc(count_metric)
        for live, lg in zip(jobs, logits):
            setattr(live, attr, None)
            self._pump(live, lg)

    def _recompute(self) -> None:
        """Run the pending recompute passes of the jobs just admitted, packed (`Engine.recompute_batch`, at most
        `RECOMPUTE_PACK_TOKENS` tokens a forward), and take each job on to its first token."""
        packs, size = [], RECOMPUTE_PACK_TOKENS
        for live in self._pending("rstep"):
            n = live.rstep.ids.numel()
            if not packs or size + n > RECOMPUTE_PACK_TOKENS:
                packs.append([])
                size = 0
            packs[-1].append(live)
            size += n
        for pack in packs:
            self._run_pass(pack, "rstep", self.engine.recompute_batch, "kvstitch_recompute_batch_size",
                           "kvstitch_recompute_passes_total")

    def _advance(self) -> None:
        """Run the pending recompute passes, advance jobs without a pending step by one step, then run every
        pending decode step in one pass."""
        self._recompute()
        for live in list(self.active):
            if live.step is None and live.rstep is None:
                self._pump(live)
        pending = self._pending("step")
        if pending:
            decoders = [live.step.decoder for live in pending if getattr(live.step, "decoder", None) is not None]
            sampled = self._recall_begin(decoders)
            before = [d.selection_totals() for d in decoders]
            t0 = time.perf_counter()
            self._run_pass(pending, "step", self.engine.decode_batch, "kvstitch_batch_size",
                           "kvstitch_decode_passes_total")
            if not sampled:  # a recall pass also attends densely: its time is not the policy's
                self.metrics.observe("kvstitch_decode_pass_seconds", time.perf_counter() - t0)
                self.metrics.inc("kvstitch_decode_timed_tokens_total", len(pending))
            total_sel, total_ctx = self.selection
            for d, (sel0, ctx0) in zip(decoders, before):
                sel, ctx = d.selection_totals()
                self.metrics.inc("kvstitch_decode_selected_tokens_total", sel - sel0)
                self.metrics.inc("kvstitch_decode_context_tokens_total", ctx - ctx0)
                total_sel, total_ctx = total_sel + sel - sel0, total_ctx + ctx - ctx0
            self.selection = (total_sel, total_ctx)
            self._recall_end(sampled)

    def _recall_begin(self, decoders: list) -> list:
        """On a sampled pass (``recall_sample`` of them), the sparse decoders record this step's attention recall
        (their diagnostic mode: dense attention beside the sparse one; the answer is unchanged) ->
        [(decoder, history lengths before)]. Decoders whose request asked for diagnostics are left alone."""
        if not decoders or self.recall_sample <= 0 or self._recall_rng.random() >= self.recall_sample:
            return []
        marks = []
        for d in decoders:
            if not d.diagnostic:
                d.diagnostic = True
                marks.append((d, [len(h) for h in d.recall.history]))
        return marks

    def _recall_end(self, marks: list) -> None:
        """The sampled step's recall of each decoder into the histogram; its diagnostic state as it was."""
        for d, lengths in marks:
            d.diagnostic = False
            got = [h[n:] for h, n in zip(d.recall.history, lengths)]
            values = [v for layer in got for v in layer]
            if values:
                self.metrics.observe("kvstitch_decode_recall", float(torch.cat(values).mean()))
            for hist in (d.recall.history, d.recall.oracle):  # the request keeps no diagnostics it did not ask for
                for layer, n in zip(hist, lengths):
                    del layer[n:]

    def _pump(self, live: "_Live", value=None) -> None:
        """Send ``value`` (a step's logits, STOP or None) and handle events until the job needs a model step,
        has produced one token (unbatched jobs: one model step per iteration) or has ended."""
        job = live.job
        if value is None:
            value, live.send = live.send, None
        try:
            ev = live.gen.send(value)
            while True:
                if isinstance(ev, DecodeStep):
                    live.step, live.batched = ev, True
                    live.decoder = getattr(ev, "decoder", None)
                    return
                if isinstance(ev, RecomputeStep):
                    live.rstep = ev
                    return
                if isinstance(ev, GenerationResult):
                    dt = time.perf_counter() - job.started_at
                    self._service_ema = dt if self._service_ema is None else 0.8 * self._service_ema + 0.2 * dt
                    self.metrics.observe("kvstitch_request_duration_seconds", dt)
                    job.emit("result", live.scan.apply(ev) if live.scan is not None else ev)
                    self._finish(live)
                    return
                job.tokens += 1
                self.metrics.inc("kvstitch_generated_tokens_total")
                job.emit("token", ev)
                if job.cancelled.is_set():  # checked between model steps
                    self.metrics.inc("kvstitch_cancelled_total")
                    self._finish(live)
                    return
                # a stop string in the text: the engine ends here and yields its result
                nxt = STOP if live.scan is not None and live.scan.push(ev) else None
                if not live.batched:
                    live.send = nxt
                    return
                ev = live.gen.send(nxt)  # cheap: the next DecodeStep or the result
        except StopIteration:
            job.emit("error", ApiError(500, "generation ended without a result", "server_error", "internal_error"))
            self._finish(live)
        except Exception as e:  # noqa: BLE001 - one bad request must not kill the worker
            job.emit("error", self._api_error(e))
            self._finish(live)

    @staticmethod
    def _api_error(e: Exception) -> ApiError:
        if isinstance(e, InputError):
            return _input_error(e)
        if isinstance(e, KVStitchError):
            return ApiError(500, str(e), "server_error", type(e).__name__)
        return ApiError(500, f"internal error: {type(e).__name__}: {e}", "server_error", "internal_error")

    def _finish(self, live: "_Live") -> None:
        if live in self.active:
            self.active.remove(live)
        self.pool.release(live.job)
        live.decoder = None
        if live.gen is not None:
            try:
                live.gen.close()  # stops the engine's generator (no more model steps)
            except Exception:  # noqa: BLE001
                pass
        live.job.emit("done")


def _kv_shape(engine) -> "KVShape | None":
    """The engine's per-token K/V size (None for an engine without a model adapter: no pool accounting)."""
    ad = getattr(engine, "adapter", None)
    dtype = getattr(engine, "dtype", None)
    if ad is None or dtype is None:
        return None
    return KVShape(ad.num_layers, ad.num_kv_heads, ad.head_dim, torch.empty(0, dtype=dtype).element_size())


# ---- request parsing -------------------------------------------------------------------------------
@dataclass
class ChatRequest:
    question: str  # the last user message (what retrieval searches with)
    messages: list[dict]  # the whole conversation (normalized, see `kvstitch.core.prompt.normalize_messages`)
    stop: list[str]
    documents: list[str] | None
    collection: str | None
    top_k: int
    method: str  # the method's label (an alias, or its canonical spec: every option in it)
    ratio: float | str  # a fraction, or "auto" (kvstitch.engine.budget)
    decode: str
    kv_budget: int | None
    max_tokens: int
    temperature: float
    top_p: float
    seed: int
    stream: bool
    include_usage: bool
    model: str | None
    guard: str | None = None  # "full": verify the answer against full prefill
    auto: dict | None = None  # options of ratio "auto" (kvstitch.engine.budget.AutoBudget)
    min_tokens: int = 0  # EOS masked until the answer has this many tokens


def _bad(msg: str, param: str | None = None, code: str = "invalid_request") -> ApiError:
    return ApiError(400, msg, code=code, param=param)


def _int(body: dict, name: str, default, lo: int | None = None, hi: int | None = None):
    v = body.get(name, None)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (isinstance(v, float) and not v.is_integer()):
        raise _bad(f"'{name}' must be an integer, got {v!r:.60}", name)
    v = int(v)
    if lo is not None and v < lo:
        raise _bad(f"'{name}' must be >= {lo}, got {v}", name)
    if hi is not None and v > hi:
        raise _bad(f"'{name}' must be <= {hi}, got {v}", name)
    return v


def _float(body: dict, name: str, default, lo: float, hi: float):
    v = body.get(name, None)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v):
        raise _bad(f"'{name}' must be a number, got {v!r:.60}", name)
    if not lo <= v <= hi:
        raise _bad(f"'{name}' must be in [{lo}, {hi}], got {v}", name)
    return float(v)


def parse_chat_request(body, default_method: str, default_ratio: float, default_decode: str,
                       default_max_tokens: int, decode_policies: set[str]) -> ChatRequest:
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise _bad("'messages' is required: a non-empty list of {role, content} objects", "messages")
    try:
        messages = normalize_messages(msgs)
    except InputError as e:
        raise _bad(str(e), "messages") from None
    question = [m["content"] for m in messages if m["role"] == "user"][-1]

    unknown = sorted(k for k in body if k not in CHAT_PARAMS)
    if unknown:
        raise _bad(f"unsupported parameter {unknown[0]!r:.60}: this server does not implement it (known: "
                   f"{', '.join(sorted(CHAT_PARAMS))})", unknown[0], code="unsupported_parameter")
    for name, ok in (("n", lambda v: v in (None, 1)), ("presence_penalty", lambda v: v in (None, 0)),
                     ("frequency_penalty", lambda v: v in (None, 0)), ("logprobs", lambda v: v in (None, False)),
                     ("top_logprobs", lambda v: v in (None, 0)), ("tools", lambda v: v in (None, [])),
                     ("functions", lambda v: v in (None, [])), ("tool_choice", lambda v: v in (None, "none")),
                     ("function_call", lambda v: v in (None, "none")), ("logit_bias", lambda v: v in (None, {})),
                     ("response_format", lambda v: v in (None, {"type": "text"})),
                     ("parallel_tool_calls", lambda v: v in (None, False, True)),
                     ("store", lambda v: v in (None, False))):
        if not ok(body.get(name)):
            raise _bad(f"'{name}' is not supported by this server (value {body.get(name)!r:.60})", name,
                       code="unsupported_parameter")
    for name in ("user", "metadata"):  # no effect on the output: accepted when well-formed
        if body.get(name) is not None and not isinstance(body[name], (str if name == "user" else dict)):
            raise _bad(f"'{name}' must be a {'string' if name == 'user' else 'object'}", name)
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(x, str) and x for x in stop) or len(stop) > MAX_STOP:
        raise _bad(f"'stop' must be a non-empty string or a list of up to {MAX_STOP} of them", "stop")

    documents = body.get("documents")
    if documents is not None:
        if not isinstance(documents, list) or not all(isinstance(d, str) for d in documents):
            raise _bad("'documents' must be a list of strings (the passages)", "documents")
        if not documents:
            raise _bad("'documents' is empty: pass at least one passage", "documents")
        for i, d in enumerate(documents):
            if not d.strip():
                raise _bad(f"documents[{i}] is empty", "documents")
    collection = body.get("collection")
    if collection is not None and (not isinstance(collection, str) or not collection):
        raise _bad("'collection' must be a collection name (string)", "collection")
    if documents is not None and collection is not None:
        raise _bad("pass either 'documents' or 'collection', not both", "collection")
    top_k = _int(body, "top_k", 4, 1, MAX_TOP_K)

    method = body.get("method", default_method)
    if not isinstance(method, str):
        raise _bad(f"'method' must be a method spec (a string), got {method!r:.60}", "method")
    method_options = body.get("method_options")
    if method_options is not None and not isinstance(method_options, dict):
        raise _bad("'method_options' must be an object", "method_options")
    try:  # the label carries every option: the engine parses it back to the same object
        method = make_selector(method, **(method_options or {})).label
    except InputError as e:
        raise _input_error(e) from None
    if "ratio" in body and "recompute_ratio" in body:
        raise _bad("pass 'ratio' or 'recompute_ratio', not both", "ratio")
    ratio_name = "ratio" if "ratio" in body else "recompute_ratio"
    try:
        ratio = parse_ratio(body.get(ratio_name, default_ratio))
    except InputError as e:
        raise _bad(f"'{ratio_name}': {e}", ratio_name) from None
    guard = body.get("guard")
    if guard not in (None, "full"):
        raise _bad(f"'guard' must be \"full\" or absent, got {guard!r:.60}", "guard")
    auto = body.get("auto")
    if auto is not None:
        try:
            AutoBudget.of(auto)
        except InputError as e:
            raise _bad(f"'auto': {e}", "auto") from None
    decode = body.get("decode", default_decode)
    if not isinstance(decode, str) or decode not in decode_policies:
        raise _bad(f"unknown decode policy {decode!r:.60}; known: {', '.join(sorted(decode_policies))}",
                   "decode", "invalid_decode")
    kv_budget = _int(body, "kv_budget", None, 1)

    if "max_tokens" in body and "max_completion_tokens" in body and \
            body["max_tokens"] != body["max_completion_tokens"]:
        raise _bad("'max_tokens' and 'max_completion_tokens' disagree", "max_tokens")
    mt_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _int(body, mt_name, default_max_tokens, 1)
    min_tokens = _int(body, "min_tokens", 0, 0, max_tokens)  # vLLM's: no EOS before this many tokens
    temperature = _float(body, "temperature", 0.0, 0.0, 2.0)
    top_p = _float(body, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0.0:
        raise _bad("'top_p' must be > 0", "top_p")
    seed = _int(body, "seed", 0)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _bad("'stream' must be a boolean", "stream")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise _bad("'stream_options' must be an object", "stream_options")
    model = body.get("model")
    if documents is None and collection is None:
        method = "full"  # plain chat: nothing to stitch, an ordinary full prefill
    return ChatRequest(question=question, messages=messages, stop=stop, documents=documents, collection=collection,
                       top_k=top_k, method=method,
                       ratio=ratio, decode=decode, kv_budget=kv_budget,
                       max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed, stream=stream,
                       include_usage=bool(opts.get("include_usage", False)),
                       model=model if isinstance(model, str) else None, guard=guard,
                       auto=auto, min_tokens=min_tokens)


def _decode_policies() -> set[str]:
    names = {"full"}
    try:
        from kvstitch.decode import DECODE_POLICIES

        names |= set(DECODE_POLICIES)
    except Exception:  # noqa: BLE001 - the decode package is optional for the server
        pass
    return names


# ---- detokenization for SSE ------------------------------------------------------------------------
def first_stop(text: str, stop: list[str]) -> tuple[int, str] | None:
    """(index, stop string) of the earliest stop string in ``text``, or None."""
    hits = [(text.find(s), s) for s in stop if s in text]
    return min(hits) if hits else None


def partial_stop(text: str, stop: list[str]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of a stop string (held back)."""
    best = 0
    for s in stop:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


class StopScanner:
    """Watches the generated text for stop strings (the engine worker ends the generation at the first)
    and cuts the final text before it."""

    def __init__(self, tokenizer, eos_ids, stop: list[str]):
        self.tok, self.eos, self.stop = tokenizer, set(eos_ids), list(stop)
        self.ids: list[int] = []
        self.hit: str | None = None

    def push(self, token: int) -> bool:
        if token not in self.eos:
            self.ids.append(token)
        if self.hit is None:
            found = first_stop(self.tok.decode(self.ids, skip_special_tokens=True).lstrip(), self.stop)
            self.hit = found[1] if found else None
        return self.hit is not None

    def apply(self, res: GenerationResult) -> GenerationResult:
        if self.hit is None:
            return res
        from dataclasses import replace

        found = first_stop(res.text, self.stop)
        return replace(res, text=res.text[:found[0]] if found else res.text,
                       stats={**res.stats, "stop_sequence": self.hit})


class TextStream:
    """Incremental text of a token stream whose concatenated deltas equal the engine's final text
    (``decode(tokens minus EOS, skip_special_tokens=True).strip()``): leading whitespace is dropped,
    trailing whitespace and incomplete UTF-8 are held back until more text follows. With ``stop``
    strings, nothing from the first stop string on is sent, and a tail that may start one is held back."""

    def __init__(self, tokenizer, eos_ids, stop: list[str] | None = None):
        self.tok, self.eos = tokenizer, set(eos_ids)
        self.stop = list(stop or [])
        self.ids: list[int] = []
        self.sent = ""
        self.stopped = False

    def push(self, token: int) -> str:
        if token in self.eos or self.stopped:
            return ""
        self.ids.append(token)
        text = self.tok.decode(self.ids, skip_special_tokens=True).lstrip()
        safe = text.rstrip("\ufffd").rstrip()
        if self.stop:
            found = first_stop(text, self.stop)
            if found is not None:
                self.stopped = True
                safe = text[:found[0]]
            else:
                visible = text.rstrip("\ufffd")
                safe = safe[:len(visible) - partial_stop(visible, self.stop)]
        if not safe.startswith(self.sent) or len(safe) <= len(self.sent):
            return ""
        delta, self.sent = safe[len(self.sent):], safe
        return delta

    def finish(self, final: str) -> str:
        if final.startswith(self.sent):
            delta, self.sent = final[len(self.sent):], final
            return delta
        return ""  # cannot happen for prefix-stable tokenizers; never resend text


# ---- the app ---------------------------------------------------------------------------------------
_KNOWN_PATHS = ("/v1/chat/completions", "/v1/models", "/v1/collections", "/v1/documents", "/health", "/metrics")


class _StatusCounter:
    """Pure ASGI middleware (BaseHTTPMiddleware would break streaming disconnects): count status codes."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        path = path if path in _KNOWN_PATHS else "other"

        async def send_wrapper(message):
            if message["type"] == "http.response.start":
                self.metrics.inc("kvstitch_http_requests_total", path=path, code=str(message["status"]))
            await send(message)

        return await self.app(scope, receive, send_wrapper)


@dataclass
class _Reply:
    """One chat completion on its way back: the parsed request, its engine job, the OpenAI id and creation
    time, the queue wait and what was retrieved from a collection (None without one)."""

    req: ChatRequest
    job: Job
    retrieved: list[dict] | None
    rid: str
    created_at: int
    wait: float = 0.0


def _usage(res: GenerationResult) -> dict:
    """OpenAI's ``usage``."""
    st = res.stats
    p = int(st.get("prefix_tokens", 0) + st.get("context_tokens", 0) + st.get("suffix_tokens", 0))
    c = len(res.token_ids)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _ext(req: ChatRequest, res: GenerationResult | None, wait: float, retrieved) -> dict:
    """The response's ``kvstitch`` extension."""
    st = res.stats if res is not None else {}
    return {"ttft_s": round(res.ttft_s, 6) if res is not None else None, "queue_wait_s": round(wait, 6),
            "store_hits": st.get("store_hits", 0), "store_misses": st.get("store_misses", 0),
            "recomputed_tokens": st.get("recomputed_tokens", 0), "context_tokens": st.get("context_tokens", 0),
            "method": req.method, "ratio": req.ratio, "decode": req.decode,
            "retrieved": retrieved, "ratio_used": st.get("ratio_used"),
            **{k: st[k] for k in ("rounds", "converged", "signal", "guard", "cold_path") if k in st},
            "timings_s": {k: round(st[k], 6) for k in ("tokenize_s", "chunk_load_s", "assemble_s", "select_s",
                                                        "recompute_s", "tpot_s") if k in st}}


class ChatService:
    """What the server's routes do, over one engine: it owns the engine worker (queue, batching), the
    metrics, the collections and the request defaults. `create_app` wires the HTTP routes to its methods;
    FastAPI appears here only in the responses `chat` returns. Arguments as `create_app`'s."""

    def __init__(self, engine, default_method: str = "prophet", default_ratio: float = 0.2, max_queue: int = 16,
                 collections_dir: str | Path | None = None, default_decode: str = "full",
                 max_tokens: int = DEFAULT_MAX_TOKENS, model_name: str | None = None, warmup: bool = False,
                 disconnect_poll_s: float = 0.1, max_body_bytes: int = 32 << 20, guard_rate: float = 0.0,
                 max_batch: int = 8, kv_pool_bytes: int | None = None, recall_sample: float = 0.0):
        import random

        default_method = check_method(default_method)
        default_ratio = parse_ratio(default_ratio)
        if not 0.0 <= guard_rate <= 1.0:
            raise InputError(f"guard rate must be in [0, 1], got {guard_rate}")
        self.guard_rng = random.Random(0)
        self.policies = _decode_policies()
        if default_decode not in self.policies:
            raise InputError(f"unknown decode policy {default_decode!r}; known: {', '.join(sorted(self.policies))}")
        self.metrics = Metrics()
        if not isinstance(max_batch, int) or max_batch < 1:
            raise InputError(f"max_batch must be a positive integer, got {max_batch!r}")
        self.engine = engine
        self.default_method, self.default_ratio, self.default_decode = default_method, default_ratio, default_decode
        self.max_queue, self.max_batch, self.max_tokens = max_queue, max_batch, max_tokens
        self.max_body_bytes, self.guard_rate, self.disconnect_poll_s = max_body_bytes, guard_rate, disconnect_poll_s
        self.worker = EngineWorker(engine, max_queue, self.metrics, warmup=warmup, max_batch=max_batch,
                                   kv_pool_bytes=kv_pool_bytes, recall_sample=recall_sample)
        self.collections = CollectionCache(collections_dir)
        self.model_id = model_name or getattr(engine, "model_name", None) or "kvstitch"
        self.created = int(time.time())
        # a store outage degrades to computing chunks (store/resilient)
        self.store = engine.store = resilient(engine.store)
        self._register_gauges()
        self.documents = DocumentService(engine, self.worker)  # /v1/documents (serve/documents.py)

    def _register_gauges(self) -> None:
        worker, store, engine = self.worker, self.store, self.engine
        self.metrics.gauges.update({
            "kvstitch_queue_depth": lambda: worker.waiting,
            "kvstitch_busy": lambda: int(worker.busy),
            "kvstitch_active_requests": lambda: len(worker.active),
            "kvstitch_max_batch": self.max_batch,
            "kvstitch_deferred_chunks": lambda: len(getattr(engine, "deferred", ()) or ()),
            "kvstitch_max_queue": self.max_queue,
            "kvstitch_store_up": lambda: int(getattr(store, "up", True)),
            "kvstitch_store_degraded_ops_total": lambda: getattr(store, "degraded_ops", 0),
            "kvstitch_store_outages_total": lambda: getattr(store, "outages", 0)})
        pool, m = worker.pool, self.metrics

        def decoder_bytes(kind: str) -> int:
            return sum(live.decoder.kv_bytes()[kind] for live in list(worker.active) if live.decoder is not None)

        def selected_fraction() -> float:
            sel, ctx = worker.selection
            return sel / ctx if ctx else 0.0

        m.gauges.update({
            "kvstitch_kv_pool_reserved_bytes": lambda: pool.reserved,
            "kvstitch_kv_pool_limit_bytes": pool.limit or 0,
            "kvstitch_kv_pool_occupancy": pool.occupancy,
            "kvstitch_kv_pool_peak_bytes": lambda: pool.peak,
            "kvstitch_kv_pool_waits_total": lambda: pool.waits,
            "kvstitch_kv_offloaded_bytes": lambda: decoder_bytes("host"),
            "kvstitch_kv_device_bytes": lambda: decoder_bytes("device"),
            "kvstitch_decode_selected_fraction": selected_fraction})

    # -- simple endpoints ----------------------------------------------------------------------
    def health(self) -> tuple[dict, int]:
        """GET /health -> (body, status code): 503 when the engine worker is dead."""
        worker, store = self.worker, self.store
        ok = worker.alive
        body = {"status": "ok" if ok else "unavailable", "model": self.model_id, "worker_alive": ok,
                "ready": worker.ready.is_set(), "busy": worker.busy, "queue_depth": worker.waiting,
                "max_queue": self.max_queue, "active": len(worker.active), "max_batch": self.max_batch,
                "store": store.health() if hasattr(store, "health") else {"status": "up", "backend": repr(store)}}
        return body, 200 if ok else 503

    def models(self) -> dict:
        """GET /v1/models: the served model, with methods, defaults and collections as an extension."""
        return {"object": "list", "data": [{
            "id": self.model_id, "object": "model", "created": self.created, "owned_by": "kvstitch",
            "kvstitch": {"methods": registered_methods(), "default_method": self.default_method,
                         "default_ratio": self.default_ratio, "default_decode": self.default_decode,
                         "decode_policies": sorted(self.policies), "collections": self.collections.names(),
                         "max_positions": getattr(getattr(self.engine, "adapter", None), "max_positions", None)}}]}

    def list_collections(self) -> dict:
        """GET /v1/collections."""
        return {"object": "list", "data": [{"id": n, "object": "collection"} for n in self.collections.names()]}

    def metrics_text(self) -> str:
        """GET /metrics: the Prometheus text, with the store's counters when it has them."""
        text = self.metrics.render()
        try:
            s = self.store.stats()
            text += ("# HELP kvstitch_store_entries_loaded_bytes_total bytes of chunk caches loaded from the store\n"
                     "# TYPE kvstitch_store_entries_loaded_bytes_total counter\n"
                     f"kvstitch_store_entries_loaded_bytes_total {int(s.get('bytes_loaded', 0))}\n"
                     "# HELP kvstitch_store_problems entries refused by the store (corrupt/foreign)\n"
                     "# TYPE kvstitch_store_problems gauge\n"
                     f"kvstitch_store_problems {int(s.get('problems', 0))}\n")
        except Exception:  # noqa: BLE001 - a store without stats must not break /metrics
            pass
        return text

    # -- chat completions ----------------------------------------------------------------------
    async def chat(self, request):
        """POST /v1/chat/completions: read and check the request, queue its job, then answer as JSON or as
        server-sent events (``stream``). An input error found by the engine is a 4xx even when streaming."""
        try:
            req, docs, retrieved = await self._read_request(request)
        except ApiError as e:
            self.metrics.inc("kvstitch_chat_requests_total", outcome="invalid")
            return e.response()
        job = Job(self._generate_kwargs(req, docs), asyncio.get_running_loop(), stop=req.stop)
        try:
            self.worker.submit(job)
        except QueueFull as e:
            self.metrics.inc("kvstitch_chat_requests_total", outcome="rejected")
            self.metrics.inc("kvstitch_rejected_total")
            return ApiError(429, f"the server is busy: {self.worker.waiting} requests are already waiting "
                                 f"(max_queue={self.max_queue}); retry after {e.retry_after} s", "rate_limit_error",
                            "queue_full", headers={"Retry-After": str(e.retry_after)}).response()

        reply = _Reply(req, job, retrieved, rid=f"chatcmpl-{uuid.uuid4().hex}", created_at=int(time.time()))
        try:
            kind, value, reply.wait = await self._first_event(job, request)
        except (ClientGone, asyncio.CancelledError) as e:
            return self._disconnected(job, e)
        if kind == "error":
            self.metrics.inc("kvstitch_chat_requests_total", outcome="invalid" if value.status < 500 else "error")
            return value.response()
        if kind == "done":  # cancelled before it started
            self.metrics.inc("kvstitch_chat_requests_total", outcome="cancelled")
            return ApiError(499, "request cancelled", "invalid_request_error", "cancelled").response()
        if req.stream:
            from fastapi.responses import StreamingResponse

            return StreamingResponse(self._sse(reply, kind, value), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await self._json(reply, kind, value, request)

    async def _read_request(self, request) -> tuple[ChatRequest, list[str] | None, list[dict] | None]:
        """The checked request, its passages and what was retrieved for them (a 4xx `ApiError` otherwise)."""
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise ApiError(413, f"request body too large ({declared} bytes > {self.max_body_bytes})",
                           code="body_too_large")
        raw = await request.body()
        if len(raw) > self.max_body_bytes:
            raise ApiError(413, f"request body too large ({len(raw)} bytes > {self.max_body_bytes})",
                           code="body_too_large")
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise _bad(f"the request body is not valid JSON: {e}", code="invalid_json") from None
        body = await resolve_document_ids(self.documents, body)
        req = parse_chat_request(body, self.default_method, self.default_ratio, self.default_decode,
                                 self.max_tokens, self.policies)
        retrieved = None
        docs = req.documents
        if req.collection is not None:
            docs, retrieved = await self.retrieve(req)
        return req, docs, retrieved

    def _generate_kwargs(self, req: ChatRequest, docs: list[str] | None) -> dict:
        """`Engine.stream` arguments; ``guard_rate`` of the greedy stitched requests are checked (guard)."""
        guard = req.guard or ("full" if req.temperature == 0 and self.guard_rate > 0 and req.method != "full"
                              and self.guard_rng.random() < self.guard_rate else None)
        return dict(messages=req.messages, chunks=docs, method=req.method, recompute_ratio=req.ratio,
                    max_new_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p, seed=req.seed,
                    decode=req.decode, kv_budget=req.kv_budget,
                    auto=req.auto, guard=guard, min_new_tokens=req.min_tokens)

    async def retrieve(self, req: ChatRequest) -> tuple[list[str], list[dict]]:
        """The top-k passages of ``req.collection`` for the last user message, and their descriptions."""
        from starlette.concurrency import run_in_threadpool

        try:
            col = await run_in_threadpool(self.collections.get, req.collection)
        except CollectionNotFound as e:
            raise ApiError(404, str(e), code="collection_not_found", param="collection") from None
        except InputError as e:
            raise ApiError(400, str(e), code="invalid_collection", param="collection") from None
        except KVStitchError as e:
            raise ApiError(500, str(e), "server_error", "collection_unreadable") from None
        hits = await run_in_threadpool(col.search, req.question, req.top_k)
        if not hits:
            raise ApiError(400, f"collection {req.collection!r} is empty", code="empty_collection",
                           param="collection")
        return [h.text for h in hits], [h.as_dict() for h in hits]

    async def next_event(self, job: Job, request):
        """The job's next event; while waiting, a disconnected client cancels the job (JSON path)."""
        while True:
            if request is not None and time.monotonic() - job.checked_at >= self.disconnect_poll_s:
                job.checked_at = time.monotonic()  # by time, not by idleness: tokens may arrive continuously
                if await request.is_disconnected():
                    job.cancel()
                    raise ClientGone()
            try:
                return await asyncio.wait_for(job.events.get(), timeout=self.disconnect_poll_s)
            except asyncio.TimeoutError:
                continue

    async def _first_event(self, job: Job, request) -> tuple[str, Any, float]:
        """(kind, value, queue wait) of the job's first event after it started."""
        wait = 0.0
        while True:
            kind, value = await self.next_event(job, request)
            if kind == "started":
                wait = value
                continue
            return kind, value, wait

    def _disconnected(self, job: Job, e: BaseException):
        """The client went away: cancel the job; a 499 (or the task's own cancellation, re-raised)."""
        job.cancel()
        self.metrics.inc("kvstitch_chat_requests_total", outcome="cancelled")
        if isinstance(e, asyncio.CancelledError):
            raise e
        return ApiError(499, "client disconnected", "invalid_request_error", "cancelled").response()

    async def _json(self, reply: _Reply, kind: str, value, request):
        """Collect the job's events to its result: one chat.completion object."""
        from fastapi.responses import JSONResponse

        req, job = reply.req, reply.job
        result, error = None, None
        try:
            while kind != "done":
                if kind == "result":
                    result = value
                elif kind == "error":
                    error = value
                kind, value = await self.next_event(job, request)
        except (ClientGone, asyncio.CancelledError) as e:
            return self._disconnected(job, e)
        if error is not None or result is None:
            error = error or ApiError(500, "generation ended without a result", "server_error", "internal_error")
            self.metrics.inc("kvstitch_chat_requests_total", outcome="invalid" if error.status < 500 else "error")
            return error.response()
        self._record(req, result)
        return JSONResponse({
            "id": reply.rid, "object": "chat.completion", "created": reply.created_at, "model": self.model_id,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": result.text},
                         "logprobs": None, "finish_reason": self._finish_reason(req, result)}],
            "usage": _usage(result), "kvstitch": _ext(req, result, reply.wait, reply.retrieved)})

    def _chunk(self, reply: _Reply, delta: dict, finish=None, **extra) -> str:
        obj = {"id": reply.rid, "object": "chat.completion.chunk", "created": reply.created_at,
               "model": self.model_id,
               "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}], **extra}
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    async def _sse(self, reply: _Reply, kind: str, value):
        """The job's events as chat.completion.chunk server-sent events, ``data: [DONE]`` last."""
        req, job = reply.req, reply.job
        text = TextStream(self.engine.tokenizer, self.engine.eos_ids, req.stop)
        finished = False
        try:
            yield self._chunk(reply, {"role": "assistant", "content": ""})
            while True:
                if kind == "token":
                    delta = text.push(value)
                    if delta:
                        yield self._chunk(reply, {"content": delta})
                elif kind == "result":
                    tail = text.finish(value.text)
                    if tail:
                        yield self._chunk(reply, {"content": tail})
                    self._record(req, value)
                    finished = True
                    yield self._chunk(reply, {}, self._finish_reason(req, value),
                                      kvstitch=_ext(req, value, reply.wait, reply.retrieved))
                    if req.include_usage:
                        obj = {"id": reply.rid, "object": "chat.completion.chunk", "created": reply.created_at,
                               "model": self.model_id, "choices": [], "usage": _usage(value)}
                        yield f"data: {json.dumps(obj)}\n\n"
                elif kind == "error":
                    finished = True
                    self.metrics.inc("kvstitch_chat_requests_total",
                                     outcome="invalid" if value.status < 500 else "error")
                    yield f"data: {json.dumps(value.body())}\n\n"
                elif kind == "done":
                    break
                kind, value = await self.next_event(job, None)  # disconnects cancel this task (see below)
            yield "data: [DONE]\n\n"
        finally:
            # reached on normal end, and on client disconnect (Starlette cancels the response task, or the
            # generator is closed): stop the engine at its next step
            if not finished:
                job.cancel()
                self.metrics.inc("kvstitch_chat_requests_total", outcome="cancelled")

    def _finish_reason(self, req: ChatRequest, res: GenerationResult) -> str:
        if res.stats.get("stop_sequence") is not None:
            return "stop"
        if res.token_ids and res.token_ids[-1] in self.engine.eos_ids:
            return "stop"
        return "length" if len(res.token_ids) >= req.max_tokens else "stop"

    def _record(self, req: ChatRequest, res: GenerationResult) -> None:
        """An answered request in the metrics."""
        metrics, st = self.metrics, res.stats
        metrics.inc("kvstitch_chat_requests_total", outcome="ok")
        metrics.inc("kvstitch_chat_method_total", method=req.method)
        metrics.observe("kvstitch_ttft_seconds", res.ttft_s)
        u = _usage(res)
        metrics.inc("kvstitch_prompt_tokens_total", u["prompt_tokens"])
        metrics.inc("kvstitch_completion_tokens_total", u["completion_tokens"])
        metrics.inc("kvstitch_store_hits_total", st.get("store_hits", 0))
        metrics.inc("kvstitch_store_misses_total", st.get("store_misses", 0))
        ctx, rec = st.get("context_tokens", 0), st.get("recomputed_tokens", 0)
        metrics.inc("kvstitch_recomputed_tokens_total", rec)
        metrics.inc("kvstitch_context_tokens_total", ctx)
        if ctx:
            metrics.observe("kvstitch_recompute_ratio", rec / ctx)
        if "converged" in st:  # ratio="auto"
            metrics.inc("kvstitch_auto_requests_total", outcome="converged" if st["converged"] else
                        ("full_prefill" if st.get("ratio_used", 0) >= 1.0 else "ceiling"))
        if "guard" in st:
            metrics.inc("kvstitch_guard_checks_total")
            metrics.inc("kvstitch_guard_disagreements_total", 0 if st["guard"]["agreed"] else 1)


def _install_error_handlers(app) -> None:
    """Every error as OpenAI's error JSON: `ApiError`s, HTTP errors (404, 405) and anything unexpected (500)."""
    from fastapi import Request
    from starlette.exceptions import HTTPException as StarletteHTTPException

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        kind = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        msg = f"{request.method} {request.url.path}: {exc.detail}"
        return ApiError(exc.status_code, msg, "invalid_request_error", kind).response()

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        return ApiError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error",
                        "internal_error").response()


def create_app(engine, default_method: str = "prophet", default_ratio: float = 0.2, max_queue: int = 16,
               collections_dir: str | Path | None = None, default_decode: str = "full",
               max_tokens: int = DEFAULT_MAX_TOKENS, model_name: str | None = None, warmup: bool = False,
               disconnect_poll_s: float = 0.1, max_body_bytes: int = 32 << 20,
               guard_rate: float = 0.0, security: "SecurityConfig | None" = None, max_batch: int = 8,
               kv_pool_bytes: int | None = None, recall_sample: float = 0.0) -> "FastAPI":
    """The FastAPI app serving `engine`. `collections_dir`: where `kvstitch index` put collections (None:
    requests naming a collection get 404). The engine worker starts with the app (lifespan).
    ``guard_rate``: the fraction of greedy requests checked against full prefill (``guard="full"``, chosen
    at random); /metrics counts the checks and the disagreements, so the rate of stitched answers that
    differ from full prefill is measured on live traffic. ``max_batch``: requests served at once (their recompute
    passes and decode steps share forward passes; 1 = one request at a time; sparse decode policies batch too).
    ``kv_pool_bytes``: the K/V budget of the requests in flight (a request waits until its prompt + max_tokens
    fit; None = no limit). ``recall_sample``: the share of sparse decode passes whose attention recall is
    measured for /metrics. The routes' logic is `ChatService`'s."""
    from contextlib import asynccontextmanager

    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, PlainTextResponse

    service = ChatService(engine, default_method, default_ratio, max_queue, collections_dir, default_decode,
                          max_tokens, model_name, warmup, disconnect_poll_s, max_body_bytes, guard_rate, max_batch,
                          kv_pool_bytes, recall_sample)
    worker = service.worker

    @asynccontextmanager
    async def lifespan(app):
        worker.start()
        try:
            yield
        finally:
            await asyncio.get_running_loop().run_in_executor(None, worker.stop)

    app = FastAPI(title="kvstitch", version="0.1.0", lifespan=lifespan)
    app.state.service = service
    app.state.worker, app.state.metrics, app.state.engine, app.state.collections = \
        worker, service.metrics, engine, service.collections
    install_security(app, security, getattr(engine, "tokenizer", None))  # auth, limits, CORS (serve/security.py)
    app.add_middleware(_StatusCounter, metrics=service.metrics)
    app.include_router(documents_router(service.documents))  # /v1/documents (serve/documents.py)
    _install_error_handlers(app)

    @app.get("/health")
    async def health():
        body, status = service.health()
        return JSONResponse(body, status_code=status)

    @app.get("/v1/models")
    async def models():
        return service.models()

    @app.get("/v1/collections")
    async def list_cols():
        return service.list_collections()

    @app.get("/metrics")
    async def prom():
        return PlainTextResponse(service.metrics_text(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await service.chat(request)

    return app


# ---- running it ------------------------------------------------------------------------------------
class ServerThread:
    """Run an app with uvicorn in a background thread on a loopback port (tests, notebooks).

        with ServerThread(app) as srv:
            httpx.get(f"{srv.url}/health")
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        import uvicorn

        self.host = host
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.port = self._sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, lifespan="on",
                                                    timeout_graceful_shutdown=5, backlog=512))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._sock]},
                                       name="kvstitch-uvicorn", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> "ServerThread":
        self.thread.start()
        t0 = time.monotonic()
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() - t0 > timeout:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 15.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        try:
            self._sock.close()
        except OSError:
            pass

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
