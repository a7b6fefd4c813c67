"""Batched recompute passes: several requests' recompute passes packed on the sequence axis as one
forward (`Engine.recompute_batch`, `kvstitch.engine.batch.PackedCache`), each request's logits, cache and answer equal
to the ones it gets alone; the server's worker packs the passes of the jobs it admits in one round."""

import asyncio
import threading
import time

import httpx
import pytest
import torch

from kvstitch import Engine
from kvstitch.engine import GenerationRequest
from kvstitch.core.attention import ForwardPlan
from kvstitch.engine.batch import DecodeStep, RecomputeStep, can_batch, plain_plan
from kvstitch.engine.prefill import recompute_step
from kvstitch.core.errors import InputError
from kvstitch.serve.jobs import Job
from kvstitch.serve.prometheus import Metrics
from kvstitch.serve.server import create_app
from kvstitch.serve.testing import ServerThread
from kvstitch.serve.worker import EngineWorker
from kvstitch.store import MemoryStore

from .conftest import SAMPLE_CHUNKS, SAMPLE_QUESTION, make_tiny_engine
from .test_batching import _alone, _body, _send_all
from .test_server import metric

# different context lengths (1-4 chunks), methods and ratios; the full-prefill pass packs too
MIX = [("random", 0.3, 1), ("prophet", 0.2, 4), ("cacheblend", 0.5, 2), ("random", 0.1, 3), ("full", 1.0, 2),
       ("prophet", 0.6, 3), ("naive", 0.0, 1)]
QUESTIONS = [SAMPLE_QUESTION, "Where does Bob live?", "What opened near the park?", "Who lives in Paris?"]


def _req(i, method, ratio, k, **kw):
    return dict(question=QUESTIONS[i % len(QUESTIONS)], chunks=SAMPLE_CHUNKS[:k], method=method,
                recompute_ratio=ratio, max_new_tokens=10, **kw)


def _start(eng, reqs):
    """Each request's generator, run up to its recompute pass -> (generators, steps)."""
    gens = [eng.steps(GenerationRequest(**r), batch_prefill=True, batch_decode=True) for r in reqs]
    steps = [next(g) for g in gens]
    assert all(isinstance(s, RecomputeStep) for s in steps)
    return gens, steps


def _finish(eng, gen, logits):
    """Send a pass's logits, then run the request's decode steps alone -> its `GenerationResult`."""
    ev = gen.send(logits)
    while True:
        if isinstance(ev, DecodeStep):
            ev = gen.send(eng.decode_batch([ev])[0])
        elif isinstance(ev, int):
            ev = next(gen)
        else:
            return ev


# gemma3: sliding-window layers (window 24) + global ones; mistral-window: every layer windowed; qwen2: biases
@pytest.mark.parametrize("family", ["llama", "gemma3", "mistral-window", "qwen2"])
def test_packed_recompute_equals_each_alone(family, smollm_tokenizer):
    eng = make_tiny_engine(family, smollm_tokenizer)
    reqs = [_req(i, m, r, k) for i, (m, r, k) in enumerate(MIX)]
    refs, pres = [], []
    for r in reqs:  # alone (also warms the store)
        refs.append(eng.generate(**r))
        pres.append(eng.prefill(eng.layout(r["question"], r["chunks"]), r["method"], r["recompute_ratio"], 10))
    gens, steps = _start(eng, reqs)
    assert len({s.ids.numel() for s in steps}) > 3  # ragged segments
    logits = eng.recompute_batch(steps)
    for i, (lg, pre, ref) in enumerate(zip(logits, pres, refs)):
        assert lg.shape == (1, eng.model.config.vocab_size)
        assert torch.allclose(lg, pre.logits[-1:], atol=1e-5, rtol=0), (i, MIX[i], (lg - pre.logits[-1:]).abs().max())
        assert torch.allclose(lg[0], ref.first_logits, atol=1e-5, rtol=0)
        n = pre.layout.n_total  # every segment's fresh K/V landed in its own cache, at its own slots
        assert torch.allclose(steps[i].cache.stacked_keys(0, n), pre.cache.stacked_keys(0, n), atol=1e-5, rtol=0)
        assert torch.allclose(steps[i].cache.stacked_values(0, n), pre.cache.stacked_values(0, n), atol=1e-5, rtol=0)
        assert steps[i].batch_size == len(steps)
    for i, (g, lg, ref) in enumerate(zip(gens, logits, refs)):
        res = _finish(eng, g, lg)
        assert res.token_ids == ref.token_ids and res.text == ref.text, i
        assert res.stats["recompute_batch"] == len(steps)


