"""The threads that split a decode step's rows (or the paged kernel's (row, KV head) pairs) on a CPU: one pool
for the process, grown on demand, shared by `decoder.attend_rows`, `batched` and
`kernel_common.split_pairs`."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

_ROW_POOL: tuple[int, ThreadPoolExecutor] | None = None  # (workers, pool): the shared threads
_ROW_POOL_LOCK = threading.Lock()


def row_pool(workers: int) -> ThreadPoolExecutor:
    """A pool of at least ``workers`` threads (the caller runs one more share itself)."""
    global _ROW_POOL
    with _ROW_POOL_LOCK:
        if _ROW_POOL is None or _ROW_POOL[0] < workers:
            _ROW_POOL = (workers, ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvstitch-rows"))
        return _ROW_POOL[1]
