"""The threads that split a decode step's rows (or the paged kernel's (row, KV head) pairs) on a CPU: one pool
for the process, grown on demand, shared by `attend_rows`, `batched` and `kernel_common.split_pairs`."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import torch

_ROW_POOL: tuple[int, ThreadPoolExecutor] | None = None  # (workers, pool): the shared threads
_ROW_POOL_LOCK = threading.Lock()


def row_pool(workers: int) -> ThreadPoolExecutor:
    """A pool of at least ``workers`` threads (the caller runs one more share itself)."""
    global _ROW_POOL
    with _ROW_POOL_LOCK:
        if _ROW_POOL is None or _ROW_POOL[0] < workers:
            _ROW_POOL = (workers, ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvstitch-rows"))
        return _ROW_POOL[1]


def attend_rows(decoders: list, layer: int, queries: list[torch.Tensor],
                scaling: float) -> list[torch.Tensor]:
    """``decoders[i].attend(layer, queries[i], scaling)`` for the sparse rows of one batched decode step.

    A sparse attend is a few dozen small ops that one thread runs best (`SparseDecoder._op_threads`), so a
    batch of them on a CPU with several intra-op threads would leave all but one core idle. Here the rows
    are split over that many threads instead (the calling thread takes a share), each running its rows'
    ops single-threaded; the rows share no state, so each result is what its lone attend returns. GPU
    rows and single rows take the plain path.
    """
    threads = torch.get_num_threads()
    n = len(decoders)
    if n < 2 or threads < 2 or any(d.device.type != "cpu" for d in decoders):
        return [d.attend(layer, q, scaling) for d, q in zip(decoders, queries)]
    workers = min(threads, n)
    groups = [range(w, n, workers) for w in range(workers)]

    def run(rows):
        return [(i, decoders[i]._attend(layer, queries[i], scaling)) for i in rows]

    out: list[torch.Tensor | None] = [None] * n
    torch.set_num_threads(1)  # this thread's share runs single-threaded too; the pool's threads start at 1
    try:
        futures = [row_pool(workers - 1).submit(run, rows) for rows in groups[1:]]
        done = run(groups[0])
        for f in futures:
            done += f.result()
    finally:
        torch.set_num_threads(threads)
    for i, t in done:
        out[i] = t
    return out
