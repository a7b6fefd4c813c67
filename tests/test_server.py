"""The OpenAI-compatible server, started for real (uvicorn on a loopback port) over the tiny llama engine.

Clients speak plain OpenAI chat-completions JSON over httpx (the `openai` package is not a dependency;
its `extra_body=` puts `documents`/`method`/... at the top level exactly as these requests do)."""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid

import httpx
import pytest

from kvstitch.serve.server import create_app
from kvstitch.serve.stops import TextStream
from kvstitch.serve.testing import ServerThread

from .conftest import MAX_QUEUE, SAMPLE_CHUNKS, SAMPLE_QUESTION


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def chat_body(question=SAMPLE_QUESTION, documents=SAMPLE_CHUNKS, **kw):
    body = {"model": "tiny-llama", "messages": [{"role": "system", "content": "You are helpful."},
                                                 {"role": "user", "content": question}],
            "documents": documents, "max_tokens": 8}
    body.update(kw)
    return body


def read_sse(resp) -> tuple[str, list[dict]]:
    """Concatenated content deltas and every JSON event of an SSE response (asserts the framing)."""
    text, events, done = "", [], False
    for line in resp.iter_lines():
        if not line:
            continue
        assert line.startswith("data: "), line
        payload = line[len("data: "):]
        if payload == "[DONE]":
            done = True
            continue
        ev = json.loads(payload)
        events.append(ev)
        for ch in ev.get("choices", []):
            text += ch["delta"].get("content") or ""
    assert done, "stream did not end with [DONE]"
    return text, events


def metric(text: str, name: str, **labels) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    total = 0.0
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)$", line)
        if not m or m.group(1) != name:
            continue
        labs = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if all(labs.get(k) == v for k, v in labels.items()):
            total += float(m.group(3))
    return total


