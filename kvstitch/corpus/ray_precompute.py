"""Distributed precompute on Ray: `kvstitch precompute DOCS --store redis://... --ray [--ray-address ADDR]`.

The driver chunks the folder with the model's tokenizer (no model in the driver), asks one worker for the
chunk keys, skips what the shared store already holds, and cuts the rest into batches exactly as a
single-process precompute would (distinct chunks in first-occurrence order, ``batch_size`` per batch),
so the entries are byte-identical to a single-process run. Each Ray actor loads the model once and runs
`kvstitch.engine.precompute.ensure_chunks` on the batches it is given, writing straight into the shared store
(Redis, or a directory on a shared filesystem); results travel back as small reports, never as tensors.

A batch that fails (the store unreachable, say) is retried with exponential backoff, and after
``max_attempts`` the job fails with the batch's error: never a hang (every store call has a timeout).
Fault tolerance: actors restart (``max_restarts``) and their in-flight task is retried
(``max_task_retries``); the driver also re-queues a batch whose task failed for good, on another worker.
A retried batch skips the chunks its dead predecessor already stored (`ensure_chunks` checks presence),
so a killed worker loses at most its in-flight batch and every chunk is written once.
Progress (chunks/s, tokens/s, ETA) is aggregated in the driver.

Ray is an optional extra: ``pip install 'kvstitch[ray]'``.
"""

from __future__ import annotations

import os
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch

from kvstitch.core.errors import InputError, KVStitchError
from kvstitch.core.extras import require
from kvstitch.text.chunking import DOCUMENT_CHUNK_TOKENS, chunk_directory


def require_ray():
    return require("ray", "ray", "precompute --ray")


def _is_shared_store(store: str) -> bool:
    s = str(store).strip()
    return bool(s) and s != "memory" and not s.startswith("tiered:")


class PrecomputeWorker:
    """One model per Ray actor; wrapped with ``ray.remote`` by `RayPrecompute`."""

    def __init__(self, model: str | None, store: str, storage_dtype: str, threads: int, device: str | None,
                 stitch_adapter: str | None = "auto"):
        torch.set_num_threads(max(1, threads))
        from kvstitch.engine import Engine

        self.engine = Engine.load(model, store=store, storage_dtype=storage_dtype, device=device,
                                  stitch_adapter=stitch_adapter)
        self.batches = 0

    def info(self) -> dict:
        return {"pid": os.getpid(), "fingerprint": self.engine.fingerprint, "tokenizer": self.engine.tokenizer_id,
                "device": str(self.engine.device)}

    def keys(self, chunks: list[list[int]]) -> list[list[str]]:
        """Every store key of each chunk: one per canonical prefix (question and chat layouts)."""
        prefixes = self.engine.builder.canonical_prefixes()
        return [[self.engine.chunk_key(p, torch.tensor(c, dtype=torch.long)) for p in prefixes] for c in chunks]

    def run(self, batch_id: int, chunks: list[list[int]], batch_size: int) -> dict:
        from kvstitch.engine.precompute import ensure_chunks

        t0 = time.perf_counter()
        res = ensure_chunks(self.engine, [torch.tensor(c, dtype=torch.long) for c in chunks], batch_size=batch_size)
        self.batches += 1
        return {"batch": batch_id, "pid": os.getpid(), "computed": res.computed, "skipped": res.already_stored,
                "tokens": res.tokens, "seconds": time.perf_counter() - t0, "keys": res.computed_keys}


@dataclass
class RayReport:
    chunks: int = 0
    distinct: int = 0
    computed: int = 0
    skipped: int = 0
    tokens: int = 0
    seconds: float = 0.0
    workers: int = 0
    batches: int = 0
    retried_batches: int = 0
    setup_s: float = 0.0
    per_worker: dict = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def _record(rep: RayReport, res: dict) -> None:
    """A finished batch's counts, in total and for its worker."""
    rep.computed += res["computed"]
    rep.tokens += res["tokens"]
    w = rep.per_worker.setdefault(res["pid"], {"batches": 0, "chunks": 0, "tokens": 0})
    w["batches"], w["chunks"], w["tokens"] = w["batches"] + 1, w["chunks"] + res["computed"], w["tokens"] + res["tokens"]


