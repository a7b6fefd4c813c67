"""`kvstitch serve --replicas 2` on a local Ray Serve (2 CPUs, loopback) over the tiny llama: the answers are the
single server's, a repeat of a request's passages goes to the replica holding them, a killed replica loses no
accepted request. Ray is installed by scripts/setup.sh (the `kvstitch[ray]` extra): without it these tests FAIL."""

from __future__ import annotations

import functools
import json
import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch

import ray  # noqa: E402 - required, not skipped
from ray import serve

from kvstitch.cli.serve import _load_engine
from kvstitch.engine.request import DEFAULT_METHOD
from kvstitch.serve.replica import replica_store
from kvstitch.serve.replicas import ATTEMPTS_HEADER, REPLICA_HEADER, serve_replicas
from kvstitch.serve.server import create_app
from kvstitch.serve.testing import ServerThread

from .conftest import make_tiny_engine

OPTIONS = dict(default_method=DEFAULT_METHOD, default_ratio=0.2, max_queue=16, model_name="tiny", max_batch=4)
WORDS = ("river bank stone garden window copper lantern harbor meadow violet signal orchard thunder pencil "
         "marble canyon ribbon falcon cactus glacier").split()


def passages(seed: int, n: int = 2) -> list[str]:
    import random

    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(40)).capitalize() + "." for _ in range(n)]


def body(docs, question="Which words come first?", **kw):
    return {"model": "tiny", "messages": [{"role": "system", "content": "Answer briefly."},
                                          {"role": "user", "content": question}],
            "documents": docs, "max_tokens": 8, **kw}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, smollm_tokenizer):
    d = tmp_path_factory.mktemp("tiny-llama")
    make_tiny_engine("llama", smollm_tokenizer).model.save_pretrained(d)
    smollm_tokenizer.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def reference(tiny_dir, tmp_path_factory):
    """The single-process server over the same model (one torch thread, as in the replicas)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    eng = _load_engine(str(tiny_dir), str(tmp_path_factory.mktemp("ref-store")), None, "stitched", None, None)
    with ServerThread(create_app(eng, **OPTIONS)) as srv, httpx.Client(base_url=srv.url, timeout=120) as c:
        yield c
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def cluster(tiny_dir, tmp_path_factory):
    root = str(Path(__file__).resolve().parents[1])
    env = {"PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p),
           "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=100 << 20,
             runtime_env={"env_vars": env})
    store = replica_store(str(tmp_path_factory.mktemp("shared-store")))  # the shared store, a memory tier each
    load = functools.partial(_load_engine, str(tiny_dir), store, None, "stitched", None, None)
    port = _port()
    # slack=None: with a handful of requests the bounded-load rule would spill on purpose (tests/test_route_live.py)
    serve_replicas(load, OPTIONS, 2, host="127.0.0.1", port=port, blocking=False, replica_cpus=0.5,
                   stats_period_s=0.5, accept_timeout_s=60.0, router_options={"slack": None})
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=300) as c:
        _wait(lambda: c.get("/health").json().get("healthy") == 2, 300)
        yield c
    serve.shutdown()
    ray.shutdown()


def _wait(cond, timeout: float):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        try:
            if cond():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError("timed out")


def _answer(client, b) -> tuple[str, httpx.Response]:
    r = client.post("/v1/chat/completions", json=b)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"], r


def _held(cluster) -> int:
    return sum(h["held_passages"] for h in cluster.get("/health").json()["by_replica"].values())


@pytest.mark.long
def test_answers_equal_the_single_server_and_repeats_go_where_the_passages_are(cluster, reference):
    sets = [passages(i) for i in range(4)]
    first = {}
    for i, docs in enumerate(sets):
        text, r = _answer(cluster, body(docs))
        assert text == _answer(reference, body(docs))[0]
        first[i] = r.headers[REPLICA_HEADER]
    assert len(set(first.values())) == 2, first  # nothing held yet: power-of-two spreads them
    _wait(lambda: _held(cluster) >= 2 * len(sets), 60)  # the digests reached the router
    for i, docs in enumerate(sets):
        text, r = _answer(cluster, body(docs, question="And which come last?"))
        assert text == _answer(reference, body(docs, question="And which come last?"))[0]
        assert r.headers[REPLICA_HEADER] == first[i]  # routed to the replica holding the passages


@pytest.mark.long
def test_streaming_health_and_metrics_per_replica(cluster, reference):
    docs = passages(10)
    want = _answer(reference, body(docs))[0]
    with cluster.stream("POST", "/v1/chat/completions", json=body(docs, stream=True)) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    text = "".join((json.loads(e)["choices"] or [{}])[0].get("delta", {}).get("content", "") or ""
                   for e in events[:-1])
    assert text == want
    h = cluster.get("/health").json()
    assert h["status"] == "ok" and h["replicas"] == 2
    metrics = cluster.get("/metrics").text
    names = set(h["by_replica"])
    assert all(f'kvstitch_chat_requests_total{{replica="{n}",' in metrics for n in names), metrics[:2000]
    assert "kvstitch_replicas 2" in metrics
    assert cluster.post("/v1/chat/completions", content=b"{").status_code == 400  # the replica's own checks


def _busy_replica(cluster) -> str | None:
    """A replica whose last report shows requests in flight."""
    by = cluster.get("/health").json()["by_replica"]
    return next((name for name, h in by.items() if h.get("active", 0) > 0), None)


@pytest.mark.long
def test_a_killed_replica_loses_no_accepted_request(cluster, reference):
    bodies = [body(passages(100 + i), max_tokens=400, min_tokens=400) for i in range(8)]
    want = [_answer(reference, b)[0] for b in bodies]
    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(cluster.post, "/v1/chat/completions", json=b) for b in bodies]
        _wait(lambda: _busy_replica(cluster) is not None, 60)
        victim = _busy_replica(cluster)  # killed with requests in flight
        ray.kill(ray.get_actor(f"SERVE_REPLICA::kvstitch#kvstitch-model#{victim}", namespace="serve"), no_restart=True)
        got = [f.result() for f in futures]
    assert [r.status_code for r in got] == [200] * 8, [r.text for r in got if r.status_code != 200]
    assert [r.json()["choices"][0]["message"]["content"] for r in got] == want
    assert any(r.headers[ATTEMPTS_HEADER] != "1" for r in got)  # retried on the other replica
    assert all(r.headers[REPLICA_HEADER] != victim for r in got if r.headers[ATTEMPTS_HEADER] != "1")
    # Serve replaces the replica; the router's view takes it back and it serves again
    _wait(lambda: cluster.get("/health").json().get("healthy") == 2 and victim not in
          cluster.get("/health").json()["by_replica"], 300)
    replicas = {_answer(cluster, body(passages(200 + i)))[1].headers[REPLICA_HEADER] for i in range(8)}
    assert len(replicas) == 2 and victim not in replicas
