"""The live chunk-affinity router's choice over fake replicas and digests (no Ray cluster), the replica's
digest, the ingress's merged /metrics and the `--replicas` errors."""

from __future__ import annotations

import asyncio
import sys
from collections import Counter

import pytest

from kvstitch.core.errors import InputError
from kvstitch.route.live import LiveRouter, passage_key, request_chunks
from kvstitch.route.view import BloomFilter
from kvstitch.serve.replica import PassageDigest, call_asgi, memory_tier, replica_store
from kvstitch.serve.replicas import check_replicas, label_metrics

DOCS = ["The river bank is made of stone.", "Copper lanterns light the harbor.", "Violet meadows after thunder."]


def test_request_chunks_key_passages_by_text():
    chunks = request_chunks(DOCS)
    assert [k for k, _ in chunks] == [passage_key(d) for d in DOCS]
    assert all(t >= 1 for _, t in chunks) and len({k for k, _ in chunks}) == 3
    assert request_chunks(None) == () and request_chunks("not a list") == ()


def test_a_request_goes_to_the_replica_whose_digest_holds_its_passages():
    live = LiveRouter(replicas=3, seed=0)
    a, b = request_chunks(DOCS[:2]), request_chunks(DOCS[2:])
    live.sync({"r1": {"digest": [k for k, _ in a], "version": 1}, "r2": {"digest": [k for k, _ in b], "version": 1},
               "r3": {}})
    for _ in range(5):
        assert live.rank(a, ["r1", "r2", "r3"])[0] == "r1"
        assert live.rank(b, ["r1", "r2", "r3"])[0] == "r2"
    assert live.held(a) == {"r1": sum(t for _, t in a)}
    # a Bloom digest counts as well
    live.sync({"r1": {}, "r2": {}, "r3": {"digest": BloomFilter.of([k for k, _ in a]), "version": 2}})
    assert live.rank(a, ["r1", "r2", "r3"])[0] == "r3"


def test_nothing_held_is_power_of_two_choices_by_queue():
    live = LiveRouter(replicas=2, seed=0)
    live.sync({"r1": {}, "r2": {}})
    for _ in range(3):
        live.placed("r1")
    picks = Counter(live.rank(request_chunks(DOCS), ["r1", "r2"])[0] for _ in range(20))
    assert picks == {"r2": 20}  # the two choices are both replicas: the shorter queue wins
    live = LiveRouter(replicas=2, seed=0)
    live.sync({"r1": {}, "r2": {}})
    picks = Counter(live.rank((), ["r1", "r2"])[0] for _ in range(40))
    assert set(picks) == {"r1", "r2"}  # equal queues: either


def test_a_long_queue_outweighs_held_tokens_and_a_dead_replica_is_forgotten():
    live = LiveRouter(replicas=2, seed=0, slack=None)
    a = request_chunks(DOCS)
    live.sync({"r1": {"digest": [k for k, _ in a], "version": 1}, "r2": {}})
    assert live.rank(a, ["r1", "r2"])[0] == "r1"
    for _ in range(10):
        live.placed("r1")
    assert live.rank(a, ["r1", "r2"])[0] == "r2"  # held tokens against queue x lam x mean tokens
    live.sync({"r2": {}})  # r1 died
    assert live.rank(a, ["r2"]) == ["r2"] and live.held(a) == {}
    live.sync({"r2": {}, "r1b": {"digest": [k for k, _ in a], "version": 1}})  # its replacement reports
    assert live.rank(a, ["r2", "r1b"])[0] == "r1b"
    live.sync({})
    assert live.choose(a) is None


def test_a_digest_is_applied_once_per_version():
    live = LiveRouter(replicas=1)
    a = request_chunks(DOCS[:1])
    live.sync({"r1": {"digest": [a[0][0]], "version": 1}})
    live.router.view.forget(0)
    live.sync({"r1": {"digest": [a[0][0]], "version": 1}})  # same version: not re-applied
    assert live.held(a) == {}
    live.sync({"r1": {"digest": [a[0][0]], "version": 2}})
    assert live.held(a) == {"r1": a[0][1]}


def test_replica_store_puts_a_memory_tier_in_front():
    assert replica_store(None) is None and replica_store("memory") == "memory"
    assert replica_store("redis://h:6379/0") == "tiered:redis://h:6379/0"
    assert replica_store("tiered:memory,/x") == "tiered:memory,/x"


def test_replica_digest_reports_what_its_memory_tier_holds(tmp_path):
    from kvstitch.store import open_store

    digest = PassageDigest(memory_tier(open_store(replica_store(str(tmp_path)))))
    digest.learn(request_chunks(DOCS), [f"{i:064x}" for i in range(3)])
    digest.tier._items[f"{0:064x}"] = object()  # held in memory
    rep = digest.report()
    assert rep["digest"] == [passage_key(DOCS[0])] and rep["version"] == 1 and rep["held_passages"] == 1
    assert digest.report()["version"] == 1  # unchanged
    digest.tier._items[f"{2:064x}"] = object()  # a cold request's chunk, stored later
    assert digest.report() == {"digest": [passage_key(DOCS[0]), passage_key(DOCS[2])], "version": 2,
                               "held_passages": 2}
    del digest.tier._items[f"{0:064x}"]  # evicted: it leaves the digest
    assert digest.report()["digest"] == [passage_key(DOCS[2])]
    assert PassageDigest(None).report()["digest"] == []


