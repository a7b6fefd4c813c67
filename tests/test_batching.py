"""Continuous batching: requests in flight share decode passes (`Engine.decode_batch`, the server's
`EngineWorker`), and every request's answer equals the one it gets alone."""

import asyncio
import json

import httpx
import time

from kvstitch import Engine
from kvstitch.engine.batch import DecodeStep
from kvstitch.serve.server import create_app
from kvstitch.serve.testing import ServerThread
from kvstitch.store import MemoryStore

from .conftest import SAMPLE_CHUNKS, SAMPLE_QUESTION, make_tiny_engine
from .test_server import metric

QUESTIONS = [SAMPLE_QUESTION, "Where does Bob live?", "What opened near the park?", "Who lives in Paris?"]


def _messages(q):
    return [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": q}]


def _body(i, **kw):
    body = {"model": "tiny", "messages": _messages(QUESTIONS[i % len(QUESTIONS)]),
            "documents": SAMPLE_CHUNKS[: 1 + i % len(SAMPLE_CHUNKS)], "max_tokens": 12 + 3 * i}
    body.update(kw)
    if body.get("stream"):
        body["stream_options"] = {"include_usage": True}
    return body


def _alone(engine, body):
    ratio = body.get("ratio", 0.2)
    return engine.generate(messages=body["messages"], chunks=body["documents"], method=body.get("method", "random"),
                           recompute_ratio=ratio, max_new_tokens=body["max_tokens"],
                           temperature=body.get("temperature", 0.0), top_p=body.get("top_p", 1.0),
                           seed=body.get("seed", 0), decode=body.get("decode", "dense"),
                           kv_budget=body.get("kv_budget"), guard=body.get("guard"))


async def _send_all(url, bodies, cancel_after=None):
    """POST every body at once (odd ones streamed); ``cancel_after`` {i: n}: disconnect request i after n
    SSE events -> {i: (status, text, completion tokens, finish chunk)}."""
    cancel_after = cancel_after or {}

    async def one(ac, i, body):
        if body.get("stream"):
            async with ac.stream("POST", "/v1/chat/completions", json=body) as s:
                text, usage, ext, n = "", None, None, 0
                async for line in s.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    n += 1
                    if i in cancel_after and n >= cancel_after[i]:
                        return i, "cancelled", text, None, None
                    ev = json.loads(line[6:])
                    for ch in ev.get("choices", []):
                        text += ch["delta"].get("content") or ""
                    usage = ev.get("usage") or usage
                    ext = ev.get("kvstitch") or ext
                return i, s.status_code, text, usage and usage["completion_tokens"], ext
        r = await ac.post("/v1/chat/completions", json=body)
        out = r.json()
        return i, r.status_code, out["choices"][0]["message"]["content"], out["usage"]["completion_tokens"], \
            out["kvstitch"]

    async with httpx.AsyncClient(base_url=url, timeout=120) as ac:
        got = await asyncio.wait_for(asyncio.gather(*(one(ac, i, b) for i, b in enumerate(bodies))), 120)
    return {i: rest for i, *rest in got}


def _serve(engine, **kw):
    return ServerThread(create_app(engine, default_method="random", default_ratio=0.2, max_queue=16,
                                   model_name="tiny", max_batch=8, **kw))


def test_decode_batch_rows_equal_lone_steps(smollm_tokenizer):
    """Engine level: ragged caches (different lengths, methods, ratios) stepped together == stepped alone."""
    eng = make_tiny_engine("qwen3", smollm_tokenizer)
    setups = [("full", 1.0, 1), ("random", 0.3, 2), ("prophet", 0.2, 4), ("naive", 0.0, 3)]
    pres = [eng.prefill(eng.layout(SAMPLE_QUESTION, SAMPLE_CHUNKS[:k]), m, r, 16) for m, r, k in setups]
    assert len({p.cache.length for p in pres}) == len(pres)  # ragged
    alone = []
    for p in pres:
        n, t, toks = p.cache.length, int(p.logits[-1].argmax()), []
        for _ in range(12):
            t = int(eng.decode_step(p.cache, t)[-1].argmax())
            toks.append(t)
        p.cache.truncate(n)
        alone.append(toks)
    toks = [[int(p.logits[-1].argmax())] for p in pres]
    for _ in range(12):
        outs = eng.decode_batch([DecodeStep(p.cache, t[-1]) for p, t in zip(pres, toks)])
        assert all(o.shape == (1, eng.model.config.vocab_size) for o in outs)
        for t, o in zip(toks, outs):
            t.append(int(o[-1].argmax()))
    assert [t[1:] for t in toks] == alone


def test_ragged_batch_each_equals_alone(smollm_tokenizer):
    eng = make_tiny_engine("llama", smollm_tokenizer)
    mix = [dict(method="random", ratio=0.2), dict(method="prophet", ratio=0.3), dict(method="naive", ratio=0.0),
           dict(method="full"), dict(method="random", ratio="auto"), dict(method="epic", ratio=0.5),
           dict(method="random", ratio=0.3, temperature=0.8, top_p=0.9, seed=3), dict(method="prophet", ratio=0.1)]
    bodies = [_body(i, stream=bool(i % 2), **m) for i, m in enumerate(mix)]
    refs = [_alone(eng, b) for b in bodies]  # also warms the store: every request below is stitched from it
    with _serve(eng) as srv:
        got = asyncio.run(_send_all(srv.url, bodies))
        m = httpx.get(f"{srv.url}/metrics").text
    for i, ref in enumerate(refs):
        status, text, n_tok, ext = got[i]
        assert status == 200 and text == ref.text and n_tok == len(ref.token_ids), (i, bodies[i], text, ref.text)
    passes, rows = metric(m, "kvstitch_batch_size_count"), metric(m, "kvstitch_batch_size_sum")
    assert passes > 0 and rows > passes  # decode passes were shared by several requests
    assert metric(m, "kvstitch_max_batch") == 8 and metric(m, "kvstitch_decode_passes_total") == passes


def test_cancel_mid_batch_and_stitched_full_prefill_mix(smollm_tokenizer):
    base = make_tiny_engine("llama", smollm_tokenizer)
    eng = Engine(base.model, base.tokenizer, weights_id="tiny-llama", store=MemoryStore(storage_dtype="float32"),
                 check_rope=False)  # the default cold path: a cold request is answered by full prefill
    warm_docs = SAMPLE_CHUNKS[:2]
    eng.generate(messages=_messages(QUESTIONS[0]), chunks=warm_docs, method="random", max_new_tokens=1)  # stored
    cold_docs = ["Dave's boat is blue and moored in Oslo harbour. " * 3, "Erin plays the cello every Sunday. " * 3]
    bodies = [
        {**_body(0, method="random", ratio=0.3), "documents": warm_docs},  # stitched from the store
        {**_body(1, method="prophet", ratio=0.2, stream=True), "documents": cold_docs},  # cold: full prefill
        _body(2, method="full"),  # full prefill
        _body(3, method="random", ratio=0.2, stream=True, max_tokens=400),  # cancelled mid-batch
        _body(4, method="random", ratio=0.2, guard="full"),  # unbatched (verified against full prefill)
        _body(5, method="random", ratio=0.2, decode="quest", kv_budget=64),  # unbatched (sparse decode)
    ]
    with _serve(eng) as srv:
        m0 = httpx.get(f"{srv.url}/metrics").text
        got = asyncio.run(_send_all(srv.url, bodies, cancel_after={3: 4}))
        deadline = time.monotonic() + 30
        while metric(httpx.get(f"{srv.url}/metrics").text, "kvstitch_cancelled_total") < \
                metric(m0, "kvstitch_cancelled_total") + 1:
            assert time.monotonic() < deadline, "the cancelled request was not stopped"
            time.sleep(0.05)
        m1 = httpx.get(f"{srv.url}/metrics").text
        assert httpx.get(f"{srv.url}/health").json()["active"] == 0
    assert got[3][0] == "cancelled"
    assert metric(m1, "kvstitch_generated_tokens_total") - metric(m0, "kvstitch_generated_tokens_total") < 400 + sum(
        b["max_tokens"] for b in bodies[:3] + bodies[4:])
    assert got[1][3]["store_misses"] == len(cold_docs) and got[1][3]["cold_path"] == "full_prefill"
    assert got[0][3]["store_misses"] == 0 and got[0][3]["cold_path"] == "stitched"
    # references alone, after the server: the cold request's chunks were computed while the worker was idle,
    # so its reference is computed with the cold path forced the same way (full prefill)
    cold_key = [eng.chunk_key(lay.prefix_ids, ids) for lay in [eng.layout(None, cold_docs, bodies[1]["messages"])]
                for ids in lay.chunk_ids]
    assert all(k in eng.store for k in cold_key)  # filled off the request path
    for i in (0, 2, 4, 5):
        ref = _alone(eng, bodies[i])
        assert got[i][0] == 200 and got[i][1] == ref.text and got[i][2] == len(ref.token_ids), i
    full = _alone(eng, {**bodies[1], "method": "full"})
    assert got[1][0] == 200 and got[1][1] == full.text and got[1][2] == len(full.token_ids)
