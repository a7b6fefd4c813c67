"""The server's adaptive budget ("ratio": "auto"), the per-request guard and the sampled guard in /metrics."""

from __future__ import annotations

import httpx
import pytest

from kvstitch.engine.budget import AutoBudget
from kvstitch.serve.server import create_app
from kvstitch.serve.testing import ServerThread

from .conftest import SAMPLE_CHUNKS, SAMPLE_QUESTION, make_tiny_engine


@pytest.fixture(scope="module")
def engine(smollm_tokenizer):
    return make_tiny_engine("llama", smollm_tokenizer)


@pytest.fixture(scope="module")
def client(engine):
    app = create_app(engine, default_method="prophet", default_ratio="auto", max_queue=4, model_name="tiny",
                     guard_rate=1.0)
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=120) as c:
        yield c


def body(**kw):
    b = {"model": "tiny", "messages": [{"role": "user", "content": SAMPLE_QUESTION}], "documents": SAMPLE_CHUNKS,
         "max_tokens": 6, "auto": {"min_context": 0}}  # short test prompts: make the rounds run
    b.update(kw)
    return b


def test_auto_is_the_default_and_reports_rounds(client, engine):
    r = client.post("/v1/chat/completions", json=body())
    assert r.status_code == 200, r.text
    ext = r.json()["kvstitch"]
    assert ext["ratio"] == "auto" and isinstance(ext["converged"], bool) and ext["rounds"] >= 1
    assert 0 < ext["ratio_used"] <= 1.0
    direct = engine.generate(messages=[{"role": "user", "content": SAMPLE_QUESTION}], chunks=SAMPLE_CHUNKS,
                             method="prophet", recompute_ratio=AutoBudget(min_context=0), max_new_tokens=6,
                             guard="full")
    assert r.json()["choices"][0]["message"]["content"] == direct.text


@pytest.mark.parametrize("value", ["automatic", 1.5, -0.1, True, [0.2], {"auto": 1}])
def test_malformed_ratio_is_a_400_naming_it(client, value):
    r = client.post("/v1/chat/completions", json=body(ratio=value))
    assert r.status_code == 400 and r.json()["error"]["param"] == "ratio", r.text


def test_guard_rate_one_checks_every_greedy_request_and_counts_it(client, engine):
    before = client.get("/metrics").text
    r = client.post("/v1/chat/completions", json=body(method="random", ratio=0.0))
    assert r.status_code == 200
    g = r.json()["kvstitch"]["guard"]
    full = engine.generate(messages=[{"role": "user", "content": SAMPLE_QUESTION}], chunks=SAMPLE_CHUNKS,
                           method="full", max_new_tokens=6)
    assert r.json()["choices"][0]["message"]["content"] == full.text  # the guarded answer is full prefill's
    after = client.get("/metrics").text

    def count(text, name):
        line = next(x for x in text.splitlines() if x.startswith(name + " "))
        return float(line.split()[-1])

    assert count(after, "kvstitch_guard_checks_total") == count(before, "kvstitch_guard_checks_total") + 1
    assert count(after, "kvstitch_guard_disagreements_total") - count(before, "kvstitch_guard_disagreements_total") \
        == (0 if g["agreed"] else 1)
    bad = client.post("/v1/chat/completions", json=body(guard="always"))
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "guard"
    bad = client.post("/v1/chat/completions", json=body(auto={"tol": -1}))
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "auto"