def test_packed_full_recompute_is_full_prefill(smollm_tokenizer):
    """The exactness gate, packed: 100% recompute of a stitched cache == full prefill of the same prompt."""
    eng = make_tiny_engine("qwen3", smollm_tokenizer)
    reqs = [_req(0, "random", 1.0, 3), _req(1, "prophet", 0.2, 2), _req(2, "random", 1.0, 4)]
    for r in reqs:
        eng.generate(**r)  # warm store: the 100% requests are stitched, then fully recomputed
    gens, steps = _start(eng, reqs)
    logits = eng.recompute_batch(steps)
    for i in (0, 2):
        full = eng.generate(**{**reqs[i], "method": "full"})
        assert (logits[i][0] - full.first_logits).abs().max() < 1e-3
        assert _finish(eng, gens[i], logits[i]).token_ids == full.token_ids
    _finish(eng, gens[1], logits[1])


def test_what_cannot_pack_runs_alone(smollm_tokenizer):
    eng = make_tiny_engine("llama", smollm_tokenizer)
    assert plain_plan(None) and plain_plan(ForwardPlan(q_slots=torch.arange(3)))
    for plan in (ForwardPlan(attn_hook=lambda *a: None), ForwardPlan(ape=(1.0, 1.0, 0, 4)),
                 ForwardPlan(stop_after_layer=1), ForwardPlan(capture_queries=4), ForwardPlan(group_queries=8),
                 ForwardPlan(key_keep=torch.ones(4, dtype=torch.bool))):
        assert not plain_plan(plan)
    lay = eng.layout(SAMPLE_QUESTION, SAMPLE_CHUNKS[:2])
    pre = eng.prefill(lay, "random", 0.3, 4)
    step = recompute_step(pre.cache, lay, pre.indices, ForwardPlan(ape=(1.0, 1.0, lay.context_start,
                                                                           lay.context_end)))
    other = recompute_step(eng.prefill(lay, "random", 0.3, 4).cache, lay, pre.indices)
    assert not can_batch(step) and can_batch(other)
    with pytest.raises(InputError):
        eng.recompute_batch([step, other])
    with pytest.raises(InputError):  # one cache cannot take two passes at once
        eng.recompute_batch([other, other])
    with pre.cache.mode(write=False):
        assert not can_batch(RecomputeStep(pre.cache, other.ids, other.slots))
    # APE's recompute plan and ratio="auto" rounds: the stream runs them alone, no step is handed out
    for kw in (dict(method="ape", recompute_ratio=0.0), dict(method="random", recompute_ratio="auto")):
        r = dict(question=SAMPLE_QUESTION, chunks=SAMPLE_CHUNKS[:2], max_new_tokens=4, **kw)
        events = list(eng.steps(GenerationRequest(**r), batch_prefill=True))
        assert not any(isinstance(e, RecomputeStep) for e in events)
        assert events[-1].token_ids == eng.generate(**r).token_ids
    # the flag off: no step, the same answer (Engine.prefill/generate unchanged)
    r = _req(0, "random", 0.3, 2)
    assert [e for e in eng.stream(**r) if isinstance(e, int)] == eng.generate(**r).token_ids
    g = eng.steps(GenerationRequest(**r), batch_prefill=True)
    assert isinstance(next(g), RecomputeStep)
    with pytest.raises(InputError):  # a consumer that sends nothing back gets a clear error
        next(g)


def test_request_closed_while_its_pass_is_pending(smollm_tokenizer):
    eng = make_tiny_engine("llama", smollm_tokenizer)
    reqs = [_req(i, m, r, k) for i, (m, r, k) in enumerate(MIX[:4])]
    refs = [eng.generate(**r) for r in reqs]
    gens, steps = _start(eng, reqs)
    gens[1].close()  # the client went away: its pass is dropped, the others pack without it
    keep = [0, 2, 3]
    logits = eng.recompute_batch([steps[i] for i in keep])
    for i, lg in zip(keep, logits):
        assert _finish(eng, gens[i], lg).token_ids == refs[i].token_ids


class _CancellingEngine:
    """The tiny engine; starting the stream of job ``at`` cancels job ``victim`` (whose recompute pass is then
    pending, not yet run); records the sizes of the packed passes."""

    def __init__(self, engine, jobs, victim, at):
        self._engine, self.jobs, self.victim, self.at, self.calls, self.packs = engine, jobs, victim, at, 0, []

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def steps(self, request, **kw):
        if self.calls == self.at:
            self.jobs[self.victim].cancel()
        self.calls += 1
        return self._engine.steps(request, **kw)

    def recompute_batch(self, steps):
        self.packs.append(len(steps))
        return self._engine.recompute_batch(steps)


def _drain(loop, jobs, timeout=60.0):
    async def one(job):
        out = []
        while True:
            kind, value = await job.events.get()
            out.append((kind, value))
            if kind == "done":
                return out

    async def all_():
        return await asyncio.wait_for(asyncio.gather(*(one(j) for j in jobs)), timeout)

    return loop.run_until_complete(all_())


