"""The chat service: what the server's routes do, over one engine. It turns a validated body into the
engine's request, queued on the worker, and the job's events into OpenAI's chat.completion JSON or server-sent events,
and answers the simple endpoints (/health, /v1/models, /v1/collections, /metrics)."""

from __future__ import annotations

import asyncio
import json
import random
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvstitch.core.errors import InputError, KVStitchError
from kvstitch.corpus.retrieval import CollectionCache, CollectionNotFound
from kvstitch.engine import GenerationResult
from kvstitch.select import methods as registered_methods
from kvstitch.store.resilient import resilient
from kvstitch.engine.request import DEFAULT_METHOD
from .jobs import ApiError, ClientGone, Job, QueueFull
from .documents import DocumentService, resolve_document_ids
from .prometheus import Metrics
from .defaults import DEFAULT_MAX_TOKENS, ChatDefaults, decode_policies
from .security import UNPARSED
from .stops import TextStream
from .worker import EngineWorker

if TYPE_CHECKING:  # the body model imports pydantic (the 'serve' extra): imported when the server starts
    from .schema import ChatBody


@dataclass
class _Reply:
    """One chat completion on its way back: the validated body, its engine job, the OpenAI id and creation
    time, the queue wait and what was retrieved from a collection (None without one)."""

    req: ChatBody
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


def _ext(req: ChatBody, res: GenerationResult | None, wait: float, retrieved) -> dict:
    """The response's ``kvstitch`` extension."""
    st = res.stats if res is not None else {}
    return {"ttft_s": round(res.ttft_s, 6) if res is not None else None, "queue_wait_s": round(wait, 6),
            "store_hits": st.get("store_hits", 0), "store_misses": st.get("store_misses", 0),
            "chunk_sources": st.get("chunk_sources"),
            "recomputed_tokens": st.get("recomputed_tokens", 0), "context_tokens": st.get("context_tokens", 0),
            "method": req.method.label, "ratio": req.ratio, "decode": req.decode.spec,
            "retrieved": retrieved, "ratio_used": st.get("ratio_used"),
            **{k: st[k] for k in ("rounds", "converged", "signal", "guard", "cold_path") if k in st},
            "timings_s": {k: round(st[k], 6) for k in ("tokenize_s", "chunk_load_s", "assemble_s", "select_s",
                                                        "recompute_s", "tpot_s") if k in st}}


