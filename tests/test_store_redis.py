"""Redis backend against a real `redis-server` (loopback, no persistence), and its failure modes.

redis-server must be installed (CI: `apt-get install -y redis-server`): without it these tests FAIL.
"""

from __future__ import annotations

import logging
import socket
import threading
import time

import pytest
import torch

from kvstitch.core.errors import StoreError
from kvstitch.store import DiskStore, MemoryStore, RedisStore, TieredStore, chunk_key, open_store
from kvstitch.store import codec

from .conftest import free_port

FP = "model-A"


def make_kv(seed=0, n=16, fingerprint=FP):
    from kvstitch.core.chunk import ChunkKV

    g = torch.Generator().manual_seed(seed)
    return ChunkKV(torch.randn(3, 2, n, 8, generator=g) * 8, torch.randn(3, 2, n, 8, generator=g),
                   torch.arange(n), 4, fingerprint)


def key_of(i, dtype="float16"):
    return chunk_key(FP, [1], [i], dtype)


@pytest.fixture
def rstore(redis_url, request):
    s = RedisStore(redis_url, prefix=f"kvstitch:test:{request.node.name}:")
    for k in s.keys():
        s.delete(k)
    yield s
    for k in s.keys():
        s.delete(k)
    s.close()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "int8"])
def test_redis_roundtrip(redis_url, dtype):
    s = RedisStore(redis_url, storage_dtype=dtype, prefix=f"kvstitch:rt-{dtype}:")
    kv = make_kv()
    s.put(key_of(0, dtype), kv)
    got = s.get(key_of(0, dtype))
    if dtype == "int8":
        assert torch.equal(got.keys, codec.roundtrip(kv, "int8").keys)
    else:
        dt = getattr(torch, dtype)
        assert torch.equal(got.keys, kv.keys.to(dt)) and torch.equal(got.values, kv.values.to(dt))
    assert torch.equal(got.token_ids, kv.token_ids) and got.start == 4 and key_of(0, dtype) in s
    got.keys.add_(1)  # writable, and does not alias anything redis-py keeps
    assert s.get(key_of(1, dtype)) is None and s.delete(key_of(0, dtype)) and key_of(0, dtype) not in s


@pytest.mark.parametrize("how", ["truncated", "bitflip", "foreign"])
def test_redis_damaged_entry_is_a_miss_reported_once_and_overwritten(rstore, caplog, how):
    kv = make_kv()
    blob = bytearray(codec.encode_bytes(key_of(0), make_kv(fingerprint="model-B") if how == "foreign" else kv))
    if how == "truncated":
        blob = blob[:-1000]
    elif how == "bitflip":
        blob[-50] ^= 0x10
    rstore.put_raw(key_of(0), bytes(blob))
    rstore.fingerprint = FP
    caplog.set_level(logging.WARNING, logger="kvstitch.store")
    assert rstore.lookup(key_of(0)) is None and rstore.lookup(key_of(0)) is None
    assert len(rstore.problems) == 1 and sum(key_of(0) in r.getMessage() for r in caplog.records) == 1
    assert [k for k, _ in rstore.verify()] == [key_of(0)]
    rstore.put(key_of(0), kv)
    assert torch.equal(rstore.get(key_of(0)).keys, kv.keys.half()) and rstore.verify() == []


def test_redis_stats_and_gc(rstore):
    for i in range(4):
        rstore.put(key_of(i), make_kv(i))
    st = rstore.stats()
    size = st["bytes"] // 4
    assert st["entries"] == 4 and st["by_dtype"]["float16"]["tokens"] == 64
    assert st["by_dtype"]["float16"]["bytes_per_token"] == pytest.approx(size / 16, rel=0.01)
    r = rstore.gc(2 * size + 10)
    assert r["removed"] == 2 and len(rstore.keys()) == 2
    assert rstore.gc(0)["entries"] == 0 and rstore.keys() == []


def test_redis_unreachable_is_a_quick_store_error():
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    t = time.monotonic()
    with pytest.raises(StoreError, match="unavailable"):
        open_store(url)
    s = RedisStore(url)
    for call in (lambda: s.get(key_of(0)), lambda: s.put(key_of(0), make_kv()), lambda: key_of(0) in s):
        with pytest.raises(StoreError, match=r"Redis at redis://127\.0\.0\.1:\d+/0 unavailable"):
            call()
    assert time.monotonic() - t < 3


