"""The batching scheduler: `EngineWorker`, the one thread that owns the engine and serves up to ``max_batch``
jobs at once (continuous batching of recompute passes and decode steps)."""

import math
import queue
import random
import threading
import time

import torch

from kvstitch.core.errors import InputError, KVStitchError
from kvstitch.decode.policies import is_dense
from kvstitch.engine import STOP, GenerationResult
from kvstitch.engine.batch import DecodeStep, RecomputeStep
from kvstitch.store.tenants import tenant_scope
from .admission import KVPool, kv_shape
from .jobs import ApiError, Job, QueueFull, input_error
from .prometheus import Metrics
from .stops import StopScanner

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
        self.kv_shape = kv_shape(engine)
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
                job.emit("error", input_error(e))
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
        req = job.request
        try:
            layout = req.layout or self.engine.layout(req.question, req.chunks, req.messages)
        except Exception:  # noqa: BLE001 - the engine raises the same error, as a 400, when the job starts
            return 0
        req.layout = layout
        try:
            sparse = not is_dense(req.decode)  # a policy object as it is; a spec (library callers) parsed
        except InputError:  # likewise: a bad policy is the engine's 400
            sparse = False
        return self.kv_shape.request_bytes(layout.n_total, int(req.max_new_tokens or 0), sparse=sparse,
                                           copies=2 if req.guard else 1)  # guard: a full prefill beside it

    def _idle_precompute(self) -> bool:
        """Compute a slice of the chunks cold requests deferred -> False when there is nothing to do."""
        deferred = getattr(self.engine, "deferred", None)
        if deferred is None or not len(deferred):
            return False
        next_tenant = getattr(deferred, "next_tenant", None)  # per-tenant queues: stored in the tenant's namespace
        try:
            with tenant_scope(next_tenant() if next_tenant is not None else None):
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
                with tenant_scope(job.tenant):
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
            live.gen = self.engine.steps(job.request,
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
            for hist in d.recall.histories():  # the request keeps no diagnostics it did not ask for
                for layer, n in zip(hist, lengths):
                    del layer[n:]

    def _pump(self, live: "_Live", value=None) -> None:
        """Send ``value`` (a step's logits, STOP or None) and handle events until the job needs a model step,
        has produced one token (unbatched jobs: one model step per iteration) or has ended. The engine's store
        serves the job's tenant meanwhile (its chunks are read and written only here)."""
        with tenant_scope(live.job.tenant):
            self._pump_job(live, value)

    def _pump_job(self, live: "_Live", value=None) -> None:
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
            return input_error(e)
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
