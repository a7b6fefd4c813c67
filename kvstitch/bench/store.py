"""Store throughput: put / get GB/s per backend and storage dtype, bytes/token, checksum speed.

Synthetic chunks have the embedded model's shape by default (SmolLM2-135M: 30 layers, 3 KV heads,
head_dim 64) and 256 tokens. GB/s are *stored* bytes (the entry as written) per second. "Cold" disk reads
drop the entries from the page cache first with ``posix_fadvise(POSIX_FADV_DONTNEED)`` (after fsync);
where that is unavailable the cold columns are None.

    python -m kvstitch.bench.store /tmp/kvbench redis://127.0.0.1:6379/0
"""

from __future__ import annotations

import hashlib
import os
import secrets
import shutil
import statistics
import sys
import time
import zlib
from pathlib import Path

import torch
import xxhash

from kvstitch.core.chunk import ChunkKV
from kvstitch.store.base import ChunkStore
from kvstitch.store.codec import check_storage_dtype, encode
from kvstitch.store.disk import DiskStore
from kvstitch.store.memory import MemoryStore
from kvstitch.store.redis_store import RedisStore


def synthetic_chunk(n_layers: int, n_kv_heads: int, head_dim: int, n_tokens: int, seed: int = 0) -> ChunkKV:
    """Random K/V with realistic magnitudes (keys ~ +-25 with a few outlier channels, values ~ +-1)."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(n_layers, n_kv_heads, n_tokens, head_dim, generator=g) * 4
    keys[..., :4] *= 6  # outlier channels, as after RoPE in real models
    values = torch.randn(n_layers, n_kv_heads, n_tokens, head_dim, generator=g)
    ids = torch.randint(0, 49152, (n_tokens,), generator=g)
    return ChunkKV(keys, values, ids, 16, "bench-fingerprint")


def _open(spec, dtype: str, workdirs: list) -> ChunkStore:
    if spec in (None, "memory"):
        return MemoryStore(storage_dtype=dtype)
    spec = os.fspath(spec)
    if spec.startswith(("redis://", "rediss://", "unix://")):
        return RedisStore(spec, storage_dtype=dtype, prefix=f"kvstitch:bench:{secrets.token_hex(4)}:", check=True)
    root = Path(spec) / f"kvstitch-bench-{dtype}-{secrets.token_hex(4)}"
    workdirs.append(root)
    return DiskStore(root, storage_dtype=dtype)


def _drop_cache(paths) -> bool:
    if not hasattr(os, "posix_fadvise"):
        return False
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def bench_store(store_factory_specs=("memory",), n_layers: int = 30, n_kv_heads: int = 3, head_dim: int = 64,
                n_tokens: int = 256, dtypes=("float16", "bfloat16", "int8"), n_entries: int = 8,
                repeats: int = 5) -> list[dict]:
    """One row per (spec, dtype): entry_bytes, bytes_per_token, put/get GB/s and ms per chunk."""
    chunks = [synthetic_chunk(n_layers, n_kv_heads, head_dim, n_tokens, seed=i) for i in range(n_entries)]
    rows = []
    for spec in store_factory_specs:
        for dtype in dtypes:
            dtype = check_storage_dtype(dtype)
            workdirs: list[Path] = []
            store = _open(spec, dtype, workdirs)
            try:
                keys = [secrets.token_hex(32) for _ in chunks]
                entry = sum(memoryview(b).nbytes for b in encode(keys[0], chunks[0], dtype))
                for k, c in zip(keys[:1], chunks[:1]):  # warm-up (allocator, first-call costs)
                    store.put(k, c)
                    store.get(k)
                t_put = _timed(lambda: [store.put(k, c) for k, c in zip(keys, chunks)])
                warm = []
                for _ in range(repeats):
                    warm.append(_timed(lambda: [store.get(k) for k in keys]))
                    assert all(store.get(k) is not None for k in keys[:1])
                t_warm = statistics.median(warm)
                t_cold = None
                if isinstance(store, DiskStore) and _drop_cache([store.path(k) for k in keys]):
                    t_cold = _timed(lambda: [store.get(k) for k in keys])
                total = entry * len(keys)
                rows.append({
                    "backend": type(store).__name__, "spec": str(spec), "dtype": dtype, "entry_bytes": entry,
                    "bytes_per_token": entry / n_tokens, "n_entries": len(keys),
                    "put_gbps": total / t_put / 1e9, "put_ms": 1e3 * t_put / len(keys),
                    "get_warm_gbps": total / t_warm / 1e9, "get_warm_ms": 1e3 * t_warm / len(keys),
                    "get_cold_gbps": total / t_cold / 1e9 if t_cold else None,
                    "get_cold_ms": 1e3 * t_cold / len(keys) if t_cold else None,
                })
                for k in keys:
                    store.delete(k)
            finally:
                store.close()
                for d in workdirs:
                    shutil.rmtree(d, ignore_errors=True)
    return rows


def bench_checksums(nbytes: int = 6 << 20, repeats: int = 20) -> dict[str, float]:
    """GB/s of each checksum candidate over `nbytes` (why the entry format uses xxh3-128)."""
    buf = memoryview(os.urandom(nbytes))
    fns = {"xxh3_128": lambda: xxhash.xxh3_128(buf).digest(),
           "sha256": lambda: hashlib.sha256(buf).digest(),
           "blake2b": lambda: hashlib.blake2b(buf, digest_size=32).digest(),
           "crc32": lambda: zlib.crc32(buf)}
    out = {}
    for name, fn in fns.items():
        fn()
        out[name] = nbytes * repeats / _timed(lambda: [fn() for _ in range(repeats)]) / 1e9
    return out


def format_rows(rows: list[dict]):
    """A rich Table of `bench_store` rows."""
    from rich.table import Table

    t = Table("backend", "dtype", "bytes/token", "put GB/s", "get warm GB/s", "get cold GB/s", "get ms/chunk")
    f = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
    for r in rows:
        t.add_row(r["backend"], r["dtype"], f"{r['bytes_per_token']:.0f}", f(r["put_gbps"]), f(r["get_warm_gbps"]),
                  f(r["get_cold_gbps"]), f(r["get_warm_ms"]))
    return t


if __name__ == "__main__":  # pragma: no cover
    from rich.console import Console

    c = Console()
    c.print(format_rows(bench_store(sys.argv[1:] or ["memory"])))
    c.print({k: round(v, 2) for k, v in bench_checksums().items()})
