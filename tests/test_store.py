"""Chunk store: entry format, round trips, failure behaviour (disk + memory + tiered), maintenance API."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import safetensors.torch
import torch

from kvstitch.core.chunk import ChunkKV
from kvstitch.core.errors import CorruptEntryError, StoreError
from kvstitch.store import (LAYOUT_VERSION, ChunkStore, DiskStore, InvalidKeyError, MemoryStore, TieredStore,
                            chunk_key, open_store)
from kvstitch.store import codec, disk
from kvstitch.store.quant import quantize_keys, quantize_values

FP = "model-A"
REPO = Path(__file__).resolve().parents[1]


def make_kv(seed=0, L=3, H=2, n=16, d=8, fingerprint=FP, start=5) -> ChunkKV:
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(L, H, n, d, generator=g) * 8
    keys[..., 0] *= 10  # an outlier channel, as real post-RoPE keys have
    return ChunkKV(keys, torch.randn(L, H, n, d, generator=g), torch.arange(100, 100 + n), start, fingerprint)


def key_of(i: int, dtype="float16") -> str:
    return chunk_key(FP, [1, 2, 3], [i, i + 1], dtype)


def entry_file(store: DiskStore, key: str) -> Path:
    p = store.path(key)
    assert p.is_file()
    return p


# -- keys ------------------------------------------------------------------------------------------

def test_chunk_key_is_stable_and_separates_parts():
    k = chunk_key(FP, [1, 2], [3, 4])
    assert k == chunk_key(FP, torch.tensor([1, 2]), (3, 4)) and len(k) == 64
    assert k != chunk_key(FP, [1], [2, 3, 4])  # length-prefixed parts: no ambiguity
    assert k != chunk_key("model-B", [1, 2], [3, 4]) != chunk_key(FP, [1, 2], [3, 4], "int8")
    assert LAYOUT_VERSION == 1


@pytest.mark.parametrize("bad", ["../../etc/passwd", "a" * 63, "A" * 64, "g" * 64, "a" * 65, "/" + "a" * 63,
                                 "a" * 62 + "/.", "", None, 123])
def test_keys_cannot_escape_the_store(tmp_path, bad):
    s = DiskStore(tmp_path / "s")
    for call in (lambda: s.get(bad), lambda: s.put(bad, make_kv()), lambda: s.path(bad),
                 lambda: MemoryStore().get(bad)):
        with pytest.raises(InvalidKeyError, match="64 lowercase hex"):
            call()
    assert isinstance(InvalidKeyError("x"), StoreError) and isinstance(InvalidKeyError("x"), ValueError)
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == ["KVSTITCH_STORE.json"]


# -- entry format + round trips ----------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_roundtrip_bit_identical(tmp_path, dtype):
    kv = make_kv()
    dt = getattr(torch, dtype)
    s = DiskStore(tmp_path / "s", storage_dtype=dtype)
    s.put(key_of(0, dtype), kv)
    got = DiskStore(tmp_path / "s", storage_dtype=dtype).get(key_of(0, dtype))  # a fresh handle: from disk
    assert got.keys.dtype == dt
    assert torch.equal(got.keys, kv.keys.to(dt)) and torch.equal(got.values, kv.values.to(dt))
    assert torch.equal(got.token_ids, kv.token_ids) and got.start == kv.start and got.fingerprint == FP
    # to a compute dtype: still the exact float16/bfloat16 values
    got32 = DiskStore(tmp_path / "s", storage_dtype=dtype, compute_dtype=torch.float32).get(key_of(0, dtype))
    assert got32.keys.dtype == torch.float32 and torch.equal(got32.keys, kv.keys.to(dt).float())
    # what the memory tier serves is the same
    mem = MemoryStore(storage_dtype=dtype)
    mem.put(key_of(0, dtype), kv)
    assert torch.equal(mem.get(key_of(0, dtype)).keys, got.keys)


def test_loaded_tensors_are_writable_and_independent(tmp_path):
    s = DiskStore(tmp_path / "s")
    s.put(key_of(0), make_kv())
    a, b = s.get(key_of(0)), s.get(key_of(0))
    a.keys.zero_()
    assert not torch.equal(a.keys, b.keys)


def test_entry_is_plain_safetensors_with_documented_layout(tmp_path):
    kv = make_kv()
    s = DiskStore(tmp_path / "s")
    s.put(key_of(0), kv)
    p = entry_file(s, key_of(0))
    assert p.parent.name == key_of(0)[:2] and p.name == key_of(0) + ".safetensors"
    t = safetensors.torch.load_file(str(p))
    assert set(t) == {"keys", "values", "token_ids"}
    assert t["keys"].shape == (3, 2, 16, 8) and torch.equal(t["keys"], kv.keys.half())
    with safetensors.safe_open(str(p), "pt") as f:
        meta = f.metadata()
    assert meta["format"] == "kvstitch-chunk" and meta["layout_version"] == str(LAYOUT_VERSION)
    assert meta["fingerprint"] == FP and meta["start"] == "5" and meta["n_tokens"] == "16"
    assert meta["storage_dtype"] == "float16" and meta["key"] == key_of(0) and meta["checksum_alg"] == "xxh3_128" and len(meta["checksum"]) == 32
    data0 = 8 + int.from_bytes(p.read_bytes()[:8], "little")
    assert data0 % 64 == 0  # tensors start aligned


def test_int8_kivi_quantization(tmp_path):
    kv = make_kv(n=32)
    s = DiskStore(tmp_path / "s", storage_dtype="int8")
    s.put(key_of(0, "int8"), kv)
    got = s.get(key_of(0, "int8"))
    assert got.keys.dtype == torch.float32  # dequantized to the compute dtype
    _, ks, _ = quantize_keys(kv.keys)
    _, vs, _ = quantize_values(kv.values)
    assert ks.shape == (3, 2, 1, 8) and vs.shape == (3, 2, 32, 1)  # per channel / per token
    assert ((got.keys - kv.keys).abs() <= ks / 2 + 1e-5).all()
    assert ((got.values - kv.values).abs() <= vs / 2 + 1e-5).all()
    # per-channel keys: the outlier channel does not inflate the error of the others
    assert (got.keys - kv.keys)[..., 1:].abs().max() < (kv.keys[..., 1:].abs().max() / 100)
    t = safetensors.torch.load_file(str(entry_file(s, key_of(0, "int8"))))
    assert t["keys.q"].dtype == torch.uint8 and t["values.scale"].shape == (3, 2, 32, 1)
    big = make_kv(n=256, d=64)  # at a real chunk shape the scales cost ~6%: about half of float16
    s.put(key_of(1, "int8"), big)
    half = DiskStore(tmp_path / "h")
    half.put(key_of(1), big)
    assert entry_file(s, key_of(1, "int8")).stat().st_size < 0.56 * entry_file(half, key_of(1)).stat().st_size
    bf = DiskStore(tmp_path / "s", storage_dtype="int8", compute_dtype=torch.bfloat16).get(key_of(0, "int8"))
    assert bf.keys.dtype == torch.bfloat16
    # memory tier serves the same dequantized numbers
    m = MemoryStore(storage_dtype="int8")
    m.put(key_of(0, "int8"), kv)
    assert torch.equal(m.get(key_of(0, "int8")).keys, got.keys)


def test_constant_and_empty_groups_quantize_exactly():
    kv = ChunkKV(torch.full((1, 1, 4, 2), 3.0), torch.zeros(1, 1, 4, 2), torch.arange(4), 0, FP)
    got = codec.roundtrip(kv, "int8")
    assert torch.equal(got.keys, kv.keys) and torch.equal(got.values, kv.values)
    empty = ChunkKV(torch.zeros(2, 1, 0, 4), torch.zeros(2, 1, 0, 4), torch.zeros(0, dtype=torch.long), 0, FP)
    blob = codec.encode_bytes("0" * 64, empty)
    assert codec.decode(bytearray(blob), "0" * 64).n_tokens == 0


def test_float16_overflow_is_refused(tmp_path):
    kv = make_kv()
    kv.keys[0, 0, 0, 0] = 1e6
    with pytest.raises(StoreError, match="not finite"):
        DiskStore(tmp_path / "s").put(key_of(0), kv)
    DiskStore(tmp_path / "b", storage_dtype="bfloat16").put(key_of(0, "bfloat16"), kv)  # bfloat16 holds it


# -- failure behaviour -----------------------------------------------------------------------------

def _damage(p: Path, how: str) -> None:
    b = bytearray(p.read_bytes())
    if how == "truncated":
        b = b[: len(b) // 2]
    elif how == "bitflip_data":
        b[-100] ^= 0x01
    elif how == "bitflip_header":
        i = b.index(b'"start":"5"') + len('"start":"')
        b[i] = ord("6")  # a plausible but wrong position: only the checksum catches it
    elif how == "empty":
        b = bytearray()
    elif how == "garbage":
        b = bytearray(os.urandom(len(b)))
    p.write_bytes(bytes(b))


@pytest.mark.parametrize("how", ["truncated", "bitflip_data", "bitflip_header", "empty", "garbage"])
def test_damaged_entry_is_a_miss_reported_once_listed_and_overwritten(tmp_path, caplog, how):
    s = DiskStore(tmp_path / "s")
    kv = make_kv()
    s.put(key_of(0), kv)
    s.put(key_of(1), make_kv(1))
    _damage(entry_file(s, key_of(0)), how)
    caplog.set_level(logging.WARNING, logger="kvstitch.store")
    assert s.lookup(key_of(0)) is None and s.lookup(key_of(0)) is None
    assert s.misses == 2 and s.lookup(key_of(1)) is not None and s.hits == 1
    assert len(s.problems) == 1 and s.problems[0].startswith(key_of(0))
    assert len([r for r in caplog.records if key_of(0) in r.getMessage()]) == 1
    assert [k for k, _ in s.verify()] == [key_of(0)]
    with pytest.raises(CorruptEntryError):
        codec.decode(disk.read_file(entry_file(s, key_of(0))), key_of(0))
    s.put(key_of(0), kv)  # the next put overwrites it
    assert torch.equal(s.get(key_of(0)).keys, kv.keys.half()) and s.verify() == []


def test_foreign_model_entry_is_a_miss(tmp_path, caplog):
    # an entry of model B sitting under the key model A asks for (a bad copy, a fingerprint bug)
    DiskStore(tmp_path / "s").put(key_of(0), make_kv(fingerprint="model-B"))
    caplog.set_level(logging.WARNING, logger="kvstitch.store")
    s = open_store(tmp_path / "s", fingerprint=FP)
    assert s.get(key_of(0)) is None and s.get(key_of(0)) is None
    assert len(s.problems) == 1 and "foreign model" in s.problems[0]
    assert sum("foreign model" in r.getMessage() for r in caplog.records) == 1
    assert [(k, "foreign" in p) for k, p in s.verify()] == [(key_of(0), True)]
    assert DiskStore(tmp_path / "s").verify() == []  # without an expected fingerprint it is a valid entry
    s.put(key_of(0), make_kv())
    assert s.get(key_of(0)).fingerprint == FP and s.verify() == []
    m = MemoryStore(fingerprint=FP)
    m.put(key_of(0), make_kv(fingerprint="model-B"))
    assert m.get(key_of(0)) is None and "foreign model" in m.problems[0]


def test_entry_under_the_wrong_key_is_a_miss(tmp_path):
    s = DiskStore(tmp_path / "s")
    s.put(key_of(0), make_kv())
    dst = s.path(key_of(1))
    dst.parent.mkdir(exist_ok=True)
    dst.write_bytes(entry_file(s, key_of(0)).read_bytes())
    assert s.get(key_of(1)) is None and "written for key" in s.problems[0]
    assert [k for k, _ in s.verify()] == [key_of(1)]


def test_partial_write_leaves_nothing_readable(tmp_path):
    s = DiskStore(tmp_path / "s")
    blob = codec.encode_bytes(key_of(0), make_kv())
    shard = tmp_path / "s" / key_of(0)[:2]
    shard.mkdir()
    tmp = shard / f".{key_of(0)}.999.dead.tmp"
    tmp.write_bytes(blob[: len(blob) // 3])  # a writer died before its rename
    assert s.get(key_of(0)) is None and key_of(0) not in s and s.problems == []
    assert s.verify() == [] and s.keys() == [] and s.stats()["tmp_files"] == 1
    assert s.gc(1 << 30)["stale_tmp_removed"] == 0  # may still be in flight
    old = time.time() - 2 * disk.STALE_TMP_S
    os.utime(tmp, (old, old))
    assert s.gc(1 << 30)["stale_tmp_removed"] == 1 and not tmp.exists()


_SLOW_WRITER = textwrap.dedent("""
    import sys, time, torch
    import kvstitch.store.disk as d
    from kvstitch.core.chunk import ChunkKV
    orig = d._write_all
    def slow(fd, buf):  # write slowly in 4 KiB pieces so the kill lands mid-write
        mv = memoryview(buf).cast("B")
        for i in range(0, len(mv), 4096):
            orig(fd, mv[i:i + 4096]); time.sleep(0.005)
    d._write_all = slow
    s = d.DiskStore(sys.argv[1])
    kv = ChunkKV(torch.randn(4, 2, 256, 64), torch.randn(4, 2, 256, 64), torch.arange(256), 0, "model-A")
    for i in range(100):
        key = "%064x" % i
        print(key, flush=True)
        s.put(key, kv)