# ---- basics ------------------------------------------------------------------------------------------
def test_health_models_and_unknown_route(client):
    h = client.get("/health")
    assert h.status_code == 200 and h.json()["status"] == "ok" and h.json()["max_queue"] == MAX_QUEUE
    m = client.get("/v1/models").json()
    assert m["object"] == "list" and m["data"][0]["id"] == "tiny-llama"
    assert "random" in m["data"][0]["kvstitch"]["methods"] and m["data"][0]["kvstitch"]["collections"] == ["facts"]
    r = client.get("/v1/nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


CASES = [
    dict(method="random", ratio=0.5),
    dict(method="naive", ratio=0.0),
    dict(method="full", ratio=0.2),
    dict(method="random", ratio=0.3, temperature=0.8, top_p=0.9, seed=7),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_answers_equal_engine_generate(client, engine, case):
    body = chat_body(method=case["method"], ratio=case["ratio"], temperature=case.get("temperature", 0.0),
                     top_p=case.get("top_p", 1.0), seed=case.get("seed", 0), max_tokens=10)
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    with client.stream("POST", "/v1/chat/completions",
                       json={**body, "stream": True, "stream_options": {"include_usage": True}}) as s:
        assert s.status_code == 200 and s.headers["content-type"].startswith("text/event-stream")
        streamed, events = read_sse(s)
    # reference: the same inputs through the library (after the server is idle: one thread at a time)
    ref = engine.generate(messages=body["messages"], chunks=SAMPLE_CHUNKS, method=case["method"],
                          recompute_ratio=case["ratio"],
                          max_new_tokens=10, temperature=case.get("temperature", 0.0), top_p=case.get("top_p", 1.0),
                          seed=case.get("seed", 0))
    assert out["object"] == "chat.completion" and out["model"] == "tiny-llama"
    assert out["choices"][0]["message"] == {"role": "assistant", "content": ref.text}
    assert out["choices"][0]["finish_reason"] in ("stop", "length")
    assert out["usage"]["completion_tokens"] == len(ref.token_ids)
    assert out["usage"]["prompt_tokens"] == engine.layout(None, SAMPLE_CHUNKS, body["messages"]).n_total
    ext = out["kvstitch"]
    assert ext["method"] == case["method"] and ext["ratio"] == case["ratio"]
    assert ext["recomputed_tokens"] == ref.stats["recomputed_tokens"] and ext["ttft_s"] > 0
    # streaming: same text, OpenAI chunk framing, usage chunk, kvstitch extension on the finish chunk
    assert streamed == ref.text
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(e["object"] == "chat.completion.chunk" and e["id"] == events[0]["id"] for e in events)
    finish = [e for e in events if e["choices"] and e["choices"][0]["finish_reason"]]
    assert len(finish) == 1 and finish[0]["kvstitch"]["recomputed_tokens"] == ref.stats["recomputed_tokens"]
    assert events[-1]["choices"] == [] and events[-1]["usage"] == out["usage"]


def test_text_stream_deltas_rebuild_the_final_text(engine):
    tok = engine.tokenizer
    for text in ["  Hello,  world!  ", "Ünïcödé — 日本語 ok", "a\n\n b . c n't", "😀 emoji 🎉 end"]:
        ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
        ts = TextStream(tok, engine.eos_ids)
        out = "".join(ts.push(i) for i in ids)
        final = tok.decode(ids[:-1], skip_special_tokens=True).strip()
        assert final.startswith(out)
        assert out + ts.finish(final) == final


# ---- errors ------------------------------------------------------------------------------------------
LONG_DOC = " ".join(f"word{i}" for i in range(3000))  # > 4096 tokens for the tiny model's limit

ERRORS = [
    ("malformed-json", b'{"messages": [', 400, "not valid JSON"),
    ("not-an-object", b"[1, 2]", 400, "must be a JSON object"),
    ("unknown-method", dict(method="nope"), 400, "unknown method 'nope'; known methods:"),
    ("too-long", dict(documents=[LONG_DOC]), 400, "limit of 4096 positions"),
    ("negative-max-tokens", dict(max_tokens=-5), 400, "'max_tokens' must be >= 1"),
    ("zero-max-completion", dict(max_tokens=None, max_completion_tokens=0), 400,
     "'max_completion_tokens' must be >= 1"),
    ("ratio-range", dict(ratio=1.5), 400, "'ratio': recompute_ratio must be a number in [0, 1] or 'auto'"),
    ("no-messages", dict(messages=[]), 400, "'messages' is required"),
    ("no-user", dict(messages=[{"role": "system", "content": "x"}]), 400, "no 'user' message"),
    ("empty-document", dict(documents=["ok", "  "]), 400, "documents[1] is empty"),
    ("both-sources", dict(collection="facts"), 400, "either 'documents' or 'collection'"),
    ("unknown-collection", dict(documents=None, collection="nope"), 404, "collection 'nope' not found"),
    ("path-collection", dict(documents=None, collection="../etc"), 400, "invalid collection name"),
    ("bad-decode", dict(decode="zzz"), 400, "unknown decode policy 'zzz'"),
    ("n-2", dict(n=2), 400, "'n' is not supported"),
    ("stop-5", dict(stop=["a", "b", "c", "d", "e"]), 400, "'stop' must be a non-empty string or a list of up to 4"),
    ("stop-empty", dict(stop=""), 400, "'stop' must be"),
    ("presence-penalty", dict(presence_penalty=0.5), 400, "'presence_penalty' is not supported"),
    ("frequency-penalty", dict(frequency_penalty=-1), 400, "'frequency_penalty' is not supported"),
    ("logit-bias", dict(logit_bias={"42": 5}), 400, "'logit_bias' is not supported"),
    ("json-mode", dict(response_format={"type": "json_object"}), 400, "'response_format' is not supported"),
    ("unknown-param", dict(best_of=3), 400, "unsupported parameter 'best_of'"),
    ("bad-role", dict(messages=[{"role": "robot", "content": "x"}]), 400, "unknown role 'robot'"),
    ("bool-max-tokens", dict(max_tokens=True), 400, "'max_tokens' must be an integer"),
    ("min-tokens-over-max", dict(max_tokens=4, min_tokens=5), 400, "'min_tokens' must be <= 4"),
]


# a raw (non-JSON) body has no `stream` flag to vary: those cases run once
CASES = [(*e, stream) for e in ERRORS for stream in ([False] if isinstance(e[1], bytes) else [False, True])]


@pytest.mark.parametrize("name,change,status,message,stream", CASES,
                         ids=[f"{c[0]}-{'sse' if c[4] else 'json'}" for c in CASES])
def test_bad_requests_get_clear_4xx(client, name, change, status, message, stream):
    if isinstance(change, bytes):
        r = client.post("/v1/chat/completions", content=change, headers={"content-type": "application/json"})
    else:
        body = chat_body(stream=stream)
        body.update(change)
        body = {k: v for k, v in body.items() if v is not None}
        r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")  # an error, never a half-open stream
    err = r.json()["error"]
    assert message in err["message"], err
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"


# ---- metrics, collections ----------------------------------------------------------------------------
def test_metrics_counts_move(client):
    before = client.get("/metrics").text
    assert "# TYPE kvstitch_ttft_seconds histogram" in before
    r = client.post("/v1/chat/completions", json=chat_body(method="random", max_tokens=3))
    assert r.status_code == 200
    client.post("/v1/chat/completions", json=chat_body(method="bogus"))
    after = client.get("/metrics")
    assert after.headers["content-type"].startswith("text/plain")
    a = after.text
    assert metric(a, "kvstitch_chat_requests_total", outcome="ok") == \
        metric(before, "kvstitch_chat_requests_total", outcome="ok") + 1
    assert metric(a, "kvstitch_chat_requests_total", outcome="invalid") == \
        metric(before, "kvstitch_chat_requests_total", outcome="invalid") + 1
    assert metric(a, "kvstitch_ttft_seconds_count") == metric(before, "kvstitch_ttft_seconds_count") + 1
    assert metric(a, "kvstitch_completion_tokens_total") == \
        metric(before, "kvstitch_completion_tokens_total") + r.json()["usage"]["completion_tokens"]
    ext = r.json()["kvstitch"]
    assert metric(a, "kvstitch_store_hits_total") - metric(before, "kvstitch_store_hits_total") == ext["store_hits"]
    assert metric(a, "kvstitch_recompute_ratio_count") == metric(before, "kvstitch_recompute_ratio_count") + 1
    assert metric(a, "kvstitch_http_requests_total", path="/v1/chat/completions", code="400") >= 1
    assert metric(a, "kvstitch_queue_depth") == 0


def test_collection_request_retrieves_and_hits_precomputed_caches(client):
    body = chat_body(question="What is the special magic number for Carol?", documents=None,
                     collection="facts", top_k=2, method="naive", max_tokens=4)
    client.post("/v1/chat/completions", json=chat_body(method="naive", max_tokens=1))  # the system prompt's cache
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    ext = r.json()["kvstitch"]
    assert [h["rank"] for h in ext["retrieved"]] == [0, 1]
    assert ext["retrieved"][0]["doc"] == "carol.txt"
    # `kvstitch index` precomputed the chunks (for the conversation layout too); + the system prompt segment
    assert ext["store_hits"] == 3 and ext["store_misses"] == 0


# ---- warm vs cold ------------------------------------------------------------------------------------
def test_second_request_over_same_documents_hits_store_and_is_faster(client):
    tag = uuid.uuid4().hex[:8]  # documents no earlier test (or run) has put in the store
    docs = [f"Report {tag}-{i}. " + " ".join(f"The {w} of district {i} grew by {i * 7 + j} percent in {tag}."
                                             for j, w in enumerate(["trade", "rainfall", "population", "output",
                                                                    "traffic", "tourism", "housing", "energy"]))
            for i in range(8)]
    m0 = client.get("/metrics").text
    body = chat_body(question="Which district grew fastest?", documents=docs, method="naive", max_tokens=2)
    cold = client.post("/v1/chat/completions", json=body).json()["kvstitch"]
    warm = client.post("/v1/chat/completions", json=body).json()["kvstitch"]
    m1 = client.get("/metrics").text
    print(f"\n[warm-vs-cold] {cold['context_tokens']} context tokens in 8 chunks, naive: "
          f"cold TTFT {cold['ttft_s'] * 1000:.1f} ms (misses {cold['store_misses']}), "
          f"warm TTFT {warm['ttft_s'] * 1000:.1f} ms (hits {warm['store_hits']}), "
          f"speedup {cold['ttft_s'] / warm['ttft_s']:.2f}x")
    # 8 passages + the system prompt's segment (a hit in the cold request when an earlier test cached it)
    assert cold["store_misses"] == 8 - (cold["store_hits"] - 1) and cold["store_hits"] in (0, 1)
    assert (warm["store_hits"], warm["store_misses"]) == (9, 0)
    assert metric(m1, "kvstitch_store_hits_total") - metric(m0, "kvstitch_store_hits_total") == 9 + cold["store_hits"]
    assert metric(m1, "kvstitch_store_misses_total") - metric(m0, "kvstitch_store_misses_total") == \
        cold["store_misses"]
    assert warm["ttft_s"] < cold["ttft_s"]


# ---- disconnects -------------------------------------------------------------------------------------
def _wait_metric(client, name, target, timeout=30.0):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        text = client.get("/metrics").text
        if metric(text, name) >= target:
            return text
        time.sleep(0.05)
    raise AssertionError(f"{name} did not reach {target}")


def test_streaming_client_disconnect_stops_generation(client, server):
    m0 = client.get("/metrics").text
    cancelled0, gen0 = metric(m0, "kvstitch_cancelled_total"), metric(m0, "kvstitch_generated_tokens_total")
    body = chat_body(method="naive", max_tokens=1500, stream=True)
    with httpx.Client(base_url=server.url, timeout=60) as c2:
        with c2.stream("POST", "/v1/chat/completions", json=body) as s:
            assert s.status_code == 200
            for n, _ in enumerate(s.iter_lines()):
                if n >= 4:
                    break  # leave after a few events: closes the connection
    t0 = time.monotonic()
    m1 = _wait_metric(client, "kvstitch_cancelled_total", cancelled0 + 1)
    stopped_s = time.monotonic() - t0
    generated = metric(m1, "kvstitch_generated_tokens_total") - gen0
    assert generated < 1500  # stopped long before the cap
    r = client.post("/v1/chat/completions", json=chat_body(method="naive", max_tokens=2))
    assert r.status_code == 200  # the worker is free again
    print(f"\n[disconnect/sse] stopped after {int(generated)} of 1500 tokens, {stopped_s * 1000:.0f} ms after close")


def test_json_client_disconnect_stops_generation(client, server):
    cancelled0 = metric(client.get("/metrics").text, "kvstitch_cancelled_total")
    with httpx.Client(base_url=server.url, timeout=httpx.Timeout(60, read=1.0)) as c2:
        with pytest.raises(httpx.ReadTimeout):
            c2.post("/v1/chat/completions", json=chat_body(method="naive", max_tokens=1500))
    _wait_metric(client, "kvstitch_cancelled_total", cancelled0 + 1)
    assert client.post("/v1/chat/completions", json=chat_body(method="naive", max_tokens=2)).status_code == 200


# ---- load --------------------------------------------------------------------------------------------
def test_bounded_load_all_answered_or_429(client, server):
    n_clients = 32
    m0 = client.get("/metrics").text

    async def one(ac: httpx.AsyncClient, i: int):
        body = chat_body(method="naive", max_tokens=12, stream=bool(i % 2))
        if i % 2:
            async with ac.stream("POST", "/v1/chat/completions", json=body) as s:
                if s.status_code != 200:
                    await s.aread()
                    return s.status_code, s.headers.get("retry-after"), json.loads(s.content)
                lines = [ln async for ln in s.aiter_lines() if ln]
                assert lines[-1] == "data: [DONE]"
                return 200, None, lines
        r = await ac.post("/v1/chat/completions", json=body)
        return r.status_code, r.headers.get("retry-after"), r.json()

    async def run():
        limits = httpx.Limits(max_connections=n_clients, max_keepalive_connections=n_clients)
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as ac:
            return await asyncio.wait_for(asyncio.gather(*(one(ac, i) for i in range(n_clients))), timeout=120)

    t0 = time.monotonic()
    results = asyncio.run(run())
    wall = time.monotonic() - t0
    codes = [r[0] for r in results]
    answered, rejected = codes.count(200), codes.count(429)
    print(f"\n[load] {n_clients} concurrent clients (max_queue={MAX_QUEUE}): {answered} answered, "
          f"{rejected} got 429, wall {wall:.2f} s")
    assert answered + rejected == n_clients, codes  # none lost, nothing else
    assert answered >= 1 and rejected >= 1
    for status, retry_after, body in results:
        if status == 429:
            assert int(retry_after) >= 1
            assert body["error"]["code"] == "queue_full" and body["error"]["type"] == "rate_limit_error"
    h = client.get("/health").json()
    assert h["status"] == "ok" and h["queue_depth"] == 0 and h["busy"] is False
    m1 = client.get("/metrics").text
    assert metric(m1, "kvstitch_rejected_total") - metric(m0, "kvstitch_rejected_total") == rejected
    assert metric(m1, "kvstitch_chat_requests_total", outcome="ok") - \
        metric(m0, "kvstitch_chat_requests_total", outcome="ok") == answered
    assert client.post("/v1/chat/completions", json=chat_body(method="naive", max_tokens=2)).status_code == 200


# ---- the serve command (the lead wires it into kvstitch.cli.main) -----------------------------------------
def test_serve_command_rejects_unknown_method_before_loading():
    import typer
    from typer.testing import CliRunner

    from kvstitch.cli.serve import serve_command

    app = typer.Typer()
    app.command("serve")(serve_command)
    app.command("noop")(lambda: None)
    runner = CliRunner()
    r = runner.invoke(app, ["serve", "--help"])
    assert r.exit_code == 0 and "--max-queue" in r.output and "--ratio" in r.output
    r = runner.invoke(app, ["serve", "--method", "nope"])
    assert r.exit_code != 0 and "unknown method 'nope'" in str(r.exception)


# ---- engine failures ---------------------------------------------------------------------------------
class _FailingEngine:
    """The tiny engine, except that `steps` fails after its first token (or before, for 'early')."""

    def __init__(self, engine):
        self._engine = engine

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def steps(self, request, **kw):
        if request.messages[-1]["content"].startswith("early"):
            raise RuntimeError("boom before the first token")
        gen = self._engine.steps(request, **kw)
        ev = next(gen)
        while not isinstance(ev, int):  # a recompute pass (batch_prefill): the worker runs it, sends its logits
            ev = gen.send((yield ev))
        yield ev
        gen.close()
        raise RuntimeError("boom mid-stream")


def test_engine_failure_is_reported_and_the_worker_survives(engine):
    app = create_app(_FailingEngine(engine), default_method="naive", max_queue=2, max_body_bytes=20_000)
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=60) as c:
        r = c.post("/v1/chat/completions", json=chat_body(documents=["x" * 30_000]))
        assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
        r = c.post("/v1/chat/completions", json=chat_body())
        assert r.status_code == 500 and "boom mid-stream" in r.json()["error"]["message"]
        r = c.post("/v1/chat/completions", json=chat_body(question="early?", stream=True))
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
        with c.stream("POST", "/v1/chat/completions", json=chat_body(stream=True)) as s:
            assert s.status_code == 200  # headers went out with the first token
            events = [json.loads(ln[6:]) for ln in s.iter_lines() if ln.startswith("data: {")]
        assert "boom mid-stream" in events[-1]["error"]["message"]
        assert c.get("/health").json()["status"] == "ok"
        assert metric(c.get("/metrics").text, "kvstitch_chat_requests_total", outcome="error") == 3


def test_queue_admission_counts_the_running_job():
    from kvstitch.serve.jobs import Job, QueueFull
    from kvstitch.serve.prometheus import Metrics
    from kvstitch.serve.worker import EngineWorker

    loop = asyncio.new_event_loop()
    try:
        w = EngineWorker(engine=None, max_queue=0, metrics=Metrics())  # not started: jobs stay queued
        w.submit(Job({}, loop))  # an idle server takes one job even with max_queue=0
        with pytest.raises(QueueFull) as e:
            w.submit(Job({}, loop))
        assert e.value.retry_after >= 1
        w2 = EngineWorker(engine=None, max_queue=2, metrics=Metrics())
        w2.active.append(object())  # one running ...
        w2.submit(Job({}, loop))
        w2.submit(Job({}, loop))  # ... two waiting
        with pytest.raises(QueueFull):
            w2.submit(Job({}, loop))
        assert w2.waiting == 2
    finally:
        loop.close()
