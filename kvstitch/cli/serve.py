"""`kvstitch serve`: the command that loads a model and runs the OpenAI-compatible server (`kvstitch.serve.server`).

One configuration: flags > ``KVSTITCH_*`` environment variables > a TOML file (``--config``; the file is
read by `kvstitch.serve.config`). Mounted by `kvstitch.cli.main` with ``auto_envvar_prefix="KVSTITCH"``.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Optional

import typer

from kvstitch.serve import server
from kvstitch.core.errors import InputError, KVStitchDeprecationWarning
from kvstitch.corpus.retrieval import collections_root
from kvstitch.serve.config import SECRET, read_config
from kvstitch.serve.defaults import ChatDefaults
from kvstitch.serve.security import SecurityConfig
from kvstitch.engine.request import DEFAULT_METHOD

from .options import DECODE_DEFAULT, CollectionsDir, Dtype, Model, ServeDecode, StitchAdapterOpt, Store


# ---- --config and the effective configuration ---------------------------------------------------------
def config_callback(ctx: typer.Context, param: typer.CallbackParam, value):
    """Eager ``--config``: the file's values become the defaults of the other options (under env and flags)."""
    if value:
        known = {p.name for p in ctx.command.params if p.name not in ("config",)}
        try:
            values = read_config(value, known)
        except InputError as e:  # raised while parsing: a usage error (exit 2), not a traceback
            raise typer.BadParameter(str(e), ctx=ctx, param=param) from None
        ctx.default_map = {**(ctx.default_map or {}), **values}
    return value


def describe(ctx: typer.Context) -> list[tuple[str, str, str]]:
    """``(option, value, source)`` for every serve option (source: flag, env, file or default)."""
    names = {"COMMANDLINE": "flag", "ENVIRONMENT": "env", "DEFAULT_MAP": "file", "DEFAULT": "default"}
    rows = []
    for p in ctx.command.params:
        if p.name in ("install_completion", "show_completion", "help") or getattr(p, "hidden", False):
            continue
        v = ctx.params.get(p.name)
        if p.name == "tenants" and v and str(v).lstrip().startswith("{"):
            v = "<table>"  # it names API keys
        if p.name in SECRET and v:
            n = sum(len([k for k in str(x).split(",") if k.strip()]) for x in v)
            v = f"<{n} key{'s' if n != 1 else ''}>"
        src = ctx.get_parameter_source(p.name)
        rows.append((p.name, str(v), names.get(getattr(src, "name", ""), "default")))
    return rows


def print_config(ctx: typer.Context, console) -> None:
    """The effective serve configuration, once, at start."""
    rows = describe(ctx)
    console.print("configuration (flag > env KVSTITCH_* > file > default): "
                  + ", ".join(f"{n}={v} ({s})" for n, v, s in rows), highlight=False, soft_wrap=True)


