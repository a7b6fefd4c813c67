"""`kvstitch store stats|verify|gc` (typer app mounted by the lead) and the bench helper."""

from __future__ import annotations

import pytest
import torch
import typer
from typer.testing import CliRunner

from kvstitch.core.chunk import ChunkKV
from kvstitch.store import DiskStore, chunk_key
from kvstitch.bench.store import bench_checksums, bench_store, format_rows
from kvstitch.cli.store import parse_size, store_app

runner = CliRunner()


def make_kv(seed=0):
    g = torch.Generator().manual_seed(seed)
    return ChunkKV(torch.randn(2, 2, 8, 8, generator=g), torch.randn(2, 2, 8, 8, generator=g), torch.arange(8), 0,
                   "m")


def filled(tmp_path, n=3, dtype="float16"):
    s = DiskStore(tmp_path / "s", storage_dtype=dtype)
    keys = [chunk_key("m", [], [i], dtype) for i in range(n)]
    for i, k in enumerate(keys):
        s.put(k, make_kv(i))
    return s, keys


def test_stats(tmp_path):
    s, _ = filled(tmp_path)
    filled(tmp_path, 2, "int8")  # a second dtype in the same directory
    r = runner.invoke(store_app, ["stats", str(s.root)])
    assert r.exit_code == 0, r.output
    assert "5 entries" in r.output and "float16" in r.output and "int8" in r.output and "bytes/token" in r.output


def test_verify_ok_and_problems(tmp_path):
    s, keys = filled(tmp_path)
    r = runner.invoke(store_app, ["verify", str(s.root)])
    assert r.exit_code == 0 and "OK" in r.output and "3 entries" in r.output
    p = s.path(keys[1])
    p.write_bytes(p.read_bytes()[:-7])
    r = runner.invoke(store_app, ["verify", str(s.root)])
    assert r.exit_code == 1 and "1 of 3" in r.output and "truncated" in r.output
    r = runner.invoke(store_app, ["verify", str(s.root), "--fingerprint", "other-model"])
    assert r.exit_code == 1 and "3 of 3" in r.output


def test_gc(tmp_path):
    s, keys = filled(tmp_path, 4)
    size = s.path(keys[0]).stat().st_size
    r = runner.invoke(store_app, ["gc", str(s.root), "--max-bytes", str(2 * size)])
    assert r.exit_code == 0 and "removed 2 entries" in r.output and len(s.keys()) == 2
    r = runner.invoke(store_app, ["gc", str(s.root), "--max-bytes", "0"])
    assert r.exit_code == 0 and s.keys() == []
    r = runner.invoke(store_app, ["gc", str(s.root), "--max-bytes", "lots"])
    assert r.exit_code != 0 and "not a size" in r.output


def test_cli_refuses_what_is_not_a_store(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "keep.txt").write_text("precious")
    for cmd in (["stats"], ["verify"], ["gc", "--max-bytes", "0"]):
        r = runner.invoke(store_app, [cmd[0], str(tmp_path / "docs"), *cmd[1:]])
        assert r.exit_code == 2 and "not a kvstitch store" in r.output
    r = runner.invoke(store_app, ["stats", str(tmp_path / "missing")])
    assert r.exit_code == 2 and not (tmp_path / "missing").exists()  # the CLI never creates a store
    assert (tmp_path / "docs" / "keep.txt").read_text() == "precious"


def test_parse_size():
    assert parse_size("0") == 0 and parse_size("1024") == 1024 and parse_size("2K") == 2048
    assert parse_size("1.5GiB") == 3 << 29 and parse_size("2GB") == 2 * 10**9 and parse_size("500M") == 500 << 20
    with pytest.raises(typer.BadParameter):
        parse_size("-1")


def test_bench_disk_and_memory(tmp_path):
    rows = bench_store(["memory", tmp_path], n_layers=2, n_kv_heads=1, head_dim=64, n_tokens=64,
                       dtypes=["float16", "int8"], n_entries=2, repeats=1)
    assert [(r["backend"], r["dtype"]) for r in rows] == [("MemoryStore", "float16"), ("MemoryStore", "int8"),
                                                          ("DiskStore", "float16"), ("DiskStore", "int8")]
    disk = rows[2]
    assert disk["put_gbps"] > 0 and disk["get_warm_gbps"] > 0 and disk["get_cold_gbps"] > 0
    assert rows[3]["bytes_per_token"] < disk["bytes_per_token"]
    assert list(tmp_path.iterdir()) == []  # bench cleans up after itself
    assert format_rows(rows).row_count == 4
    assert set(bench_checksums(1 << 16, 2)) == {"xxh3_128", "sha256", "blake2b", "crc32"}
