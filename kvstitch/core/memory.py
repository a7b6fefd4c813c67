"""The process's memory as long runs report it (eval's per-sample lines, adapt's loss rows): watched from their logs,
a run that grows toward the machine's limit shows it before the kernel ends it."""

from __future__ import annotations

import os


def resident_bytes() -> int | None:
    """The process's resident memory now, not its peak (Linux: /proc/self/statm); None where it cannot be read."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def resident_gib() -> float | None:
    """`resident_bytes` in GiB, to two decimals."""
    b = resident_bytes()
    return None if b is None else round(b / 2**30, 2)
