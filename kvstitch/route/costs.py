"""Per-token costs of serving a request on one replica, read from the benchmarks kept in docs/results.

- bytes per token: the model's K/V in float16 storage, layers x KV heads x head_dim x 2 (K and V) x 2 bytes.
- remote fetch: those bytes over the chunk store's measured read throughput (`kvstitch bench store`, the
  RedisStore float16 warm read; a Redis on the same host, so a real network adds to it).
- recompute (a chunk no store holds: its K/V is computed): full prefill's TTFT per context token at the
  shortest context of `kvstitch bench ttft` (prefill cost per token, attention at that length included).
- base: the stitched request itself (stitch, selection, recompute of 20%, first token) per context token,
  from the same table (the default method's row, else its base method's), paid whatever the tiers hold.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

MODEL_SHAPES = {"qwen2.5-0.5b": (24, 2, 64), "smollm2": (30, 3, 64)}  # layers, KV heads, head_dim
TTFT_TABLES = {"qwen2.5-0.5b": "qwen/ttft-t2/bench_ttft.json", "smollm2": "ttft-t2/bench_ttft.json"}
STITCHED_METHODS = ("deltaprop", "infoflow", "prophet")  # the default method first, then its base


@dataclass(frozen=True)
class CostModel:
    bytes_per_token: float
    fetch_s_per_token: float
    recompute_s_per_token: float
    base_s_per_token: float
    sources: dict = field(default_factory=dict, compare=False)

    def service_s(self, context: int, fetched: int, recomputed: int) -> float:
        return (self.base_s_per_token * context + self.fetch_s_per_token * fetched
                + self.recompute_s_per_token * recomputed)


def kv_bytes_per_token(model: str) -> int:
    layers, kv_heads, head_dim = MODEL_SHAPES[model]
    return layers * kv_heads * head_dim * 2 * 2


def _remote_read_gbps(results: Path, backend: str) -> tuple[float, str]:
    path = results / "bench_store.json"
    rows = json.loads(path.read_text())["rows"]
    row = next(r for r in rows if r["backend"] == backend and r["dtype"] == "float16")
    return row["get_warm_gbps"], f"{path.name}: {backend} float16 get_warm_gbps = {row['get_warm_gbps']:.3f}"


def _ttft_rows(results: Path, model: str) -> tuple[dict, dict, str]:
    path = results / TTFT_TABLES[model]
    rows = json.loads(path.read_text())["rows"]
    ctx = min(r["context_tokens"] for r in rows)
    at = {r["method"]: r for r in rows if r["context_tokens"] == ctx}
    stitched = next(at[m] for m in STITCHED_METHODS if m in at)
    return at["full"], stitched, str(path.relative_to(results))


def from_results(model: str = "qwen2.5-0.5b", results: Path | str = "docs/results",
                 remote: str = "RedisStore") -> CostModel:
    """The cost model of `model` on this machine, from `results` (bench_store.json and a ttft table)."""
    results = Path(results)
    bpt = kv_bytes_per_token(model)
    gbps, store_src = _remote_read_gbps(results, remote)
    full, stitched, ttft_src = _ttft_rows(results, model)
    ctx = full["context_tokens"]
    sources = {
        "bytes_per_token": f"{MODEL_SHAPES[model]} x 2 (K, V) x 2 bytes = {bpt}",
        "fetch_s_per_token": f"{bpt} B / ({store_src} GB/s)",
        "recompute_s_per_token": f"{ttft_src}: full prefill TTFT {full['ttft_median_s']:.3f} s / {ctx} context tokens",
        "base_s_per_token": f"{ttft_src}: {stitched['method']} r={stitched['ratio']} TTFT "
                            f"{stitched['ttft_median_s']:.3f} s / {ctx} context tokens",
    }
    return CostModel(bytes_per_token=bpt, fetch_s_per_token=bpt / (gbps * 1e9),
                     recompute_s_per_token=full["ttft_median_s"] / ctx,
                     base_s_per_token=stitched["ttft_median_s"] / ctx, sources=sources)