class ChatService:
    """What the server's routes do, over one engine: it owns the engine worker (queue, batching), the
    metrics, the collections and the request defaults. `create_app` wires the HTTP routes to its methods;
    FastAPI appears here only in the responses `chat` returns. Arguments as `create_app`'s."""

    def __init__(self, engine, default_method: str = DEFAULT_METHOD, default_ratio: float | str = 0.2, max_queue: int = 16,
                 collections_dir: str | Path | None = None, default_decode: str = "dense",
                 max_tokens: int = DEFAULT_MAX_TOKENS, model_name: str | None = None, warmup: bool = False,
                 disconnect_poll_s: float = 0.1, guard_rate: float = 0.0,
                 max_batch: int = 8, kv_pool_bytes: int | None = None, recall_sample: float = 0.0,
                 tenants=None):
        # a name, alias or spec -> its canonical spec, checked once: what a request leaves out
        self.defaults = ChatDefaults.of(default_method, default_ratio, default_decode, max_tokens, decode_policies())
        if self.defaults.auto is not None:  # an auto spec as the default ratio: its options are the engine's default
            engine.default_auto = self.defaults.auto
        if not 0.0 <= guard_rate <= 1.0:
            raise InputError(f"guard rate must be in [0, 1], got {guard_rate}")
        self.guard_rng = random.Random(0)
        self.metrics = Metrics()
        if not isinstance(max_batch, int) or max_batch < 1:
            raise InputError(f"max_batch must be a positive integer, got {max_batch!r}")
        self.engine = engine
        self.max_queue, self.max_batch = max_queue, max_batch
        self.guard_rate, self.disconnect_poll_s = guard_rate, disconnect_poll_s
        self.worker = EngineWorker(engine, max_queue, self.metrics, warmup=warmup, max_batch=max_batch,
                                   kv_pool_bytes=kv_pool_bytes, recall_sample=recall_sample)
        self.collections = CollectionCache(collections_dir)
        self.model_id = model_name or getattr(engine, "model_name", None) or "kvstitch"
        self.created = int(time.time())
        # a store outage degrades to computing chunks (store/resilient)
        self.store = engine.store = resilient(engine.store)
        self.tenants, self.tenant_metrics = tenants, {}
        if tenants is not None:
            self._install_tenants(tenants)
        self._register_gauges()
        self.documents = DocumentService(engine, self.worker)  # /v1/documents (serve/documents.py)

    def _install_tenants(self, tenants) -> None:
        """Each request reads and writes its tenant's namespace (`kvstitch.serve.tenants`); the store records the
        tenants so `kvstitch store stats` can name them."""
        from kvstitch.store.tenants import TenantRouter
        from .tenants import TenantDeferred

        self.engine.store = TenantRouter(self.store, tenants.shared)
        self.engine.deferred = TenantDeferred()
        for name, rec in tenants.records().items():
            try:
                if self.store.meta_get("tenants", name) != rec:
                    self.store.meta_put("tenants", name, rec)
            except (KVStitchError, NotImplementedError, OSError):  # best effort: stats then show tags
                pass

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
            "kvstitch": {"methods": registered_methods(), "default_method": self.defaults.method,
                         "default_ratio": self.defaults.ratio, "default_decode": self.defaults.decode,
                         "decode_policies": sorted(self.defaults.policies), "collections": self.collections.names(),
                         "max_positions": getattr(getattr(self.engine, "adapter", None), "max_positions", None)}}]}

    def list_collections(self) -> dict:
        """GET /v1/collections."""
        return {"object": "list", "data": [{"id": n, "object": "collection"} for n in self.collections.names()]}

    def metrics_text(self, tenant: str | None = None) -> str:
        """GET /metrics: the Prometheus text, with the store's counters when it has them. With tenants, the
        request series are the calling tenant's own (`kvstitch.serve.tenants`)."""
        text = self.metrics.render()
        if self.tenants is not None:
            from .tenants import HIDDEN_SERIES, TENANT_SERIES, filter_series

            own = filter_series(self._metrics_for(tenant).render(), TENANT_SERIES, keep=True)
            return filter_series(text, TENANT_SERIES + HIDDEN_SERIES, keep=False) + own
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
        job = Job(req.generation(docs, self._guard(req)), asyncio.get_running_loop(), stop=req.stop,
                  tenant=getattr(request.state, "tenant", None))
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

    async def _read_request(self, request) -> tuple[ChatBody, list[str] | None, list[dict] | None]:
        """The validated body, its passages and what was retrieved for them (a 4xx `ApiError` otherwise). The
        front door (`kvstitch.serve.security`) limited the body and parsed it when it is JSON."""
        body = getattr(request.state, "json_body", UNPARSED)
        if body is UNPARSED:
            try:
                body = json.loads(await request.body())
            except (ValueError, UnicodeDecodeError) as e:
                raise ApiError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
        body = await resolve_document_ids(self.documents, body, getattr(request.state, "tenant", None))
        from .schema import parse_chat_body

        req = parse_chat_body(body, self.defaults)
        retrieved = None
        docs = req.documents
        if req.collection is not None:
            docs, retrieved = await self.retrieve(req)
        return req, docs, retrieved

    def _guard(self, req: ChatBody) -> str | None:
        """The request's ``guard``; else ``guard_rate`` of the greedy stitched requests are checked too."""
        return req.guard or ("full" if req.temperature == 0 and self.guard_rate > 0 and req.method.label != "full"
                             and self.guard_rng.random() < self.guard_rate else None)

    async def retrieve(self, req: ChatBody) -> tuple[list[str], list[dict]]:
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
        self._record(req, result, job.tenant)
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
                    self._record(req, value, job.tenant)
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

    def _finish_reason(self, req: ChatBody, res: GenerationResult) -> str:
        if res.stats.get("stop_sequence") is not None:
            return "stop"
        if res.token_ids and res.token_ids[-1] in self.engine.eos_ids:
            return "stop"
        return "length" if len(res.token_ids) >= req.max_tokens else "stop"

    def _metrics_for(self, tenant: str | None) -> Metrics:
        """Where a request's own series go: the tenant's registry with tenants, else the server's."""
        if self.tenants is None:
            return self.metrics
        m = self.tenant_metrics.get(tenant)
        if m is None:
            m = self.tenant_metrics[tenant] = Metrics()
        return m

    def _record(self, req: ChatBody, res: GenerationResult, tenant: str | None = None) -> None:
        """An answered request in the metrics."""
        self.metrics.inc("kvstitch_chat_requests_total", outcome="ok")
        metrics, st = self._metrics_for(tenant), res.stats
        metrics.inc("kvstitch_chat_method_total", method=req.method.label)
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