def test_worker_packs_admitted_jobs_and_survives_a_cancel(smollm_tokenizer):
    eng = make_tiny_engine("llama", smollm_tokenizer)
    reqs = [_req(i, m, r, k) for i, (m, r, k) in enumerate(MIX)]
    refs = [eng.generate(**r) for r in reqs]
    loop = asyncio.new_event_loop()
    try:
        jobs = [Job(GenerationRequest(**r), loop=loop) for r in reqs]
        proxy = _CancellingEngine(eng, jobs, victim=2, at=4)
        metrics = Metrics()
        worker = EngineWorker(proxy, max_queue=16, metrics=metrics, max_batch=8)
        for j in jobs:  # all queued before the worker starts: one round admits them all
            worker.submit(j)
        worker.start()
        events = _drain(loop, jobs)
        worker.stop()
    finally:
        loop.close()
    assert proxy.packs[0] == len(reqs) - 1  # one packed pass of every admitted job but the cancelled one
    for i, evs in enumerate(events):
        kinds = [k for k, _ in evs]
        if i == 2:
            assert "result" not in kinds and "token" not in kinds
            continue
        res = [v for k, v in evs if k == "result"][0]
        assert res.token_ids == refs[i].token_ids and [v for k, v in evs if k == "token"] == refs[i].token_ids, i
    assert metrics.get("kvstitch_cancelled_total") == 1
    assert metrics.hist_totals("kvstitch_recompute_batch_size")[0] == len(reqs) - 1
    assert metrics.get("kvstitch_recompute_passes_total") == 1


async def _send_gated(url, app, bodies):
    """Hold the engine worker (a blocking job) until every body is queued, so one round admits them all."""
    gate = threading.Event()
    app.state.worker.submit(Job(None, loop=asyncio.get_running_loop(), fn=lambda e: gate.wait(30)))
    task = asyncio.ensure_future(_send_all(url, bodies))
    deadline = time.monotonic() + 30
    while app.state.worker.waiting < len(bodies):
        assert time.monotonic() < deadline, "the requests were not queued"
        await asyncio.sleep(0.02)
    gate.set()
    return await task


def test_server_packs_recompute_passes_answers_equal_alone(smollm_tokenizer):
    eng = make_tiny_engine("llama", smollm_tokenizer)
    mix = [dict(method="random", ratio=0.2), dict(method="prophet", ratio=0.3), dict(method="cacheblend", ratio=0.5),
           dict(method="full"), dict(method="random", ratio=1.0), dict(method="random", ratio="auto"),
           dict(method="random", ratio=0.3, temperature=0.8, top_p=0.9, seed=3), dict(method="prophet", ratio=0.1)]
    bodies = [_body(i, stream=bool(i % 2), **m) for i, m in enumerate(mix)]
    refs = [_alone(eng, b) for b in bodies]
    app = create_app(eng, default_method="random", default_ratio=0.2, max_queue=16, model_name="tiny", max_batch=8)
    with ServerThread(app) as srv:
        got = asyncio.run(_send_gated(srv.url, app, bodies))
        m = httpx.get(f"{srv.url}/metrics").text
    for i, ref in enumerate(refs):
        status, text, n_tok, ext = got[i]
        assert status == 200 and text == ref.text and n_tok == len(ref.token_ids), (i, bodies[i], text, ref.text)
    # every job but the "auto" one (its rounds run alone) handed its pass to one packed forward
    assert metric(m, "kvstitch_recompute_batch_size_count") == 1 == metric(m, "kvstitch_recompute_passes_total")
    assert metric(m, "kvstitch_recompute_batch_size_sum") == len(bodies) - 1
    assert metric(m, "kvstitch_batch_size_sum") > metric(m, "kvstitch_batch_size_count") > 0  # decode batched too


def test_serial_server_and_cold_full_prefill_still_answer(smollm_tokenizer):
    """max_batch=1: one job per round, its pass run alone through `recompute_batch`; a cold request (default
    cold path: full prefill) hands over its full-prefill pass."""
    base = make_tiny_engine("llama", smollm_tokenizer)
    eng = Engine(base.model, base.tokenizer, weights_id="tiny-llama", store=MemoryStore(storage_dtype="float32"),
                 check_rope=False)
    cold_docs = ["Dave's boat is blue and moored in Oslo harbour. " * 3, "Erin plays the cello every Sunday. " * 3]
    bodies = [{**_body(0, method="random", ratio=0.3), "documents": cold_docs}, _body(1, method="prophet", ratio=0.2)]
    _alone(eng, bodies[1])  # stores its chunks: stitched in the server too
    app = create_app(eng, default_method="random", default_ratio=0.2, max_queue=4, model_name="tiny", max_batch=1)
    with ServerThread(app) as srv:
        got = asyncio.run(_send_all(srv.url, bodies))
        m = httpx.get(f"{srv.url}/metrics").text
    assert got[0][0] == 200 and got[0][3]["cold_path"] == "full_prefill"
    full = _alone(eng, {**bodies[0], "method": "full"})
    assert got[0][1] == full.text
    assert got[1][0] == 200 and got[1][3]["cold_path"] == "stitched" and got[1][1] == _alone(eng, bodies[1]).text
    assert metric(m, "kvstitch_recompute_batch_size_sum") == metric(m, "kvstitch_recompute_batch_size_count") >= 2
