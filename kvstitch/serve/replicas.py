"""`kvstitch serve --replicas N`: N model replicas on Ray Serve behind one OpenAI-compatible endpoint.

    ray start --head                      # or nothing: a local Ray is started
    kvstitch serve --replicas 4 --store redis://redis-host:6379/0 --host 0.0.0.0 --port 8000

Two deployments. The ingress (one, no model) receives every HTTP request from Serve's proxy, reads the body
(413 above ``max_body_bytes``), keys a chat request by its inline passages (`kvstitch.route.live`) and
forwards the request through a deployment handle whose request router is chunk affinity
(`kvstitch.serve.ray_router`). Each model replica (`kvstitch.serve.replica.ModelReplica`) runs the single
server's app in process, so auth, limits, batching, streaming and the documents API are the single server's.

Faults: a request is retried on another replica when its replica dies before answering (a JSON answer is sent
whole, so it is retried until it is complete; a stream until its first token); a stream cut after its first
token ends with an SSE error event (``code: "replica_lost"``). With no replica left, or none accepting within
``accept_timeout_s``, the answer is 503 with ``Retry-After``. Serve replaces a dead replica; the router adds
it back with an empty view, filled by its digests.
`/health` and `/metrics` aggregate the replicas' last reports: every metric gets a ``replica`` label.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
from typing import Callable

from kvstitch.core.errors import InputError
from kvstitch.route.live import request_chunks

from .replica import CHAT_PATH, ModelReplica

MODEL_DEPLOYMENT = "kvstitch-model"
ROUTER_CLASS = "kvstitch.serve.ray_router:ChunkAffinityRequestRouter"
DEFAULT_ROUTER_CLASS = "ray.serve._private.request_router:PowerOfTwoChoicesRequestRouter"  # Serve's default
REPLICA_HEADER = "x-kvstitch-replica"  # which replica answered (the router's choice, observable)
ATTEMPTS_HEADER = "x-kvstitch-attempts"  # replicas tried (more than 1: one was lost)
_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


class NoReplica(Exception):
    pass


def _error(status: int, message: str, code: str, headers: dict | None = None):
    from .jobs import ApiError

    return ApiError(status, message, "server_error" if status >= 500 else "invalid_request_error", code,
                    headers=headers).response()


def label_metrics(texts: dict[str, str]) -> str:
    """Prometheus texts of several replicas as one: each sample labelled ``replica="name"``, each family's
    HELP/TYPE once with all its samples after it (the format wants a family's samples together)."""
    order, meta, samples = [], {}, {}
    for name, text in sorted(texts.items()):
        family = None
        for line in text.splitlines():
            if line.startswith("# HELP ") or line.startswith("# TYPE "):
                family = line.split()[2]
                if family not in meta:
                    order.append(family)
                    meta[family], samples[family] = [], []
                if line not in meta[family]:
                    meta[family].append(line)
                continue
            m = _NAME.match(line)
            if not m or line.startswith("#"):
                continue
            fam = family if family is not None and m.group().startswith(family) else m.group()
            if fam not in meta:
                order.append(fam)
                meta[fam], samples[fam] = [], []
            rest = line[m.end():]
            label = f'replica="{name}"'
            samples[fam].append(m.group() + ("{" + label + "," + rest[1:] if rest.startswith("{")
                                             else "{" + label + "}" + rest))
    return "".join("\n".join(meta[f] + samples[f]) + "\n" for f in order)


class Ingress:
    """The one HTTP entry: forwards each request to a model replica chosen by chunk affinity (module docstring)."""

    def __init__(self, model, max_body_bytes: int = 32 << 20, accept_timeout_s: float = 30.0,
                 retry_after_s: int = 5, attempts: int = 3, deployment: str = MODEL_DEPLOYMENT) -> None:
        self.model = model
        self.max_body_bytes, self.accept_timeout_s = max_body_bytes, accept_timeout_s
        self.retry_after_s, self.attempts, self.deployment = retry_after_s, max(1, attempts), deployment

    async def __call__(self, request):
        from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse

        path = request.url.path
        if path == "/health" and request.method == "GET":
            body, status = await self.health()
            return JSONResponse(body, status_code=status)
        body = await request.body()
        if len(body) > self.max_body_bytes:
            return _error(413, f"request body too large ({len(body)} bytes > {self.max_body_bytes})",
                          "body_too_large")
        route = self._route(request.method, path, body)
        try:
            replica, attempt, status, headers, stream = await self._dispatch(request, body, route)
        except NoReplica as e:
            return _error(503, f"no model replica is available ({e}); retry after {self.retry_after_s} s",
                          "no_replica", headers={"Retry-After": str(self.retry_after_s)})
        headers[REPLICA_HEADER], headers[ATTEMPTS_HEADER] = replica, str(attempt + 1)
        text = await self.metrics() if path == "/metrics" and status == 200 else None
        if text is not None:  # the caller passed the replica's auth: every replica's metrics
            await _drain(stream)
            return PlainTextResponse(text, headers=headers, media_type="text/plain; version=0.0.4; charset=utf-8")
        return StreamingResponse(stream, status_code=status, headers=headers)

    @staticmethod
    def _route(method: str, path: str, body: bytes) -> tuple:
        if method != "POST" or path != CHAT_PATH:
            return ()
        try:
            return request_chunks(json.loads(body).get("documents"))
        except (ValueError, AttributeError):  # the replica answers the 400
            return ()

    async def _dispatch(self, request, body: bytes, route: tuple):
        """(replica, attempt, status, headers, body stream) of the first replica that answers; else `NoReplica`."""
        import ray

        lost = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)
        client = (request.client.host, request.client.port) if request.client else None
        args = (request.method, request.url.path, request.url.query.encode(), list(request.headers.raw), body,
                client)
        why = "none is running"
        for attempt in range(self.attempts):
            if self._live() == 0:
                break
            gen = self.model.options(stream=True).forward.remote(*args, route=route)
            try:
                head = await asyncio.wait_for(gen.__anext__(), self.accept_timeout_s)
                _, status, headers = await gen.__anext__()
                headers = {k: v for k, v in headers if k.lower() != "content-length"}
                if "text/event-stream" not in headers.get("content-type", ""):
                    whole = [chunk async for chunk in gen]  # retried until complete
                    return head["replica"], attempt, status, headers, _replay(whole)
                return head["replica"], attempt, status, headers, self._stream(gen)
            except lost as e:
                why = f"replica lost: {type(e).__name__}"
                gen.cancel()
                await asyncio.sleep(min(2.0, 0.25 * 2 ** attempt))
            except (asyncio.TimeoutError, StopAsyncIteration):
                gen.cancel()
                why = f"none accepted the request within {self.accept_timeout_s:g} s"
                break
            except asyncio.CancelledError:  # the client went away: so does the replica's work
                gen.cancel()
                raise
        raise NoReplica(why)

    def _live(self) -> int | None:
        from .ray_router import reports

        got = reports(self.deployment)
        return None if got is None else len(got)

    async def _stream(self, gen):
        """A streamed answer's remaining chunks; a replica lost mid-stream ends it with an SSE error event."""
        import ray

        finished = False
        try:
            async for chunk in gen:
                yield chunk
            finished = True
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
            finished = True
            err = {"error": {"message": "the model replica serving this stream was lost; retry the request",
                             "type": "server_error", "param": None, "code": "replica_lost"}}
            yield f"data: {json.dumps(err)}\n\ndata: [DONE]\n\n".encode()
        finally:
            if not finished:  # the client disconnected: the replica cancels the job
                gen.cancel()

    async def health(self) -> tuple[dict, int]:
        """The replicas' last reported health; 503 when none is live and healthy."""
        got = await self._reports()
        replicas = {name: {**rep.get("health", {"status": "starting"}), "held_passages": rep.get("held_passages", 0)}
                    for name, rep in (got or {}).items()}
        ok = sum(1 for h in replicas.values() if h.get("status") == "ok")
        body = {"status": "ok" if ok else "unavailable", "replicas": len(replicas), "healthy": ok,
                "by_replica": replicas}
        return body, 200 if ok else 503

    async def metrics(self) -> str | None:
        """Every replica's last metrics, labelled; None with tenants (each caller sees its own tenant's series,
        which only the answering replica can filter: its answer is passed on)."""
        got = await self._reports() or {}
        if any(rep.get("tenants") for rep in got.values()):
            return None
        text = label_metrics({name: rep["metrics"] for name, rep in got.items() if rep.get("metrics")})
        return (text + "# HELP kvstitch_replicas model replicas live\n# TYPE kvstitch_replicas gauge\n"
                f"kvstitch_replicas {len(got)}\n")

    async def _reports(self) -> dict | None:
        from .ray_router import reports

        got = reports(self.deployment)
        if got is None:  # no request went through the handle yet: its router is made on first use
            try:
                await asyncio.wait_for(self.model.ping.remote(), 10.0)
            except Exception:  # noqa: BLE001 - no replica answered: reported as such
                pass
            got = reports(self.deployment)
        return got