class RayPrecompute:
    """A distributed precompute job. ``RayPrecompute(...).run()`` -> `RayReport`.

    `address`: None (``$RAY_ADDRESS`` or a new local cluster), "auto", or "host:port" / "ray://host:port".
    An already initialised Ray (``ray.init`` by the caller) is used as it is."""

    def __init__(self, docs_dir, store: str, model: str | None = None, workers: int = 2, address: str | None = None,
                 chunk_tokens: int = DOCUMENT_CHUNK_TOKENS, overlap: int = 0, batch_size: int = 8, storage_dtype: str = "float16",
                 threads_per_worker: int = 1, gpus_per_worker: float = 0.0, max_restarts: int = 3,
                 max_attempts: int = 4, stitch_adapter: str | None = "auto"):
        self.ray = require_ray()
        if not _is_shared_store(store):
            raise InputError("--ray writes from several processes: give a shared --store (redis://host:port/db or "
                             "a directory every worker can reach), not memory")
        if workers < 1:
            raise InputError(f"--ray-workers must be >= 1, got {workers}")
        if batch_size < 1:
            raise InputError(f"--batch-size must be >= 1, got {batch_size}")
        # workers run in their own directory: name paths absolutely (a shared filesystem keeps them valid)
        if "://" not in str(store):
            store = os.path.abspath(os.path.expanduser(str(store).removeprefix("file://")))
        if model is not None and os.path.exists(os.path.expanduser(model)):
            model = os.path.abspath(os.path.expanduser(model))
        if stitch_adapter is not None and os.path.exists(os.path.expanduser(stitch_adapter)):
            stitch_adapter = os.path.abspath(os.path.expanduser(stitch_adapter))
        self.stitch_adapter = stitch_adapter
        self.docs_dir, self.store, self.model, self.n_workers = docs_dir, store, model, workers
        self.address, self.chunk_tokens, self.overlap, self.batch_size = address, chunk_tokens, overlap, batch_size
        self.storage_dtype, self.threads, self.gpus = storage_dtype, threads_per_worker, gpus_per_worker
        self.max_restarts, self.max_attempts = max_restarts, max_attempts
        self.actors: list = []
        self.inflight: dict = {}  # while running: task ref -> (actor, batch id, chunks, attempt)

    # -- setup ---------------------------------------------------------------------------------
    def _init_ray(self) -> None:
        ray = self.ray
        if ray.is_initialized():
            return
        pkg_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = {"PYTHONPATH": os.pathsep.join(p for p in (pkg_root, os.environ.get("PYTHONPATH", "")) if p),
               "OMP_NUM_THREADS": str(self.threads), "TOKENIZERS_PARALLELISM": "false"}
        kwargs = dict(runtime_env={"env_vars": env}, log_to_driver=False)
        if self.address:
            ray.init(address=self.address, **kwargs)
        else:
            ray.init(include_dashboard=False, **kwargs)

    def _chunks(self) -> tuple[list[tuple[str, str]], list[list[int]]]:
        """The folder's chunks as a request builds them, with the tokenizer alone (no model in the driver)."""
        from transformers import AutoTokenizer

        from kvstitch.models.loader import resolve_model
        from kvstitch.core.prompt import PromptBuilder

        path, _ = resolve_model(self.model)
        tok = AutoTokenizer.from_pretrained(str(path))
        pairs = chunk_directory(self.docs_dir, tok, self.chunk_tokens, self.overlap)
        builder = PromptBuilder(tok)
        return pairs, [builder.encode_chunk(text).tolist() for _, text in pairs]

    def start(self) -> None:
        ray = self.ray
        self._init_ray()
        actor_cls = ray.remote(PrecomputeWorker).options(
            num_cpus=self.threads, num_gpus=self.gpus, max_restarts=self.max_restarts, max_task_retries=2)
        device = "cuda" if self.gpus else "cpu"
        self.actors = [actor_cls.remote(self.model, self.store, self.storage_dtype, self.threads, device,
                                        self.stitch_adapter)
                       for _ in range(self.n_workers)]

    # -- the job -------------------------------------------------------------------------------
    def run(self, progress: bool = True, on_result: Callable[["RayPrecompute", dict], None] | None = None) -> RayReport:
        from kvstitch.engine.precompute import progress_bar

        ray = self.ray
        t0 = time.perf_counter()
        pairs, chunks = self._chunks()
        if not self.actors:
            self.start()
        rep = RayReport(chunks=len(chunks), workers=len(self.actors))
        batches, n_todo = self._plan(chunks, rep)
        rep.setup_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        alive = list(self.actors)
        inflight: dict = {}  # ref -> (actor, batch id, chunks, attempt)
        self.inflight = inflight
        done_chunks = 0
        with progress_bar(progress) as bar:
            task = bar.add_task(f"precompute on {len(alive)} Ray workers", total=n_todo, tps=0.0, cps=0.0)
            while batches or inflight:
                for actor in list(alive):  # two batches queued per actor: no idle gap between batches
                    while batches and sum(1 for a, *_ in inflight.values() if a is actor) < 2:
                        b, part, attempt = batches.popleft()
                        inflight[actor.run.remote(b, part, self.batch_size)] = (actor, b, part, attempt)
                if not inflight:
                    raise KVStitchError(f"every Ray worker failed; {len(batches)} batches not computed")
                ready, _ = ray.wait(list(inflight), num_returns=1)
                actor, b, part, attempt = inflight.pop(ready[0])
                try:
                    res = ray.get(ready[0])
                except ray.exceptions.RayError as e:
                    alive = self._failed(e, actor, (b, part, attempt), batches, alive, rep)
                    continue
                _record(rep, res)
                done_chunks += len(part)
                dt = time.perf_counter() - t1
                bar.update(task, completed=done_chunks, tps=rep.tokens / dt if dt else 0.0,
                           cps=done_chunks / dt if dt else 0.0)
                if on_result is not None:
                    on_result(self, res)
        rep.seconds = time.perf_counter() - t1
        return rep

    def _plan(self, chunks: list[list[int]], rep: RayReport) -> tuple[deque, int]:
        """(the batches to compute, how many chunks they hold): each distinct chunk (by its keys, one per canonical
        prefix) once, when the store lacks any of its keys; a worker fills every missing prefix of it."""
        from kvstitch.core.errors import StoreError
        from kvstitch.store import open_store

        ray = self.ray
        try:
            keys = ray.get(self.actors[0].keys.remote(chunks)) if chunks else []
        except ray.exceptions.RayError as e:
            raise KVStitchError(f"the Ray workers could not load the model: {e}") from None
        first: dict[tuple, int] = {}  # a chunk's keys -> its first occurrence
        for i, k in enumerate(keys):
            first.setdefault(tuple(k), i)
        rep.distinct = sum(len(k) for k in first)
        try:
            with open_store(self.store, storage_dtype=self.storage_dtype) as store:
                missing = {k: [x for x in k if x not in store] for k in first}
        except StoreError as e:
            raise KVStitchError(f"cannot reach the store {self.store}: {e}") from None
        todo = [k for k in first if missing[k]]
        rep.skipped = rep.distinct - sum(len(m) for m in missing.values())
        batches = deque((b, [chunks[first[k]] for k in todo[i:i + self.batch_size]], 0)
                        for b, i in enumerate(range(0, len(todo), self.batch_size)))
        rep.batches = len(batches)
        return batches, len(todo)

    def _failed(self, e, actor, batch: tuple, batches: deque, alive: list, rep: RayReport) -> list:
        """A failed batch goes back to the queue (with backoff unless its worker died), or ends the job after
        ``max_attempts``; a dead worker that does not come back is dropped -> the workers still alive."""
        ray = self.ray
        b, part, attempt = batch
        if attempt + 1 >= self.max_attempts:
            cause = getattr(e, "cause", None) or e
            raise KVStitchError(f"precompute failed: batch {b} failed {attempt + 1} times (with backoff); "
                                f"last error: {type(cause).__name__}: {cause}") from None
        rep.retried_batches += 1
        batches.appendleft((b, part, attempt + 1))
        if not isinstance(e, ray.exceptions.RayActorError):  # e.g. the store is down: back off
            time.sleep(min(0.5 * 2 ** attempt, 8.0))
            return alive
        try:
            ray.get(actor.info.remote(), timeout=120)  # restarted? else stop using it
        except ray.exceptions.RayError:
            return [a for a in alive if a is not actor]
        return alive

    def shutdown(self) -> None:
        for a in self.actors:
            try:
                self.ray.kill(a)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self.actors = []


def precompute_ray(docs_dir, store: str, **kwargs) -> RayReport:
    progress = kwargs.pop("progress", True)
    job = RayPrecompute(docs_dir, store, **kwargs)
    try:
        return job.run(progress=progress)
    finally:
        job.shutdown()
