"""The memory tier's eviction policy: a reused set survives a scan of one-off chunks (S3-FIFO), LRU stays
available, pins are never evicted and the byte budget holds. No model: small fake entries."""

from __future__ import annotations

import json
import random

import pytest
import torch

from kvstitch.core.chunk import ChunkKV
from kvstitch.core.errors import StoreError
from kvstitch.store import MemoryStore, TieredStore, chunk_key, open_store
from kvstitch.store.policy import LRUPolicy, S3FIFOPolicy

from tests.scripts_loader import load_script


def _script():
    return load_script("scan_trace")


def kv(n: int = 4, fp: str = "m") -> ChunkKV:
    return ChunkKV(torch.zeros(1, 1, n, 4), torch.zeros(1, 1, n, 4), torch.arange(n), 0, fp)


def key(i: int) -> str:
    return chunk_key("m", [0], [i])


ONE = kv().nbytes  # float32 entries: put keeps them as they are


def mem(entries: float, policy: str = "s3fifo") -> MemoryStore:
    return MemoryStore(max_bytes=int(entries * ONE), storage_dtype="float32", policy=policy)


# -- the scan ----------------------------------------------------------------------------------------

def test_warm_set_survives_a_scan_that_lru_does_not():
    """200 warm passages asked at random while 2,000 one-off passages stream through a 300-entry tier."""
    m = _script()
    trace = m.make_trace(warm=200, novel=2000, novel_per_request=2, warm_per_request=3.0, seed=0)
    one = m.entry_bytes()
    res = {p: m.replay(MemoryStore(max_bytes=300 * one, policy=p), trace) for p in ("s3fifo", "lru")}
    s3, lru = res["s3fifo"], res["lru"]
    assert s3["warm_lookups"] > 2500 and s3["novel_lookups"] == 2000
    assert s3["warm_hit_rate"] >= 0.9 and s3["min_window_warm_hit_rate"] >= 0.9  # and it stays there
    assert lru["warm_hit_rate"] < 0.8 and s3["warm_hit_rate"] - lru["warm_hit_rate"] > 0.15
    assert s3["overall_hit_rate"] > lru["overall_hit_rate"]


def test_a_cold_warm_set_is_learned_during_the_scan():
    """No warm-up: each warm passage misses first, returns through the ghost into main, then hits."""
    m = _script()
    trace = m.make_trace(warmup_passes=0, seed=1)
    one = m.entry_bytes()
    s3 = m.replay(MemoryStore(max_bytes=300 * one, policy="s3fifo"), trace)
    lru = m.replay(MemoryStore(max_bytes=300 * one, policy="lru"), trace)
    assert s3["late_warm_hit_rate"] >= 0.95 and lru["late_warm_hit_rate"] < 0.8


def test_the_tiered_front_tier_uses_the_new_policy(tmp_path):
    assert open_store().policy == "s3fifo" and MemoryStore().policy == "s3fifo"
    t = open_store(f"tiered:{tmp_path / 'd'}")
    assert isinstance(t, TieredStore) and t.tiers[0].policy == "s3fifo"
    assert MemoryStore(policy="lru").stats()["policy"] == "lru"
    with pytest.raises(StoreError, match="unknown memory-tier policy"):
        MemoryStore(policy="arc")


# -- S3-FIFO mechanics -------------------------------------------------------------------------------

def test_a_returning_ghost_key_is_admitted_to_main():
    s = mem(10)
    pol = s._policy
    s.put(key(0), kv())
    for i in range(1, 11):  # one-offs push key 0, never read, out of the small queue
        s.put(key(i), kv())
    assert key(0) not in s and pol.queue_of(key(0)) == "ghost"
    s.put(key(0), kv())  # asked again soon: it is reused, so straight to main
    assert pol.queue_of(key(0)) == "main"
    for i in range(11, 40):  # a later scan leaves it there
        s.put(key(i), kv())
    assert key(0) in s and pol.queue_of(key(0)) == "main"
    assert pol.queue_of(key(30)) == "ghost" and pol.queue_of(key(39)) == "small"
    assert pol.queue_of(key(12)) is None  # the ghost remembers about as many keys as main holds


def test_a_key_read_on_probation_moves_to_main_and_an_unread_main_key_goes():
    p = S3FIFOPolicy(capacity=10)
    for i in range(10):
        p.admit(key(i), 1)
    p.touch(key(3))
    p.admit(key(10), 1)
    assert p.evict(10) == [key(0)] and p.queue_of(key(3)) == "small"  # the head went; 3 not reached yet
    assert p.evict(7) == [key(1), key(2), key(4)] and p.queue_of(key(3)) == "main"
    assert p.queue_of(key(1)) == "ghost" and p.bytes == 7 and len(p) == 7


