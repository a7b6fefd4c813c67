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
    collection: str, top_k: int ... or retrieve the top-k units (chunks, or blocks) of a collection (`kvstitch index`)
    method, ratio (or recompute_ratio), decode, kv_budget: per-request overrides; ``method`` is a spec string
                                ("deltaprop(base=infoflow,alpha_k=0.5)", see `kvstitch methods`); the older
                                ``method_options`` object is merged into it; ``decode`` a policy spec
                                ("dense", "prkv(static_ratio=0.5)", "prkv:kv_budget=512"); ``ratio`` a
                                number, "auto" or an auto spec ("auto(tol=0.05)"; ``auto``: its options)
The whole conversation is the prompt: the model's chat template over every message (system/developer,
user, assistant, tool results as text), the passages appended to the system message - after the system
prompt, before the conversation (`PromptBuilder.build_messages`). The system prompt is a stitched segment
with its own store key (cached like a chunk); history and the last user turn are recomputed and are what
query-driven selectors read. Retrieval from a collection searches with the last user message. Without
``documents`` and ``collection`` the request is plain chat: an ordinary full prefill (method "full").
``temperature`` defaults to 0 (greedy, as `Engine.generate`), ``seed`` to 0 (honoured when sampling).
``stop`` (a string or up to 4) cuts the text before the first stop string, with finish_reason "stop"
(streaming holds back text that may start a stop string). Every other parameter is a 400 naming it unless
a field of `ChatBody`: ``n`` > 1, non-zero ``presence_penalty`` / ``frequency_penalty``, ``logprobs``,
``tools``, ``logit_bias``, a non-text ``response_format`` and unknown fields are refused, never ignored.

The response carries OpenAI's ``usage`` plus ``kvstitch: {ttft_s, queue_wait_s, store_hits, store_misses,
recomputed_tokens, context_tokens, method, ratio, decode, retrieved}`` (in the last SSE chunk when
streaming). Errors use OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``.

Concurrency: the model is not thread-safe, so one worker thread owns the engine (`kvstitch.serve.worker`). It serves up to
``max_batch`` jobs at once (continuous batching, `EngineWorker`): each round admits the queued jobs there is
room for, prepares each (load, stitch, select) and runs their recompute passes as one packed forward
(`Engine.recompute_batch`), then the jobs join the batch, whose dense decode steps run as one forward per token
(`Engine.decode_batch`; each request attends over its own cache, so its answer is the one it gets alone);
jobs whose decoding cannot batch (sparse decode, APE/A3 decode plans, guard="full") take one model step
per round. Between steps the worker checks each job's cancelled flag, which is set when the client
disconnects (SSE: the response task is cancelled; JSON: ``request.is_disconnected()`` is polled while
waiting). Behind a full batch at most ``max_queue`` jobs wait; more are refused with 429 and a
``Retry-After`` estimated from recent service times. /metrics reports the batch sizes.

The parts: `schema` (the body, validated once into the engine's request), `chat` (`ChatService`: request -> engine job -> response),
`worker` (`EngineWorker`, the batching scheduler), `admission` (the K/V byte budget of the requests in
flight), `stops` (stop strings, streamed text), `prometheus` (/metrics), `documents`, `security`, `config`;
this module wires them into the FastAPI app, and `testing` runs one in a background thread.
"""

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # fastapi is imported by create_app: `kvstitch` commands other than serve stay light
    from fastapi import FastAPI

from kvstitch.engine.request import DEFAULT_METHOD

from .chat import ChatService
from .jobs import ApiError, Job, QueueFull
from .documents import documents_router
from .defaults import DEFAULT_MAX_TOKENS, ChatDefaults
from .prometheus import Metrics, StatusCounter
from .security import SecurityConfig, install_security
from .stops import StopScanner, TextStream
from .testing import ServerThread
from .worker import EngineWorker

# the server's parts, importable from here as well as from their own modules
__all__ = ["create_app", "ChatService", "ChatDefaults", "DEFAULT_MAX_TOKENS", "EngineWorker", "Metrics", "StopScanner",
           "TextStream", "ServerThread", "ApiError", "Job", "QueueFull"]


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


def create_app(engine, default_method: str = DEFAULT_METHOD, default_ratio: float | str = 0.2, max_queue: int = 16,
               collections_dir: str | Path | None = None, default_decode: str = "dense",
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
    measured for /metrics. ``max_body_bytes``: the body limit of a server without ``security`` (which carries
    its own). The routes' logic is `ChatService`'s."""
    from contextlib import asynccontextmanager

    from kvstitch.core.extras import require

    for module in ("fastapi", "prometheus_client"):
        require(module, "serve", "the kvstitch server")
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, PlainTextResponse

    service = ChatService(engine, default_method, default_ratio, max_queue, collections_dir, default_decode,
                          max_tokens, model_name, warmup, disconnect_poll_s, guard_rate, max_batch,
                          kv_pool_bytes, recall_sample, tenants=getattr(security, "tenancy", None))
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
    if security is None:  # the body limit (and the one JSON parse) still happen at the front door
        security = SecurityConfig(max_body_bytes=max_body_bytes, max_documents=None)
    install_security(app, security, getattr(engine, "tokenizer", None))  # auth, limits, CORS (serve/security.py)
    app.add_middleware(StatusCounter, metrics=service.metrics)
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
    async def prom(request: Request):
        return PlainTextResponse(service.metrics_text(getattr(request.state, "tenant", None)), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await service.chat(request)

    return app

