"""The server batches sparse decode: ``"decode": "prkv"`` (and the other policies) share decode passes with
every other request, answers equal the same request alone, /metrics reports the KV pool, offload, the selected
fraction and sampled recall, and the KV pool limit makes requests wait instead of failing."""

import asyncio

import httpx

from kvstitch.serve.server import create_app
from kvstitch.serve.testing import ServerThread

from .conftest import SAMPLE_CHUNKS, make_tiny_engine
from .test_batching import _alone, _messages, _send_all
from .test_server import metric

QUESTIONS = ["What is the special magic number for Carol?", "Where does Bob live?", "What opened near the park?"]


def _docs(i: int) -> list[str]:
    """Ragged contexts of ~400-700 tokens: enough for a 128-token budget (+ 64-token window) to select from."""
    return [SAMPLE_CHUNKS[(i + j) % len(SAMPLE_CHUNKS)] + f" Note {i}.{j}." for j in range(18 + 4 * i)]


def _body(i: int, decode: str, max_tokens: int, **kw) -> dict:
    return {"model": "tiny", "messages": _messages(QUESTIONS[i % len(QUESTIONS)]), "documents": _docs(i),
            "method": "random", "ratio": 0.3, "max_tokens": max_tokens, "decode": decode, "kv_budget": 128,
            "stream": bool(i % 2), **({"stream_options": {"include_usage": True}} if i % 2 else {}), **kw}


def _serve(engine, **kw):
    return ServerThread(create_app(engine, default_method="random", default_ratio=0.3, max_queue=16,
                                   model_name="tiny", max_batch=8, **kw))


def test_sparse_requests_batch_with_each_other_and_dense_ones(smollm_tokenizer):
    eng = make_tiny_engine("llama", smollm_tokenizer)
    policies = ["prkv", "prkv", "quest", "full", "snapkv", "arkvale", "shadowkv", "prkv"]
    bodies = [_body(i, p, 10 + 5 * (i % 3)) for i, p in enumerate(policies)]
    refs = [_alone(eng, b) for b in bodies]  # alone, and warms the store
    with _serve(eng, recall_sample=1.0) as srv:
        got = asyncio.run(_send_all(srv.url, bodies))
        m = httpx.get(f"{srv.url}/metrics").text
    for i, ref in enumerate(refs):
        status, text, n_tok, ext = got[i]
        assert status == 200 and text == ref.text and n_tok == len(ref.token_ids), (i, policies[i])
        assert ext["decode"] == ("dense" if policies[i] == "full" else policies[i])  # the alias: its name
    passes, rows = metric(m, "kvstitch_batch_size_count"), metric(m, "kvstitch_batch_size_sum")
    assert rows > passes > 0  # sparse and dense steps shared passes
    assert passes < sum(len(r.token_ids) for r in refs) // 2
    sel, ctx = metric(m, "kvstitch_decode_selected_tokens_total"), metric(m, "kvstitch_decode_context_tokens_total")
    assert 0 < sel < 0.7 * ctx and abs(metric(m, "kvstitch_decode_selected_fraction") - sel / ctx) < 1e-6
    n_recall = metric(m, "kvstitch_decode_recall_count")
    # every pass sampled (recall_sample=1): one recall per sparse request step, in (0, 1]; answers unchanged (above)
    assert n_recall == sum(len(r.token_ids) - 1 for r, p in zip(refs, policies) if p != "full")
    assert 0.0 < metric(m, "kvstitch_decode_recall_sum") / n_recall <= 1.0 + 1e-6
    assert metric(m, "kvstitch_kv_pool_peak_bytes") > 0 and metric(m, "kvstitch_kv_pool_reserved_bytes") == 0
    assert metric(m, "kvstitch_kv_offloaded_bytes") == 0  # nothing in flight any more


def test_kv_pool_limit_makes_requests_wait_never_fail(smollm_tokenizer):
    """A pool with room for about two requests: eight concurrent ones all answer (the same as alone), the peak
    reservation stays under the limit, some waited; one that cannot fit even alone is a 400 up front."""
    eng = make_tiny_engine("llama", smollm_tokenizer)
    bodies = [_body(i % 3, ["prkv", "full", "quest"][i % 3], 12) for i in range(8)]
    refs = [_alone(eng, b) for b in bodies]
    shape_bytes = 2 * eng.adapter.num_layers * eng.adapter.num_kv_heads * eng.adapter.head_dim * 4
    big = max(eng.layout(None, b["documents"], b["messages"]).n_total + 12 for b in bodies) * shape_bytes
    limit = int(2.5 * big)
    with _serve(eng, kv_pool_bytes=limit) as srv:
        m0 = httpx.get(f"{srv.url}/metrics").text
        assert metric(m0, "kvstitch_kv_pool_limit_bytes") == limit
        got = asyncio.run(_send_all(srv.url, bodies))
        m = httpx.get(f"{srv.url}/metrics").text
        huge = httpx.post(f"{srv.url}/v1/chat/completions", json=_body(0, "prkv", 12, documents=_docs(0) * 6),
                          timeout=60)
        assert httpx.get(f"{srv.url}/health").json()["active"] == 0
    for i, ref in enumerate(refs):
        assert got[i][0] == 200 and got[i][1] == ref.text, i
    assert 0 < metric(m, "kvstitch_kv_pool_peak_bytes") <= limit
    assert metric(m, "kvstitch_kv_pool_waits_total") > 0
    assert metric(m, "kvstitch_kv_pool_reserved_bytes") == 0
    assert huge.status_code == 400 and huge.json()["error"]["code"] == "kv_pool_too_small"