""")


def test_process_killed_mid_put_leaves_no_valid_looking_entry(tmp_path):
    root = tmp_path / "s"
    DiskStore(root)
    proc = subprocess.Popen([sys.executable, "-c", _SLOW_WRITER, str(root)], stdout=subprocess.PIPE, text=True,
                            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        first = proc.stdout.readline().strip()
        second = proc.stdout.readline().strip()  # `first` is complete, `second` is being written
        assert len(second) == 64, "writer subprocess failed to start"
        deadline = time.monotonic() + 20
        while not list((root / second[:2]).glob(f".{second}.*.tmp")) and time.monotonic() < deadline:
            time.sleep(0.01)  # wait for its temp file: the kill then lands mid-write
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    s = DiskStore(root)
    in_flight = {p.name.split(".")[1] for p in root.glob("*/.*.tmp")}
    assert second in in_flight, "the kill did not land mid-write"
    assert s.get(first) is not None and s.get(second) is None and second not in s
    assert s.verify() == [] and s.problems == [] and s.keys() == [first]


def _writer(root: str, order: list[int], seed: int) -> None:
    s = DiskStore(root)
    for i in order:
        s.put(key_of(i), make_kv(i))
        got = s.get(key_of(order[0]))
        assert got is None or torch.equal(got.keys, make_kv(order[0]).keys.half())


def test_two_processes_writing_the_same_keys_end_consistent(tmp_path):
    root = str(tmp_path / "s")
    DiskStore(root)
    # fork: no second torch import (the children only touch tiny tensors, below torch's threading threshold)
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    procs = [ctx.Process(target=_writer, args=(root, order, j))
             for j, order in enumerate([list(range(24)), list(reversed(range(24)))])]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0]
    s = DiskStore(root)
    assert s.verify() == [] and sorted(s.keys()) == sorted(key_of(i) for i in range(24))
    assert all(torch.equal(s.get(key_of(i)).keys, make_kv(i).keys.half()) for i in range(24))
    assert s.stats()["tmp_files"] == 0


# -- maintenance -------------------------------------------------------------------------------------

def test_stats_verify_gc_lru_by_access_time(tmp_path):
    s = DiskStore(tmp_path / "s")
    for i in range(4):
        s.put(key_of(i), make_kv(i))
    size = entry_file(s, key_of(0)).stat().st_size
    for i in range(4):  # pretend they were all last used an hour ago, 0 oldest
        t = time.time() - 3600 + i
        os.utime(s.path(key_of(i)), (t, t))
    assert s.lookup(key_of(0)) is not None and s.lookup(key_of(1)) is not None  # refreshes atime
    assert s.lookup(key_of(9)) is None
    st = s.stats()
    assert st["entries"] == 4 and st["bytes"] == 4 * size and st["hits"] == 2 and st["misses"] == 1
    assert st["by_dtype"]["float16"]["tokens"] == 64
    assert st["by_dtype"]["float16"]["bytes_per_token"] == pytest.approx(size / 16)
    r = s.gc(2 * size)
    assert r["removed"] == 2 and r["freed_bytes"] == 2 * size and r["bytes"] == 2 * size
    assert sorted(s.keys()) == sorted([key_of(0), key_of(1)])  # the recently used survive
    assert s.gc(0)["entries"] == 0 and s.keys() == []


def test_size_budget_is_enforced_on_put(tmp_path):
    s = DiskStore(tmp_path / "s")
    s.put(key_of(0), make_kv())
    size = entry_file(s, key_of(0)).stat().st_size
    budget = DiskStore(tmp_path / "s", max_bytes=int(3.5 * size))
    for i in range(1, 8):
        budget.put(key_of(i), make_kv(i))
        assert budget.stats()["bytes"] <= 3.5 * size
    assert key_of(7) in budget


def test_memory_store_lru_by_bytes_and_stats():
    kv = make_kv()
    m = MemoryStore(max_bytes=int(2.5 * kv.to(dtype=torch.float16).nbytes))
    for i in range(3):
        m.put(key_of(i), make_kv(i))
    assert len(m) == 2 and key_of(0) not in m and m.get(key_of(2)).keys.dtype == torch.float16
    st = m.stats()
    assert st["entries"] == 2 and st["by_dtype"]["float16"]["tokens"] == 32
    assert m.gc(0)["removed"] == 2 and len(m) == 0
    assert MemoryStore(storage_dtype="float32").put(key_of(0), kv) is None


# -- open_store + tiered ---------------------------------------------------------------------------

def test_open_store_specs(tmp_path):
    assert isinstance(open_store(), MemoryStore) and isinstance(open_store("memory"), MemoryStore)
    d = open_store(tmp_path / "d", storage_dtype="bf16")
    assert isinstance(d, DiskStore) and d.storage_dtype == "bfloat16"
    assert open_store(d) is d and isinstance(open_store(str(tmp_path / "e")), DiskStore)
    t = open_store(f"tiered:{tmp_path / 'd'}")
    assert isinstance(t, TieredStore) and [type(x) for x in t.tiers] == [MemoryStore, DiskStore]
    t2 = open_store(["memory", tmp_path / "d"], storage_dtype="int8")
    assert [x.storage_dtype for x in t2.tiers] == ["int8", "int8"]
    for bad in ("ftp://host/x", "", 42):
        with pytest.raises(StoreError, match="unsupported store"):
            open_store(bad)
    with pytest.raises(StoreError, match="storage dtype"):
        open_store(storage_dtype="int4")
    (tmp_path / "notastore").mkdir()
    (tmp_path / "notastore" / "precious.txt").write_text("x")
    with pytest.raises(StoreError, match="non-empty directory"):
        open_store(tmp_path / "notastore")
    # two processes opening one new store at once: the second sees only the first's marker being written
    (tmp_path / "racing").mkdir()
    (tmp_path / "racing" / f".{disk.MARKER}.123.abcd").write_text("{}")
    assert isinstance(open_store(tmp_path / "racing"), DiskStore) and (tmp_path / "racing" / disk.MARKER).is_file()
    (tmp_path / "file").write_text("x")
    with pytest.raises(StoreError, match="not a directory"):
        open_store(tmp_path / "file")
    with pytest.raises(StoreError, match="tiers disagree"):
        TieredStore([MemoryStore(storage_dtype="int8"), DiskStore(tmp_path / "d")])
    assert issubclass(TieredStore, ChunkStore)


def test_tiered_write_through_and_promote_on_hit(tmp_path):
    t = open_store(f"tiered:memory,{tmp_path / 'd'}", storage_dtype="int8")
    kv = make_kv()
    t.put(key_of(0, "int8"), kv)
    mem, dsk = t.tiers
    assert key_of(0, "int8") in mem and key_of(0, "int8") in dsk  # write-through
    a = t.lookup(key_of(0, "int8"))
    assert t.tier_hits == [1, 0]
    # a new process: empty memory tier, the disk tier serves and promotes
    t2 = open_store(["memory", tmp_path / "d"], storage_dtype="int8")
    b = t2.lookup(key_of(0, "int8"))
    assert t2.tier_hits == [0, 1] and key_of(0, "int8") in t2.tiers[0]
    assert torch.equal(a.keys, b.keys)  # same numbers whichever tier served
    assert t2.lookup(key_of(0, "int8")) is not None and t2.tier_hits == [1, 1]
    assert t2.stats()["hits"] == 2 and t2.lookup(key_of(5, "int8")) is None and t2.misses == 1
    t2.fingerprint = "model-B"
    assert all(x.fingerprint == "model-B" for x in t2.tiers)
    assert t2.get(key_of(0, "int8")) is None and len(t2.problems) == 2  # foreign in memory and on disk
    assert sorted(t2.keys()) == [key_of(0, "int8")] and t2.delete(key_of(0, "int8"))


@pytest.mark.parametrize("alg", ["xxh3_128", "sha256", "blake2b", "crc32"])
def test_every_checksum_algorithm_reads_back_and_catches_a_flipped_bit(tmp_path, alg):
    """Entries name their checksum: a store with the default (xxh3-128) reads entries that older stores wrote
    with sha256 & co., and every algorithm catches a bit flip in the data."""
    assert codec.DEFAULT_CHECKSUM == "xxh3_128"
    kv = make_kv()
    writer = DiskStore(tmp_path / "s", checksum_alg=alg)
    writer.put(key_of(0), kv)
    blob = disk.read_file(entry_file(writer, key_of(0)))
    assert codec.entry_info(blob)["checksum_alg"] == alg
    assert torch.equal(DiskStore(tmp_path / "s").get(key_of(0)).keys, kv.keys.half())
    flipped = bytearray(blob)
    flipped[-100] ^= 0x01
    with pytest.raises(CorruptEntryError, match="checksum mismatch"):
        codec.decode(flipped, key_of(0))