def test_redis_that_accepts_but_never_answers_times_out():
    """A hung server (accepts the TCP connection, never replies): the socket timeout fires, no hang."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    conns = []
    stop = threading.Event()

    def accept():
        srv.settimeout(0.1)
        while not stop.is_set():
            try:
                conns.append(srv.accept()[0])
            except OSError:
                pass
    th = threading.Thread(target=accept, daemon=True)
    th.start()
    try:
        s = RedisStore(f"redis://127.0.0.1:{srv.getsockname()[1]}/0", timeout=0.3)
        t = time.monotonic()
        with pytest.raises(StoreError, match="unavailable"):
            s.get(key_of(0))
        assert time.monotonic() - t < 2
    finally:
        stop.set()
        th.join()
        for c in conns:
            c.close()
        srv.close()


def test_tiered_falls_back_when_redis_is_down(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="kvstitch.store")
    t = open_store(f"tiered:memory,{tmp_path / 'd'},redis://127.0.0.1:{free_port()}/0")
    assert [type(x) for x in t.tiers] == [MemoryStore, DiskStore, RedisStore]
    kv = make_kv()
    t0 = time.monotonic()
    t.put(key_of(0), kv)  # memory + disk take it; Redis failure is logged, not raised
    assert t.lookup(key_of(1)) is None and t.misses == 1  # a miss: the caller recomputes
    assert t.lookup(key_of(0)) is not None and key_of(0) in t.tiers[1]
    assert time.monotonic() - t0 < 3
    assert len(t.tier_errors) == 1 and "unavailable" in t.tier_errors[0]  # then skipped for retry_after_s
    assert sum("skipping it" in r.getMessage() for r in caplog.records) == 1
    assert t.stats()["tier_errors"] == 1
    only_redis = TieredStore([RedisStore(f"redis://127.0.0.1:{free_port()}/0")])
    assert only_redis.get(key_of(0)) is None
    with pytest.raises(StoreError, match="no tier accepted"):
        TieredStore([RedisStore(f"redis://127.0.0.1:{free_port()}/0")]).put(key_of(0), kv)


def test_tiered_promotes_from_redis_into_disk_and_memory(redis_url, tmp_path):
    prefix = "kvstitch:tier-test:"
    shared = RedisStore(redis_url, prefix=prefix)
    kv = make_kv(3)
    shared.put(key_of(3), kv)  # written by another worker
    t = TieredStore([MemoryStore(), DiskStore(tmp_path / "d"), RedisStore(redis_url, prefix=prefix)])
    got = t.lookup(key_of(3))
    assert torch.equal(got.keys, kv.keys.half()) and t.tier_hits == [0, 0, 1]
    assert key_of(3) in t.tiers[0] and key_of(3) in t.tiers[1]
    assert t.lookup(key_of(3)) is not None and t.tier_hits == [1, 0, 1]
    shared.delete(key_of(3))


def test_cli_against_redis(redis_url):
    from typer.testing import CliRunner

    from kvstitch.cli.store import store_app

    s = RedisStore(redis_url)  # the CLI looks at the default prefix
    s.put(key_of(7), make_kv())
    r = CliRunner().invoke(store_app, ["stats", redis_url])
    assert r.exit_code == 0 and "float16" in r.output
    assert CliRunner().invoke(store_app, ["verify", redis_url]).exit_code == 0
    s.put_raw(key_of(7), b"junk" * 10)
    r = CliRunner().invoke(store_app, ["verify", redis_url])
    assert r.exit_code == 1 and key_of(7)[:20] in r.output
    assert CliRunner().invoke(store_app, ["gc", redis_url, "--max-bytes", "0"]).exit_code == 0
    assert s.keys() == []


def test_bench_includes_redis(redis_url, tmp_path):
    from kvstitch.bench.store import bench_store

    rows = bench_store([redis_url], n_layers=2, n_kv_heads=1, head_dim=16, n_tokens=8, dtypes=["float16"],
                       n_entries=2, repeats=1)
    assert rows[0]["backend"] == "RedisStore" and rows[0]["get_warm_gbps"] > 0 and rows[0]["get_cold_gbps"] is None
    assert RedisStore(redis_url, prefix="kvstitch:bench:").keys() == []