# ---- the command -----------------------------------------------------------------------------------------
def serve_command(
    ctx: typer.Context,
    model: Model = None, store: Store = None, dtype: Dtype = None,
    method: str = typer.Option(DEFAULT_METHOD, "--method", help="default selection method (per-request: 'method')"),
    ratio: str = typer.Option("auto", "--ratio", help="default recompute ratio, 'auto' or an auto spec such as "
                                                      "'auto(tol=0.05)' (per-request: 'ratio')"),
    auto: Optional[str] = typer.Option(None, "--auto", help="default options of ratio 'auto', an auto spec: "
                                                            "'auto(schedule=[0.05,0.1],tol=0.02)' or 'tol=0.02' (a "
                                                            "config's [auto] table; per-request: an auto spec ratio)"),
    guard_rate: float = typer.Option(0.0, "--guard-rate", help="fraction of greedy requests verified against full "
                                                               "prefill (disagreements in /metrics)"),
    decode: ServeDecode = DECODE_DEFAULT,
    host: str = typer.Option("127.0.0.1", "--host", help="interface to bind"),
    port: int = typer.Option(8000, "--port", help="port to bind"),
    max_queue: int = typer.Option(16, "--max-queue", help="waiting requests past which clients get 429"),
    max_batch: int = typer.Option(8, "--max-batch", help="requests served at once (their recompute passes and "
                                                         "decode steps batched; 1 = serial)"),
    kv_pool_bytes: Optional[str] = typer.Option(None, "--kv-pool-bytes",
                                                help="K/V memory of the requests in flight, e.g. 2GiB: a request "
                                                     "waits until its prompt + max_tokens fit (default: no limit)"),
    recall_sample: float = typer.Option(0.01, "--recall-sample",
                                        help="share of sparse decode passes whose attention recall is measured "
                                             "(/metrics kvstitch_decode_recall; 0 = never)"),
    cold_path: str = typer.Option("auto", "--cold-path", help="requests whose chunks are not stored: auto (full prefill "
                                                              "when most miss, chunks computed while idle), "
                                                              "full_prefill or stitched"),
    max_tokens: int = typer.Option(server.DEFAULT_MAX_TOKENS, "--max-tokens", help="default max_tokens"),
    collections_dir: CollectionsDir = None,
    log_level: str = typer.Option("info", "--log-level", help="uvicorn log level"),
    api_key: Optional[list[str]] = typer.Option(
        None, "--api-key", help="require 'Authorization: Bearer KEY' (repeatable; default: $KVSTITCH_API_KEY, "
                                "comma-separated)"),
    insecure: bool = typer.Option(False, "--insecure", help="allow a non-loopback --host without an API key"),
    tenants: Optional[str] = typer.Option(None, "--tenants",
                                          help="partition the store by API key: 'per-key', or a TOML file of "
                                               "[tenants.NAME] tables (keys, shared), or JSON; a config's "
                                               "[tenants] tables (see docs/usage.md)"),
    cors_origin: Optional[list[str]] = typer.Option(None, "--cors-origin",
                                                    help="allow browser requests from this origin (repeatable; "
                                                         "CORS is off by default)"),
    max_body: str = typer.Option("32MiB", "--max-body", help="request body limit (413 above it)"),
    max_documents: int = typer.Option(256, "--max-documents", help="passages per request (413 above it)"),
    max_request_tokens: Optional[int] = typer.Option(None, "--max-request-tokens",
                                                     help="passage tokens per request (413 above it)"),
    max_bytes: Optional[str] = typer.Option(None, "--max-bytes",
                                            help="store budget: unpinned chunk caches are evicted above it (the "
                                                 "memory tier: S3-FIFO, a reused set survives a scan of one-off "
                                                 "chunks; directory and Redis stores: least recently used)"),
    stitch_adapter: StitchAdapterOpt = "auto",
    replicas: Optional[int] = typer.Option(None, "--replicas", help="run N model replicas on Ray Serve behind one "
                                                                   "endpoint, routed by chunk affinity (needs the "
                                                                   "'ray' extra; default: one process)"),
    ray_address: Optional[str] = typer.Option(None, "--ray-address", help="with --replicas: the Ray cluster to join "
                                                                          "('auto', host:port; default: a new local "
                                                                          "Ray unless $RAY_ADDRESS)"),
    config: Optional[Path] = typer.Option(None, "--config", is_eager=True, callback=config_callback,
                                          help="a TOML file of serve options (flags > KVSTITCH_* env > file)"),
) -> None:
    """Serve the OpenAI-compatible API (POST /v1/chat/completions, GET /v1/models, /health, /metrics)."""
    from rich.console import Console

    from kvstitch.core.extras import require

    for module in ("fastapi", "uvicorn", "prometheus_client"):  # before the (slow) model load
        require(module, "serve", "kvstitch serve")
    import uvicorn

    from kvstitch.engine.cold import DEFAULT_COLD_THRESHOLD, check_cold_path
    from kvstitch.models.stitch_adapter import resolve_adapter
    from .store import parse_size

    console = Console(stderr=True)
    print_config(ctx, console)  # the effective configuration, once
    # the request defaults, checked before the (slow) model load; an auto spec ratio carries its options
    defaults = ChatDefaults.of(method, ratio, decode, max_tokens, auto=parse_auto_option(auto))
    method, ratio, decode, auto_options = defaults.method, defaults.ratio, defaults.decode, defaults.auto
    check_cold_path(cold_path, DEFAULT_COLD_THRESHOLD)
    if max_queue < 0:
        raise InputError(f"--max-queue must be >= 0, got {max_queue}")
    security = _security(host, api_key, insecure, max_body, max_documents, max_request_tokens, cors_origin,
                         tenants)
    pool_bytes = parse_size(kv_pool_bytes) if kv_pool_bytes is not None else None
    if not 0.0 <= recall_sample <= 1.0:
        raise InputError(f"--recall-sample must be in [0, 1], got {recall_sample}")
    adapter = resolve_adapter(stitch_adapter, model)  # a bad file fails before the model loads
    if replicas is not None:  # N replicas on Ray Serve behind one endpoint (kvstitch/serve/replicas.py)
        opts = dict(default_method=method, default_ratio=ratio, max_queue=max_queue, default_decode=decode,
                    max_tokens=max_tokens, model_name=_model_id(model), warmup=True, guard_rate=guard_rate,
                    max_body_bytes=security.max_body_bytes, security=security, max_batch=max_batch,
                    kv_pool_bytes=pool_bytes, recall_sample=recall_sample,
                    collections_dir=collections_root(store, collections_dir))
        return _serve_replicas(console, replicas, ray_address, host, port, opts, model, store, max_bytes, cold_path,
                               dtype, auto_options, adapter)
    with console.status(f"loading {model or 'the embedded model (SmolLM2-135M-Instruct)'} ..."):
        eng = _load_engine(model, store, max_bytes, cold_path, dtype, auto_options, adapter)
    root = collections_root(store if store is not None else eng.store, collections_dir)
    app = server.create_app(eng, default_method=method, default_ratio=ratio, max_queue=max_queue,
                            collections_dir=root, default_decode=decode, max_tokens=max_tokens,
                            model_name=_model_id(model), warmup=True, max_body_bytes=security.max_body_bytes,
                            security=security, guard_rate=guard_rate, max_batch=max_batch,
                            kv_pool_bytes=pool_bytes, recall_sample=recall_sample)
    console.print(f"kvstitch serving {_model_id(model)} on http://{host}:{port} (method {method}, ratio {ratio}, "
                  f"store {eng.store!r}, collections {root}; "
                  f"{'API key required' if security.api_keys else 'no API key'}"
                  f"{', CORS ' + ','.join(security.cors_origins) if security.cors_origins else ''})", highlight=False)
    uvicorn.run(app, host=host, port=port, log_level=log_level)