def test_call_asgi_runs_one_request_in_process():
    async def app(scope, receive, send):
        msg = await receive()
        await send({"type": "http.response.start", "status": 201, "headers": [(b"x-a", b"1")]})
        await send({"type": "http.response.body", "body": msg["body"][::-1], "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    async def run():
        return [x async for x in call_asgi(app, "POST", "/p", b"", [], b"abc")]

    assert asyncio.run(run()) == [("start", 201, [("x-a", "1")]), b"cba"]


def test_label_metrics_keeps_a_family_together():
    a = '# HELP k_total c\n# TYPE k_total counter\nk_total{m="x y"} 1\n# TYPE g gauge\ng 2\n'
    b = '# HELP k_total c\n# TYPE k_total counter\nk_total{m="z"} 3\n'
    text = label_metrics({"r1": a, "r2": b})
    lines = text.splitlines()
    assert lines[:4] == ['# HELP k_total c', '# TYPE k_total counter', 'k_total{replica="r1",m="x y"} 1',
                         'k_total{replica="r2",m="z"} 3']
    assert lines[4:] == ['# TYPE g gauge', 'g{replica="r1"} 2']


def test_replicas_errors(monkeypatch):
    from typer.testing import CliRunner

    from kvstitch.cli.main import app

    for bad in (0, -1, True, "2"):
        with pytest.raises(InputError, match="--replicas"):
            check_replicas(bad)
    out = CliRunner().invoke(app, ["serve", "--replicas", "0"])
    assert out.exit_code != 0 and "--replicas must be a positive integer" in out.output
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    monkeypatch.setitem(sys.modules, "ray.serve", None)
    out = CliRunner().invoke(app, ["serve", "--replicas", "2"])
    assert out.exit_code != 0 and "pip install 'kvstitch[ray]'" in out.output


def test_no_replica_left_is_a_503_with_retry_after(monkeypatch):
    from starlette.requests import Request

    from kvstitch.serve.replicas import Ingress

    ing = Ingress(model=None, retry_after_s=7)
    monkeypatch.setattr(ing, "_live", lambda: 0)  # the router knows no live replica
    body = b'{"messages": [{"role": "user", "content": "hi"}], "documents": ["a passage"]}'

    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "query_string": b"", "headers": [],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80), "scheme": "http", "root_path": ""}
    resp = asyncio.run(ing(Request(scope, receive)))
    assert resp.status_code == 503 and resp.headers["retry-after"] == "7"
    assert b"no_replica" in resp.body
    big = Ingress(model=None, max_body_bytes=4)
    assert asyncio.run(big(Request(scope, receive))).status_code == 413


def test_ray_request_router_ranks_fake_replicas_by_their_reports():
    from types import SimpleNamespace

    from kvstitch.route import live
    from kvstitch.serve.ray_router import ChunkAffinityRequestRouter, reports

    router = ChunkAffinityRequestRouter.__new__(ChunkAffinityRequestRouter)  # no Serve handle: the policy alone
    router._deployment_id = SimpleNamespace(name="fake-model")
    router.initialize_state(replicas=2, slack=None)
    chunks = request_chunks(DOCS)
    reps = [SimpleNamespace(replica_id=SimpleNamespace(unique_id=name), routing_stats=stats)
            for name, stats in (("a", {}), ("b", {"digest": [k for k, _ in chunks], "version": 1}))]
    router._replicas_list, router._replicas = reps, {r.replica_id.unique_id: r for r in reps}
    try:
        pending = SimpleNamespace(kwargs={"route": chunks})
        ranks = asyncio.run(router.choose_replicas(reps, pending))
        assert [[r.replica_id.unique_id for r in rank] for rank in ranks] == [["b"], ["a"]]
        assert asyncio.run(router.choose_replicas([], pending)) == []
        for _ in range(10):  # b's queue outweighs what it holds
            router.on_request_routed(pending, reps[1].replica_id, None)
        assert asyncio.run(router.choose_replicas(reps, pending))[0][0].replica_id.unique_id == "a"
        router.on_request_completed(reps[1].replica_id, "x")
        assert set(reports("fake-model")) == {"a", "b"} and reports("no-such") is None
    finally:
        live.ROUTERS.pop("fake-model", None)


def test_serve_replicas_flag_hands_ray_the_engine_loader_and_app_options(monkeypatch, tmp_path):
    from typer.testing import CliRunner

    from kvstitch.cli.main import app
    from kvstitch.serve import replicas as ray_replicas

    got = {}
    monkeypatch.setattr(ray_replicas, "serve_replicas", lambda load, opts, n, **kw: got.update(
        load=load, opts=opts, n=n, **kw))
    cfg = tmp_path / "kvstitch.toml"
    cfg.write_text("[serve]\nreplicas = 3\nmax-batch = 2\n")  # the config key
    out = CliRunner().invoke(app, ["serve", "--config", str(cfg), "--store", str(tmp_path / "kv"), "--port", "9"])
    assert out.exit_code == 0, out.output
    assert got["n"] == 3 and got["port"] == 9 and got["ray_address"] is None
    assert got["load"].args[1] == f"tiered:{tmp_path / 'kv'}"  # the shared store behind a memory tier each
    assert got["opts"]["max_batch"] == 2 and got["opts"]["security"].max_body_bytes == 32 << 20
