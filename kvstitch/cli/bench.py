"""`kvstitch bench ...`: the benchmarks (`kvstitch.bench`), each writing its results as JSON and a markdown table."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

from .common import console, csv_ints, err_console, friendly_errors, load_engine, set_threads
from .options import (DECODE_DEFAULT, RESULTS_DIR, DecodeBudgets, DecodePolicies, DecodeSweep, Dtype, KvBudget, Model,
                      PageSize, PolicyOption, ResultsDir, StitchAdapterOpt, Store, Threads)

bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks (results as JSON + a markdown table).")


@bench_app.command("ttft")
@friendly_errors
def bench_ttft_cmd(lengths: str = typer.Option("2048,4096,8192", help="context lengths in tokens"),
                   methods: str = typer.Option("random", help="comma-separated methods (full is always run)"),
                   ratio: float = typer.Option(0.2), repeats: int = typer.Option(3),
                   chunk_tokens: int = typer.Option(256),
                   cold: bool = typer.Option(True, help="also time the first method with a cold and a half-warm "
                                                        "store (the engine's cold path)"),
                   cold_path: str = typer.Option("auto", help="cold-path policy: auto, full_prefill or stitched "
                                                              "(kvstitch.engine.cold)"),
                   threads: Threads = None, dtype: Dtype = None, out: ResultsDir = RESULTS_DIR,
                   model: Model = None, store: Store = None, stitch_adapter: StitchAdapterOpt = None) -> None:
    """Full-prefill TTFT vs stitched TTFT (warm and cold chunk store), ratios measured in one run, with
    the stage breakdown (attention kernel vs MLP, the selection's causal work and its bound)."""
    import torch

    from kvstitch.bench.ttft import bench_ttft, ttft_table, write_results

    from kvstitch.engine.cold import check_cold_path

    from kvstitch.select import split_specs

    check_cold_path(cold_path, 0.5)
    set_threads(threads)
    eng = load_engine(model, store, dtype, stitch_adapter)
    eng.cold_path = cold_path
    rows = bench_ttft(eng, csv_ints(lengths), split_specs(methods), ratio, repeats, chunk_tokens, cold=cold)
    table = ttft_table(rows)
    write_results(rows, out, "bench_ttft", table, {"model": eng.adapter.describe(), "device": str(eng.device),
                                                   "dtype": str(eng.dtype), "store": repr(eng.store),
                                                   "threads": torch.get_num_threads()})
    console.print(table, highlight=False)
    console.print(f"written: {out / 'bench_ttft.json'}, {out / 'bench_ttft.md'}")


@bench_app.command("serve")
@friendly_errors
def bench_serve_cmd(concurrency: str = typer.Option("1,4,16", help="comma-separated client concurrencies"),
                    requests: int = typer.Option(32, help="requests in the fixed mix"),
                    docs: int = typer.Option(8, help="documents in the shared set"),
                    doc_tokens: int = typer.Option(256, help="tokens per document"),
                    docs_per_request: int = typer.Option(4, help="documents per request"),
                    max_tokens: int = typer.Option(32, help="max_tokens (every other request half of it)"),
                    methods: str = typer.Option("prophet,random", help="methods the requests cycle through"),
                    ratio: float = typer.Option(0.2), max_batch: int = typer.Option(16, help="the server's max_batch"),
                    serial: bool = typer.Option(True, help="also run the serial server (max_batch=1) at the "
                                                           "highest concurrency (dense decode)"),
                    decode: DecodeSweep = DECODE_DEFAULT,
                    context: Optional[int] = typer.Option(None, help="long-context mode: every request has documents "
                                                                     "of its own, about this many tokens, and wants "
                                                                     "max_tokens of answer"),
                    kv_budget: KvBudget = None,
                    kv_pool_bytes: Optional[str] = typer.Option(None, help="the server's KV pool limit, e.g. 2GiB"),
                    recall_sample: float = typer.Option(0.05, help="share of sparse decode passes whose recall is measured "
                                                                   "(those passes also attend densely: keep it small)"),
                    threads: Threads = None, dtype: Dtype = None, out: ResultsDir = RESULTS_DIR,
                    model: Model = None, store: Store = None, stitch_adapter: StitchAdapterOpt = None) -> None:
    """Load test of a real server on loopback: requests/s, tokens/s, TTFT and TPOT p50/p95, 429 rate, answers vs
    alone; with --decode, sparse decode policies against dense, recall and memory."""
    import torch

    from kvstitch.bench.ttft import write_results
    from kvstitch.bench.serve import bench_serve, serve_table
    from kvstitch.core.extras import require
    from kvstitch.select import split_specs
    from .store import parse_size

    for module in ("fastapi", "uvicorn", "prometheus_client", "httpx"):  # before the (slow) model load
        require(module, "serve", "kvstitch bench serve")
    set_threads(threads)
    pool_bytes = parse_size(kv_pool_bytes) if kv_pool_bytes is not None else None
    policies = tuple(split_specs(decode))
    eng = load_engine(model, store, dtype, stitch_adapter)
    rows = bench_serve(eng, csv_ints(concurrency), requests, docs, doc_tokens, docs_per_request, max_tokens,
                       tuple(split_specs(methods)), ratio, max_batch, serial=serial, log=console.print, decode=policies,
                       context=context, kv_budget=kv_budget, kv_pool_bytes=pool_bytes, recall_sample=recall_sample)
    table = serve_table(rows)
    write_results(rows, out, "bench_serve", table, {"model": eng.adapter.describe(), "device": str(eng.device),
                                                    "store": repr(eng.store), "requests": requests, "docs": docs,
                                                    "doc_tokens": doc_tokens, "docs_per_request": docs_per_request,
                                                    "max_tokens": max_tokens, "methods": methods, "ratio": ratio,
                                                    "max_batch": max_batch, "decode": list(policies),
                                                    "context": context, "kv_budget": kv_budget,
                                                    "kv_pool_bytes": pool_bytes, "recall_sample": recall_sample,
                                                    "threads": torch.get_num_threads(), "dtype": str(eng.dtype)})
    console.print(table, highlight=False)
    console.print(f"written: {out / 'bench_serve.json'}, {out / 'bench_serve.md'}")


def _scalar(text: str):
    """A command-line value: int, float, true/false, none, else the string."""
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    if low == "none":
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _policy_options(specs: list[str]) -> dict[str, dict]:
    """``["prkv.static_ratio=0.5", ...]`` -> ``{"prkv": {"static_ratio": 0.5}}``."""
    from kvstitch.core.errors import InputError

    out: dict[str, dict] = {}
    for spec in specs:
        key, eq, value = spec.partition("=")
        policy, dot, name = key.strip().partition(".")
        if not (eq and dot and policy and name):
            raise InputError(f"--policy-option takes POLICY.FIELD=VALUE (e.g. prkv.static_ratio=0.5), got {spec!r}")
        out.setdefault(policy, {})[name] = _scalar(value.strip())
    return out


@bench_app.command("decode")
@friendly_errors
def bench_decode_cmd(context: int = typer.Option(8192, help="context tokens (capped at the model's positions "
                                                           "- 256, and reported)"),
                     budget: DecodeBudgets = "256,512,1024",
                     policies: DecodePolicies = "prkv,quest,snapkv,arkvale,shadowkv",
                     niah: int = typer.Option(5, help="NIAH samples scored per (policy, budget); 0 = none"),
                     niah_task: str = typer.Option("niah_multikey", help="RULER task of the samples"),
                     new_tokens: int = typer.Option(160, help="decode steps for recall / TPOT (> the refresh "
                                                             "period T = 128); NIAH answer cap"),
                     method: str = typer.Option("full", help="prefill method (full or a stitched method)"),
                     ratio: float = typer.Option(0.2, help="recompute ratio of a stitched prefill method"),
                     page_size: PageSize = None, policy_option: PolicyOption = None,
                     warmup: int = typer.Option(2, help="decode steps left out of the TPOT medians"),
                     batch: int = typer.Option(1, help="requests per timed decode step: copies of the sample decoded "
                                                       "as one batch, as a server runs them (1: one request)"),
                     chunk_tokens: int = typer.Option(256), seed: int = typer.Option(0),
                     threads: Threads = None, dtype: Dtype = None, out: ResultsDir = RESULTS_DIR,
                     model: Model = None, stitch_adapter: StitchAdapterOpt = None) -> None:
    """Sparse decode on a real model: attention recall, TPOT vs dense and NIAH accuracy per policy and budget."""
    from kvstitch.bench.ttft import write_results
    from kvstitch.bench.decode import bench_decode_model
    from kvstitch.bench.decode_table import decode_table
    from kvstitch.core.errors import InputError
    from kvstitch.select import split_specs

    set_threads(threads)
    try:
        budgets, names = csv_ints(budget), split_specs(policies)
    except ValueError:
        raise InputError(f"--budget takes comma-separated integers, got {budget!r}") from None
    options = _policy_options(policy_option or [])
    eng = load_engine(model, dtype=dtype, stitch_adapter=stitch_adapter)
    cap = eng.adapter.max_positions - 256
    if context > cap:
        err_console.print(f"[yellow]note:[/] --context {context} is more than this model takes; running at "
                          f"{cap} context tokens (its {eng.adapter.max_positions} positions - 256)", highlight=False)
    rows, meta = bench_decode_model(eng, context, budgets, names, niah, new_tokens, method=method,
                                    recompute_ratio=ratio, task=niah_task, chunk_tokens=chunk_tokens, seed=seed,
                                    warmup=warmup, page_size=page_size, policy_options=options, batch=batch)
    meta["model_name"] = model or "smollm2"
    table = decode_table(rows, meta)
    write_results(rows, out, "bench_decode", table, meta)
    console.print(table, highlight=False, soft_wrap=True)
    console.print(f"written: {out / 'bench_decode.json'}, {out / 'bench_decode.md'}")


@bench_app.command("precompute")
@friendly_errors
def bench_precompute_cmd(ray_workers: str = typer.Option("0,1,2", "--ray-workers",
                                                         help="comma-separated worker counts; 0 = single process"),
                         docs: int = typer.Option(16, help="synthetic documents"),
                         words: int = typer.Option(1500, help="words per document"),
                         chunk_tokens: int = typer.Option(256), batch_size: int = typer.Option(8),
                         threads: int = typer.Option(1, help="torch threads per process / Ray worker"),
                         ray_address: Optional[str] = typer.Option(None, "--ray-address"),
                         out: ResultsDir = RESULTS_DIR, model: Model = None) -> None:
    """Precompute throughput (tokens/s): single process vs 1, 2, ... Ray workers on the same folder."""
    from kvstitch.bench.ttft import write_results
    from kvstitch.bench.precompute import bench_precompute, precompute_table
    from kvstitch.core.errors import InputError

    try:
        counts = csv_ints(ray_workers)
    except ValueError:
        raise InputError(f"--ray-workers takes comma-separated integers, got {ray_workers!r}") from None
    if not counts or min(counts) < 0:
        raise InputError("--ray-workers needs worker counts >= 0 (0 = single process)")
    rows = bench_precompute(model, counts, docs, words, chunk_tokens, batch_size, threads, ray_address)
    table = precompute_table(rows)
    write_results(rows, out, "bench_precompute", table, {"model": model or "smollm2", "docs": docs, "words": words,
                                                         "chunk_tokens": chunk_tokens, "batch_size": batch_size,
                                                         "threads_per_worker": threads})
    console.print(table, highlight=False)
    console.print(f"written: {out / 'bench_precompute.json'}, {out / 'bench_precompute.md'}")


@bench_app.command("store")
@friendly_errors
def bench_store_cmd(path: Path = typer.Option(Path("/tmp/kvstitch-bench-store"), help="disk store directory"),
                    redis: Optional[str] = typer.Option(None, help="redis://host:port/db to include"),
                    out: ResultsDir = RESULTS_DIR) -> None:
    """Store load throughput (GB/s, warm and cold page cache) and bytes/token per storage dtype."""
    from kvstitch.bench.ttft import write_results
    from kvstitch.bench.store import bench_store, format_rows

    specs = ["memory", str(path)] + ([redis] if redis else [])
    rows = bench_store(specs)
    console.print(format_rows(rows))
    cols = list(rows[0])
    table = "\n".join(["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)] +
                      ["| " + " | ".join(f"{r[c]:.3g}" if isinstance(r[c], float) else str(r[c]) for c in cols) + " |"
                       for r in rows])
    write_results(rows, out, "bench_store", table)


@bench_app.command("route")
@friendly_errors
def bench_route_cmd(replicas: str = typer.Option("8,64,256", help="comma-separated replica counts (2-256)"),
                    tier_tokens: int = typer.Option(65_536, help="memory tier per replica, tokens"),
                    requests_per_replica: int = typer.Option(400),
                    lam: float = typer.Option(0.5, help="chunk affinity: a queued request's weight"),
                    model: str = typer.Option("qwen2.5-0.5b", help="K/V size and costs: qwen2.5-0.5b or smollm2"),
                    variations: bool = typer.Option(True, help="also vary one knob at a time"),
                    results: Path = typer.Option(RESULTS_DIR, help="where bench_store.json and bench_ttft are"),
                    out: ResultsDir = RESULTS_DIR / "routing") -> None:
    """Simulated routing over N replicas: chunk affinity vs round-robin, power-of-two, prefix affinity and one
    ideal shared memory (scripts/route_sim.py has every option)."""
    import shlex
    import sys

    from kvstitch.core.errors import InputError
    from kvstitch.route.costs import MODEL_SHAPES
    from kvstitch.route.report import simulate_and_write, sweep_of

    if model not in MODEL_SHAPES:
        raise InputError(f"--model: one of {', '.join(sorted(MODEL_SHAPES))}, got {model!r}")
    try:
        sweep = sweep_of(csv_ints(replicas), tier_tokens, requests_per_replica=requests_per_replica, lam=lam,
                         variations=variations)
    except ValueError as e:
        raise InputError(f"--replicas: {e}") from None
    simulate_and_write(sweep, model, results, out, "kvstitch " + shlex.join(sys.argv[1:]), log=console.print)


@bench_app.command("replicas")
@friendly_errors
def bench_replicas_cmd(requests: int = typer.Option(80, help="requests in the trace"),
                       docs: int = typer.Option(16, help="documents (SQuAD articles) in the pool, Zipf-popular"),
                       passages_per_request: int = typer.Option(3, help="passages per request"),
                       passages_per_doc: int = typer.Option(6, help="passages (~100-200 tokens) per document"),
                       zipf: float = typer.Option(1.0, help="Zipf exponent of the documents' popularity"),
                       mix: float = typer.Option(0.2, help="share of a request's passages drawn from other documents"),
                       seed: int = typer.Option(0),
                       replicas: int = typer.Option(2, help="model replicas"),
                       max_tokens: int = typer.Option(16, help="max_tokens of every request"),
                       concurrency: int = typer.Option(1, help="clients sending the trace at once"),
                       interval: float = typer.Option(0.0, help="seconds a client waits between its requests"),
                       deadline: float = typer.Option(1800.0, help="seconds per router: requests not started by then "
                                                                   "are left out (and reported)"),
                       threads: int = typer.Option(1, "--threads", help="torch threads per replica"),
                       dtype: Dtype = None, out: ResultsDir = RESULTS_DIR / "replicas", model: Model = None,
                       ideal_only: bool = typer.Option(False, "--ideal-only", help="add the ideal's hit rate (one "
                                                       "shared memory) to a finished run in --out, run nothing "
                                                       "on Ray")) -> None:
    """Live routing on a local Ray Serve: chunk affinity vs Serve's default router over replicas whose memory
    tiers each hold a third of the trace's working set (local hit rate, TTFT, load spread, answers vs one server),
    beside one shared memory of the same total size (the ideal, replayed without a model)."""
    from kvstitch.bench.replica_trace import replicas_table
    from kvstitch.bench.replicas import bench_replicas
    from kvstitch.bench.ttft import write_results
    from kvstitch.core.errors import InputError
    from kvstitch.serve.replicas import check_replicas, require_serve

    if threads < 1 or requests < 1 or concurrency < 1:
        raise InputError("--threads, --requests and --concurrency must be >= 1")
    if not 0.0 <= mix <= 1.0:
        raise InputError(f"--mix must be in [0, 1], got {mix}")
    if ideal_only:
        from kvstitch.bench.replicas import add_ideal

        name = f"bench_replicas_{(model or 'smollm2').replace('/', '_')}"
        path = out / (name + ".json")
        if not path.is_file():
            raise InputError(f"--ideal-only: no finished run at {path}")
        got = add_ideal(path)
        got["meta"]["ideal_command"] = "kvstitch " + " ".join(sys.argv[1:])  # the run's own command stays
        table = replicas_table(got["rows"], got["meta"])
        path.write_text(json.dumps(got, indent=1))
        path.with_suffix(".md").write_text(table + "\n")
        console.print(table, highlight=False, soft_wrap=True)
        return
    check_replicas(replicas)
    require_serve()  # before the (slow) model load
    rows, meta = bench_replicas(model, dtype, requests, docs, passages_per_request, zipf, seed, threads, replicas,
                                passages_per_doc, max_tokens, concurrency, interval, deadline, mix=mix,
                                log=console.print)
    name = f"bench_replicas_{meta['model'].replace('/', '_')}"
    table = replicas_table(rows, meta)
    write_results(rows, out, name, table, meta)
    console.print(table, highlight=False, soft_wrap=True)
    console.print(f"written: {out / (name + '.json')}, {out / (name + '.md')}")
