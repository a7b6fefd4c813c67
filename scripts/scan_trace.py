"""Memory-tier eviction under a scan: a reused passage set asked while one-off passages stream through.

A warm set of passages (asked `--warmup-passes` times before the stream; 0: a cold start) is looked up at
random, each warm key with probability ~`--warm-per-request / --warm` per request (uniform, or Zipf with
`--zipf S`), while every request also brings `--novel-per-request` passages never seen again. A lookup
that misses is put, as the engine does. The same seeded trace is replayed through
`MemoryStore(policy="lru")` and `MemoryStore(policy="s3fifo")` at each tier size (in entries; all entries
have the same size). No model: small fake `ChunkKV` entries. Writes ``scan.json`` and ``scan.md`` (the
command above the table):

    .venv/bin/python scripts/scan_trace.py --out docs/results/store-policy
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import sys
from pathlib import Path

import torch

from kvstitch.core.chunk import ChunkKV
from kvstitch.store import MemoryStore, chunk_key

POLICIES = ("lru", "s3fifo")


def fake_kv(fp: str = "scan") -> ChunkKV:
    return ChunkKV(torch.zeros(1, 1, 4, 4), torch.zeros(1, 1, 4, 4), torch.arange(4), 0, fp)


def entry_bytes() -> int:
    """Bytes one fake entry takes in a (float16) memory tier."""
    m = MemoryStore()
    m.put(warm_key(0), fake_kv())
    return m.stats()["bytes"]


def warm_key(i: int) -> str:
    return chunk_key("scan", [0], [0, i])


def novel_key(i: int) -> str:
    return chunk_key("scan", [0], [1, i])


def make_trace(warm: int = 200, novel: int = 2000, novel_per_request: int = 2, warm_per_request: float = 3.0,
               zipf: float = 0.0, seed: int = 0, warmup_passes: int = 2) -> dict:
    """-> {"warmup": [keys], "requests": [[(key, is_warm), ...], ...]}: the warm set asked in order
    `warmup_passes` times, then ``novel / novel_per_request`` requests, each with its one-off passages and a
    random draw of warm ones."""
    rng = random.Random(seed)
    weights = [1.0 / (r + 1) ** zipf for r in range(warm)]
    total = sum(weights)
    prob = [min(1.0, warm_per_request * w / total) for w in weights]
    warm_keys = [warm_key(i) for i in range(warm)]
    rng.shuffle(warm_keys)  # rank -> key: the hottest are not the first put
    requests = []
    for r in range(novel // novel_per_request):
        req = [(novel_key(r * novel_per_request + j), False) for j in range(novel_per_request)]
        req += [(k, True) for k, p in zip(warm_keys, prob) if rng.random() < p]
        rng.shuffle(req)
        requests.append(req)
    return {"warmup": [warm_key(i) for i in range(warm)] * warmup_passes, "requests": requests}


def replay(store: MemoryStore, trace: dict, window: int = 100) -> dict:
    """Look every passage up, put it on a miss; hit rates over the requests after the warm-up."""
    kv = fake_kv()
    for k in trace["warmup"]:
        if store.lookup(k) is None:
            store.put(k, kv)
    hits = {True: 0, False: 0}
    looks = {True: 0, False: 0}
    windows, w_hits, w_looks = [], 0, 0
    half = len(trace["requests"]) // 2
    late = [0, 0]  # warm hits, warm lookups in the second half of the requests
    for n, req in enumerate(trace["requests"], 1):
        for k, is_warm in req:
            hit = store.lookup(k) is not None
            if not hit:
                store.put(k, kv)
            looks[is_warm] += 1
            hits[is_warm] += hit
            if is_warm:
                w_looks += 1
                w_hits += hit
                if n > half:
                    late[0] += hit
                    late[1] += 1
        if n % window == 0:
            windows.append(w_hits / w_looks if w_looks else 1.0)
            w_hits = w_looks = 0
    all_looks = looks[True] + looks[False]
    return {"warm_hit_rate": hits[True] / looks[True] if looks[True] else 0.0,
            "overall_hit_rate": (hits[True] + hits[False]) / all_looks if all_looks else 0.0,
            "late_warm_hit_rate": late[0] / late[1] if late[1] else 0.0,
            "warm_lookups": looks[True], "novel_lookups": looks[False],
            "min_window_warm_hit_rate": min(windows) if windows else None, "window_requests": window}


def run(sizes: list[int], warmups: tuple[int, ...] = (2,), **trace_args) -> list[dict]:
    one = entry_bytes()
    rows = []
    for passes in warmups:
        trace = make_trace(warmup_passes=passes, **trace_args)
        for entries in sizes:
            row = {"warmup_passes": passes, "tier_entries": entries, "tier_bytes": entries * one}
            for policy in POLICIES:
                store = MemoryStore(max_bytes=entries * one, policy=policy)
                row[policy] = replay(store, trace)
                assert store.stats()["bytes"] <= entries * one
            rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| warm-up passes | tier size (entries) | LRU warm hit rate | S3-FIFO warm hit rate | "
             "LRU warm, 2nd half | S3-FIFO warm, 2nd half | LRU overall | S3-FIFO overall |", "|" + "---|" * 8]
    for r in rows:
        lru, s3 = r["lru"], r["s3fifo"]
        cells = [r["warmup_passes"], r["tier_entries"]] + [f"{x[m]:.3f}" for m in
                                                           ("warm_hit_rate", "late_warm_hit_rate", "overall_hit_rate")
                                                           for x in (lru, s3)]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def write(rows: list[dict], params: dict, out: Path, command: str) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    js, md = out / "scan.json", out / "scan.md"
    js.write_text(json.dumps({"command": command, "trace": params, "rows": rows}, indent=2) + "\n")
    dist = f"Zipf s={params['zipf']:g}" if params["zipf"] else "uniform"
    md.write_text(
        "# Memory-tier eviction under a scan\n\n"
        f"A warm set of {params['warm']} passages, asked in order *warm-up passes* times, then "
        f"{params['novel']} one-off passages streaming through, {params['novel_per_request']} per request, beside "
        f"~{params['warm_per_request']:g} warm lookups per request ({dist}; {rows[0]['s3fifo']['warm_lookups']} "
        "warm lookups in all). A miss is put, as the engine does. Hit rates are over the requests after the "
        "warm-up (with 0 passes they include each warm passage's first misses; *2nd half*: over the last half of "
        "the requests only); *overall* counts the one-off "
        "lookups too, which always miss. The same seeded trace for both policies; all entries the same size "
        "(`MemoryStore(max_bytes=entries * entry size, policy=...)`).\n\n"
        f"Written by `{command}`\n\n{table(rows)}\n")
    return js, md


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="220,250,300,400,600", help="tier sizes, in entries")
    ap.add_argument("--warmup-passes", default="2,0", help="warm-up passes over the warm set, one run each")
    ap.add_argument("--warm", type=int, default=200)
    ap.add_argument("--novel", type=int, default=2000)
    ap.add_argument("--novel-per-request", type=int, default=2)
    ap.add_argument("--warm-per-request", type=float, default=3.0)
    ap.add_argument("--zipf", type=float, default=0.0, help="0: warm keys equally likely")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("docs/results/store-policy"))
    a = ap.parse_args(argv)
    params = {"warm": a.warm, "novel": a.novel, "novel_per_request": a.novel_per_request,
              "warm_per_request": a.warm_per_request, "zipf": a.zipf, "seed": a.seed}
    warmups = tuple(int(x) for x in a.warmup_passes.split(","))
    rows = run([int(x) for x in a.sizes.split(",")], warmups, **params)
    args = sys.argv[1:] if argv is None else argv
    command = " ".join(["python scripts/scan_trace.py", *(shlex.quote(x) for x in args)])
    js, md = write(rows, {**params, "warmup_passes": list(warmups)}, a.out, command)
    print(table(rows))
    print(f"wrote {js} and {md}")


if __name__ == "__main__":
    main()