def test_main_is_a_clock_over_read_counts():
    p = S3FIFOPolicy(capacity=10, small_ratio=0.0)
    for i in range(4):  # into main through the ghost
        p.admit(key(i), 1)
        assert p.evict(i) == [key(i)]
        p.admit(key(i), 1)
        assert p.queue_of(key(i)) == "main"
    p.touch(key(0))
    p.touch(key(2))
    p.touch(key(2))
    assert p.evict(3) == [key(1)]  # 0 (read once) is reinserted
    assert p.evict(1) == [key(3), key(0)]  # 0's count is spent, 2 still has one left
    assert p.queue_of(key(2)) == "main" and len(p) == 1


def test_rewriting_a_resident_key_updates_its_size_without_double_counting():
    for policy in ("s3fifo", "lru"):
        s = mem(10, policy)
        s.put(key(0), kv())
        s.put(key(0), kv(8))
        assert len(s) == 1 and s.stats()["bytes"] == kv(8).nbytes
        assert s.delete(key(0)) and s.stats()["bytes"] == 0 and not s.delete(key(0))


# -- invariants, both policies ---------------------------------------------------------------------

@pytest.mark.parametrize("policy", ["s3fifo", "lru"])
def test_pins_are_never_evicted(policy):
    rng = random.Random(0)
    s = mem(12, policy)
    pinned = set()
    for step in range(600):
        k = key(rng.randrange(200))
        if s.lookup(k) is None:
            s.put(k, kv())
        if step in (0, 50, 51, 300) or (step % 97 == 0 and len(pinned) < 6):
            s.pin(k)
            pinned.add(k)
        assert pinned <= set(s.keys())
    assert len(s) == 12
    s.gc(0)
    assert set(s.keys()) == pinned
    for k in pinned:
        s.unpin(k)
    assert s.gc(0)["entries"] == 0


@pytest.mark.parametrize("policy", ["s3fifo", "lru"])
def test_every_entry_pinned_stops_eviction_without_looping(policy):
    s = mem(3, policy)
    for i in range(3):
        s.put(key(i), kv())
        s.pin(key(i))
    s.put(key(3), kv())  # over budget, nothing evictable but the new entry itself, which is kept
    assert len(s) == 4 and s.gc(0)["removed"] == 1 and set(s.keys()) == {key(0), key(1), key(2)}


@pytest.mark.parametrize("policy", ["s3fifo", "lru"])
def test_the_byte_budget_holds_with_entries_of_different_sizes(policy):
    rng = random.Random(1)
    budget = 40 * ONE
    s = MemoryStore(max_bytes=budget, storage_dtype="float32", policy=policy)
    for step in range(3000):
        i = int(rng.paretovariate(1.2)) % 300  # some keys reused, many once
        k = key(i)
        if s.lookup(k) is None:
            s.put(k, kv(n=rng.choice([1, 2, 4, 8, 16, 32])))
        if step % 500 == 0:
            s.add_anchors(k, torch.zeros(1, s.get(k).n_tokens), "t")
        if step % 700 == 0:
            s.pin(k)
        st = s.stats()
        assert st["bytes"] <= budget
        assert st["bytes"] == sum(v.nbytes for v in s._items.values())  # the policy's count is the store's
    assert len(s._policy) == len(s)


def test_an_entry_larger_than_the_budget_is_kept_alone():
    for policy in ("s3fifo", "lru"):
        s = mem(2.5, policy)
        s.put(key(0), kv())
        s.put(key(1), kv(16))
        assert s.keys() == [key(1)]


def test_lru_policy_evicts_the_least_recently_used():
    s = mem(3, "lru")
    for i in range(3):
        s.put(key(i), kv())
    s.get(key(0))
    s.put(key(3), kv())
    assert set(s.keys()) == {key(0), key(2), key(3)}
    p = LRUPolicy(capacity=2)
    p.admit("a", 1), p.admit("b", 1), p.admit("c", 1)
    p.touch("a")
    assert p.evict(2) == ["b"]


# -- the script ----------------------------------------------------------------------------------------

def test_scan_script_writes_a_table_under_its_command(tmp_path):
    m = _script()
    m.main(["--sizes", "250,400", "--warmup-passes", "2", "--novel", "400", "--out", str(tmp_path)])
    md = (tmp_path / "scan.md").read_text()
    data = json.loads((tmp_path / "scan.json").read_text())
    cmd = "python scripts/scan_trace.py --sizes 250,400 --warmup-passes 2 --novel 400 --out " + str(tmp_path)
    assert f"Written by `{cmd}`" in md and data["command"] == cmd
    assert md.index(cmd) < md.index("| warm-up passes | tier size")
    assert [r["tier_entries"] for r in data["rows"]] == [250, 400]
    assert all(0 <= r[p]["warm_hit_rate"] <= 1 for r in data["rows"] for p in ("lru", "s3fifo"))
