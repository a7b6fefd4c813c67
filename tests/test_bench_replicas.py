"""`kvstitch bench replicas`: the trace, its working set, the memory sizing and the report without a cluster, the
per-chunk sources a tiered store reports, and (long) the whole bench on a local Ray Serve over the tiny llama."""

from __future__ import annotations

import json

import pytest

from kvstitch.bench.replica_trace import (MAX_SPREAD, SYSTEM, replicas_table, router_row, squad_pool, tier_bytes,
                                          token_bytes, trace_bodies, verdict, working_set)
from kvstitch.store import MemoryStore, TieredStore, open_store

from .conftest import make_tiny_engine

POOL = [[(f"Doc {d} passage {i} " + "word " * 20, (f"Question {d}.{i}?",)) for i in range(4)] for d in range(6)]


def test_trace_is_seeded_and_names_its_passages():
    a = trace_bodies(POOL, 30, 3, 1.0, seed=1)
    assert a == trace_bodies(POOL, 30, 3, 1.0, seed=1) and a != trace_bodies(POOL, 30, 3, 1.0, seed=2)
    texts = {p for doc in POOL for p, _ in doc}
    for b in a:
        assert 1 <= len(b["documents"]) <= 3 and set(b["documents"]) <= texts
        assert b["messages"][0] == {"role": "system", "content": SYSTEM} and b["temperature"] == 0
        first = next((d, i) for d, doc in enumerate(POOL) for i, (p, _) in enumerate(doc) if p == b["documents"][0])
        assert b["messages"][1]["content"] == POOL[first[0]][first[1]][1][0]  # a question of its first passage
    with pytest.raises(Exception, match="passages-per-request"):
        trace_bodies(POOL, 5, 5, 1.0)


def test_squad_pool_passages_are_short_and_questioned():
    pool = squad_pool(4, 3, seed=0)
    assert len(pool) == 4 and all(len(doc) == 3 for doc in pool)
    assert all(60 <= len(p.split()) <= 150 and qs for doc in pool for p, qs in doc)
    assert pool == squad_pool(4, 3, seed=0)


def test_working_set_and_memory_sizing():
    bodies = [{"documents": ["a b", "c"]}, {"documents": ["c", "d e f"]}]
    assert working_set(bodies, lambda t: len(t.split())) == {"passages": 3, "tokens": 6}
    # SmolLM2-135M in float32: 30 layers x 3 KV heads x 64 x 2 (K and V) x 4 bytes, + the token id
    assert token_bytes(30, 3, 64, 4) == 30 * 3 * 64 * 2 * 4 + 8
    assert tier_bytes(9, 100) == 300 and tier_bytes(10, 100) == 400 and tier_bytes(9, 100, reserve_tokens=5) == 800


def _result(replica, sources, text="x", ttft=0.1):
    return {"status": 200, "replica": replica, "chunk_sources": ["memory", *sources], "text": text, "ttft_s": ttft,
            "server_ttft_s": ttft / 2}


def test_the_ideal_is_one_shared_memory_replayed():
    """Repeats hit once the memory holds them; a memory holding everything misses only first sightings; a smaller
    one misses more."""
    from kvstitch.bench.replica_trace import ideal_hit_rate

    bodies = [{"documents": d} for d in (["a", "b"], ["a", "c"], ["b", "a"], ["d", "a"])]
    assert ideal_hit_rate(bodies, lambda p: 10, 1, capacity=1000) == 4 / 8  # a, b, a, a hit; a, b, c, d first seen
    assert ideal_hit_rate(bodies, lambda p: 10, 1, capacity=10) < 4 / 8