def _serve_replicas(console, replicas: int, ray_address: Optional[str], host: str, port: int, opts: dict,
                    model, store, *engine_args) -> None:
    """``--replicas``: checked (and the ray extra required) before anything starts; each replica loads its own
    engine (`_load_engine`) over the shared store behind a memory tier of its own."""
    from kvstitch.serve import replicas as ray_replicas
    from kvstitch.serve.replica import replica_store

    ray_replicas.check_replicas(replicas)
    ray_replicas.require_serve()
    load = functools.partial(_load_engine, model, replica_store(store), *engine_args)
    console.print(f"kvstitch serving {_model_id(model)} on http://{host}:{port} with {replicas} replicas on Ray Serve "
                  f"(chunk-affinity routing, store {store or 'memory, one per replica'})", highlight=False)
    ray_replicas.serve_replicas(load, opts, replicas, host=host, port=port, ray_address=ray_address)


def _security(host: str, api_key: Optional[list[str]], insecure: bool, max_body: str, max_documents: int,
              max_request_tokens: Optional[int], cors_origin: Optional[list[str]],
              tenants: Optional[str] = None) -> SecurityConfig:
    """The request limits and API keys, refused before the (slow) model load when ``--host`` would expose the
    server without a key."""
    from kvstitch.serve.security import api_keys_from, check_bind
    from .store import parse_size

    security = SecurityConfig(api_keys=api_keys_from(api_key), insecure=insecure, max_body_bytes=parse_size(max_body),
                              max_documents=max_documents, max_request_tokens=max_request_tokens,
                              cors_origins=tuple(cors_origin or ()), tenants=tenants)
    check_bind(host, security)
    return security


def _load_engine(model: Optional[str], store: Optional[str], max_bytes: Optional[str], cold_path: str,
                 dtype: Optional[str], auto_options, stitch_adapter=None):
    """The engine behind the server: its store within ``--max-bytes`` (when given), ratio 'auto' defaulting to
    ``--auto``, and stored chunks converted to the model's dtype when loaded."""
    from kvstitch.engine import Engine
    from .store import parse_size

    store_obj = store
    if max_bytes is not None:
        from kvstitch.store import open_store

        budget = parse_size(max_bytes)
        store_obj = open_store(store, max_bytes=budget, memory_bytes=budget)
    eng = Engine.load(model, store=store_obj, cold_path=cold_path, dtype=dtype, stitch_adapter=stitch_adapter)
    eng.default_auto = auto_options
    if eng.store.compute_dtype is None:
        eng.store.compute_dtype = eng.dtype
    return eng


def parse_auto_option(text: str | None):
    """``--auto`` (an auto spec: ``auto(tol=0.05)``, ``tol=0.05``) -> `AutoBudget`, None when not given; bad
    options: their typed InputError. JSON options (``{"tol": 0.05}``) are still read, with a deprecation note."""
    if not text:
        return None
    from kvstitch.engine.budget import AutoBudget
    from kvstitch.serve.config import auto_spec

    try:
        if text.lstrip().startswith("{"):
            return AutoBudget.of(_deprecated_json(text))
        return AutoBudget.of(auto_spec(text))
    except InputError as e:
        raise type(e)(f"--auto: {e}") from None


def _deprecated_json(text: str) -> dict:
    """``--auto`` as JSON (what it took before auto specs): read, with a note on stderr and a warning."""
    import json
    import warnings

    note = "--auto as JSON is deprecated: pass an auto spec, e.g. --auto 'auto(tol=0.05)'"
    warnings.warn(note, KVStitchDeprecationWarning, stacklevel=3)
    typer.echo(f"note: {note}", err=True)
    try:
        return json.loads(text)
    except ValueError as e:
        raise InputError(f"not JSON: {e}") from None


def _model_id(model: str | None) -> str:
    if model is None:
        return "smollm2"
    return Path(model).name or str(model)
