"""The cold path: a request whose chunk caches are not (all) stored yet.

Stitching needs every chunk's precomputed K/V. Precomputing a chunk costs about as much as prefilling
its tokens (measured, `kvstitch bench ttft`, SmolLM2-135M, CPU: computing all chunks of a 2K/4K context
took 0.86x / 0.84x of a full prefill, 0.54x at 8K), and then the stitched request still pays for
stitching, selection and the recompute (0.23-0.36x of full prefill, warm store). So a request that must
precompute a fraction ``m`` of its context tokens costs about ``m * c + s`` full prefills (c ~ 0.85,
s ~ 0.35 for prophet): slower than full prefill as soon as m > (1 - s) / c ~ 0.75 — the 0.87x of a fully
cold request at 2K.

Policy (`Engine(cold_path=..., cold_threshold=...)`):
- ``"auto"`` (default): when more than ``cold_threshold`` (default 0.5) of the context tokens sit in chunks
  missing from the store, the request is answered by full prefill (exact; no chunk is computed on the
  request path) and the missing chunks are queued (`DeferredPrecompute`); below the threshold the missing
  chunks are precomputed on the request path and the request is stitched as usual. 0.5 leaves room for
  the slower selectors (s up to ~0.55 stays under one full prefill at m = 0.5).
- ``"full_prefill"``: any miss -> full prefill + deferred precompute.
- ``"stitched"``: always precompute the misses on the request path (the old behaviour).
- ``recompute_ratio="auto"`` requests keep their own path (rounds of growing budget that end in full
  prefill when they do not converge, `kvstitch.engine.budget`); the policy applies to fixed ratios.

Chunk caches are never filled from full prefill's own K/V: a chunk cache must see only the shared prefix
as its context. The deferred chunks are computed by `Engine.precompute_deferred` — off the request path:
`Engine.generate` / `run` call it after the answer is complete (after the result, so TTFT and the answer are
unaffected), the server's engine worker calls it while it is idle. ``res.stats["cold_path"]`` says which
path a request took ("full_prefill" or "stitched"), ``stats["deferred_chunks"]`` how many chunks it queued.
"""

from __future__ import annotations

import threading
from typing import Protocol

import torch

from kvstitch.core.errors import InputError
from .precompute import ChunkComputer
from kvstitch.core.prompt import PromptLayout

class ColdEngine(ChunkComputer, Protocol):
    """What the cold path needs of an engine: precompute's needs, its policy and its deferred queue."""

    cold_path: str
    cold_threshold: float
    deferred: "DeferredPrecompute"


COLD_PATHS = ("auto", "full_prefill", "stitched")
DEFAULT_COLD_THRESHOLD = 0.5


def check_cold_path(policy: str, threshold: float) -> tuple[str, float]:
    if policy not in COLD_PATHS:
        raise InputError(f"cold_path must be one of {', '.join(COLD_PATHS)}, got {policy!r}")
    if not isinstance(threshold, (int, float)) or not 0.0 <= float(threshold) <= 1.0:
        raise InputError(f"cold_threshold must be a fraction in [0, 1], got {threshold!r}")
    return policy, float(threshold)


class DeferredPrecompute:
    """Chunks a full-prefill cold request left to compute later (thread-safe, deduplicated by store key)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._todo: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # key -> (prefix ids, chunk ids)

    def add(self, key: str, prefix_ids: torch.Tensor, chunk_ids: torch.Tensor) -> None:
        with self._lock:
            self._todo.setdefault(key, (prefix_ids.clone(), chunk_ids.clone()))

    def __len__(self) -> int:
        with self._lock:
            return len(self._todo)

    def take(self, max_chunks: int | None = None) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
        """Remove up to ``max_chunks`` entries -> [(prefix ids, [chunk ids, ...])] grouped by prefix."""
        with self._lock:
            keys = list(self._todo)[:max_chunks] if max_chunks is not None else list(self._todo)
            items = [self._todo.pop(k) for k in keys]
        groups: list[tuple[torch.Tensor, list[torch.Tensor]]] = []
        for prefix, ids in items:
            for p, lst in groups:
                if torch.equal(p, prefix):
                    lst.append(ids)
                    break
            else:
                groups.append((prefix, [ids]))
        return groups


def missing_chunks(engine: ColdEngine, layout: PromptLayout) -> list[int]:
    """Indices of the layout's chunks whose caches are not in the store (a presence check: nothing is read)."""
    out = []
    for i, ids in enumerate(layout.chunk_ids):
        try:
            present = engine.chunk_key(layout.prefix_ids, ids) in engine.store
        except Exception:  # noqa: BLE001 - a store that cannot answer counts as a miss
            present = False
        if not present:
            out.append(i)
    return out


def take_full_prefill(engine: ColdEngine, layout: PromptLayout, stats: dict) -> bool:
    """Decide the cold path of a stitched request (see the module doc); records it in ``stats`` and, when
    full prefill answers, queues the missing chunks. -> True when the request should run full prefill."""
    if engine.cold_path == "stitched" or not layout.chunk_ids:
        stats["cold_path"] = "stitched"
        return False
    miss = missing_chunks(engine, layout)
    n_ctx = max(layout.n_context, 1)
    frac = sum(layout.chunk_ids[i].numel() for i in miss) / n_ctx
    stats["store_missing_fraction"] = round(frac, 4)
    full = bool(miss) and (engine.cold_path == "full_prefill" or frac > engine.cold_threshold)
    stats["cold_path"] = "full_prefill" if full else "stitched"
    if full:
        for i in miss:
            ids = layout.chunk_ids[i]
            engine.deferred.add(engine.chunk_key(layout.prefix_ids, ids), layout.prefix_ids, ids)
        stats.update(store_hits=len(layout.chunk_ids) - len(miss), store_misses=len(miss),
                     deferred_chunks=len(miss))
    return full


def precompute_deferred(engine: ColdEngine, max_chunks: int | None = None) -> int:
    """Compute (and store) up to ``max_chunks`` queued chunks -> the number of chunks handled."""
    from .precompute import ensure_chunks

    done = 0
    for prefix, chunk_ids in engine.deferred.take(max_chunks):
        ensure_chunks(engine, chunk_ids, prefix_ids=prefix)  # skips chunks stored in the meantime
        done += len(chunk_ids)
    return done