def test_router_rows_and_verdict():
    ref = ["x"] * 4
    aff = router_row("chunk-affinity", [_result("a", ["store", "store"]), _result("b", ["store"]),
                                        _result("a", ["memory", "memory"]), _result("b", ["memory"], ttft=0.2)], ref, 2)
    assert (aff["local_hits"], aff["shared_hits"], aff["passages"]) == (3, 3, 6)  # segment 0 left out
    assert aff["local_hit_rate"] == 0.5 and aff["max_over_mean"] == 1.0 and aff["answers_equal"]
    assert aff["ttft_p50_s"] == 0.1 and aff["per_replica"] == {"a": 2, "b": 2}
    base = router_row("default", [_result("a", ["store", "store"]), _result("a", ["store"]),
                                  _result("a", ["memory", "store"], text="y"), None], ref, 2)
    assert base["local_hit_rate"] == 1 / 5 and base["max_over_mean"] == 2.0
    assert not base["answers_equal"] and base["differ"] == [2] and base["sent"] == 3
    v = verdict([aff, base])
    assert v["hit_rate_ratio"] == 2.5 and v["ratio_ok"] and v["ttft_p50_ok"] and v["spread_ok"]
    assert not v["answers_equal"] and aff["max_over_mean"] <= MAX_SPREAD
    table = replicas_table([aff, base], {"verdict": v, "model": "tiny", "replicas": 2, "threads": 1,
                                         "memory_bytes": 1 << 20, "working_set_bytes": 3 << 20})
    assert "| chunk-affinity | 4 | 4 | 50.0% (3/6) |" in table and "2.50x" in table and "no (1 differ, 1 lost)" in table


def test_chunk_sources_say_which_tier_served(smollm_tokenizer, tmp_path):
    base = make_tiny_engine("llama", smollm_tokenizer)
    from kvstitch import Engine

    store = open_store(f"tiered:{tmp_path}", storage_dtype="float32")
    assert isinstance(store, TieredStore) and isinstance(store.tiers[0], MemoryStore)
    eng = Engine(base.model, base.tokenizer, weights_id="tiny-llama", store=store, check_rope=False,
                 cold_path="stitched")  # every chunk through the store, the missing ones computed
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Which?"}]
    docs = ["The river runs past the old mill.", "A copper lantern hangs by the door."]

    def sources():
        return eng.generate(messages=msgs, chunks=docs, method="random", max_new_tokens=2).stats.chunk_sources

    assert sources() == ["computed"] * 3
    assert sources() == ["memory"] * 3
    store.tiers[0].gc(0)  # the memory tier emptied: the directory behind it serves
    assert sources() == ["store"] * 3


def test_cli_refuses_bad_counts_before_loading(tmp_path):
    from typer.testing import CliRunner

    from kvstitch.cli.bench import bench_app

    for args in (["--threads", "0"], ["--replicas", "0"], ["--requests", "0"], ["--mix", "2"]):
        res = CliRunner().invoke(bench_app, ["replicas", *args, "--out", str(tmp_path)])
        assert res.exit_code == 2, res.output


@pytest.mark.long
def test_bench_replicas_on_the_tiny_model(tmp_path_factory, smollm_tokenizer):
    from kvstitch.bench.replicas import bench_replicas

    d = tmp_path_factory.mktemp("tiny-llama")
    make_tiny_engine("llama", smollm_tokenizer).model.save_pretrained(d)
    smollm_tokenizer.save_pretrained(d)
    # a pause between requests lets each replica's digest reach the router before the next request
    rows, meta = bench_replicas(str(d), n_requests=12, n_docs=4, k=2, zipf=1.2, per_doc=3, max_tokens=4,
                                interval_s=1.2, router_options={"slack": None})
    by = {r["router"]: r for r in rows}
    assert set(by) == {"chunk-affinity", "default"}
    assert all(r["answered"] == 12 and r["answers_equal"] for r in rows), [r["differ"] for r in rows]
    assert all(r["computed"] == 0 and r["passages"] > 0 for r in rows)  # the shared store held every passage
    assert by["chunk-affinity"]["local_hit_rate"] >= by["default"]["local_hit_rate"], replicas_table(rows, meta)
    assert meta["memory_bytes"] < meta["working_set_bytes"] and meta["verdict"]["answers_equal"]
    json.dumps({"rows": rows, "meta": meta})  # what write_results writes