async def _replay(chunks: list):
    for c in chunks:
        yield c


async def _drain(gen) -> None:
    async for _ in gen:
        pass


def build_app(load_engine: Callable, app_options: dict, replicas: int, replica_cpus: float = 1.0,
              stats_period_s: float = 1.0, accept_timeout_s: float = 30.0, router_options: dict | None = None,
              router_class: str = ROUTER_CLASS):
    """The Ray Serve application: the ingress bound to `replicas` model replicas (`ModelReplica`).
    `router_class`: another request router (`DEFAULT_ROUTER_CLASS`: Serve's own, what `bench replicas` compares);
    `router_options` go to chunk affinity only."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    check_replicas(replicas)
    # room for a full batch and queue: past it the replica's own 429 (with Retry-After) answers
    ongoing = int(app_options.get("max_batch", 8)) + int(app_options.get("max_queue", 16)) + 1
    kwargs = {"replicas": replicas, **(router_options or {})} if router_class == ROUTER_CLASS else {}
    router = RequestRouterConfig(request_router_class=router_class, request_router_kwargs=kwargs,
                                 request_routing_stats_period_s=stats_period_s,
                                 request_routing_stats_timeout_s=max(10.0, 5 * stats_period_s))
    model = serve.deployment(ModelReplica, name=MODEL_DEPLOYMENT, num_replicas=replicas,
                             max_ongoing_requests=ongoing, ray_actor_options={"num_cpus": replica_cpus},
                             request_router_config=router, health_check_period_s=5.0)
    ingress = serve.deployment(Ingress, name="kvstitch", num_replicas=1, max_ongoing_requests=10_000,
                               ray_actor_options={"num_cpus": 0})
    return ingress.bind(model.bind(load_engine, app_options, max(1, int(replica_cpus))),
                        max_body_bytes=int(app_options.get("max_body_bytes", 32 << 20)),
                        accept_timeout_s=accept_timeout_s, attempts=replicas + 1)


def check_replicas(replicas) -> int:
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise InputError(f"--replicas must be a positive integer, got {replicas!r} (leave it out for one process)")
    return replicas


def require_serve():
    """Ray Serve, or the ``ray`` extra's one-line error."""
    from kvstitch.core.extras import require

    require("ray", "ray", "kvstitch serve --replicas")
    return require("ray.serve", "ray", "kvstitch serve --replicas")


def serve_replicas(load_engine: Callable, app_options: dict, replicas: int, host: str = "127.0.0.1",
                   port: int = 8000, ray_address: str | None = None, blocking: bool = True, **kw):
    """Start (or join) Ray, then run the application on Serve's HTTP proxy at ``host:port``."""
    check_replicas(replicas)
    serve = require_serve()
    import ray

    if not ray.is_initialized():
        ray.init(address=ray_address, include_dashboard=False) if ray_address else ray.init(include_dashboard=False)
    serve.start(http_options={"host": host, "port": port})
    app = build_app(load_engine, app_options, replicas, **kw)
    if not blocking:
        return serve.run(app, name="kvstitch", route_prefix="/")
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        serve.run(app, name="kvstitch", route_prefix="/", blocking=True)
    except KeyboardInterrupt:  # Serve apps outlive their driver on a cluster joined with `ray start`
        serve.delete("kvstitch")


def _interrupt(signum, frame):
    raise KeyboardInterrupt
