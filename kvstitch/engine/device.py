"""Where and in what precision a model runs: the default device, the quicker dtype on it (`fast_dtype`), and the
machine's CPU name (eval rows carry it)."""

from __future__ import annotations

import contextlib
import functools
import platform

import torch

from kvstitch.models.half_cpu import multiplies_natively


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def fast_dtype(device: torch.device | None = None) -> str:
    """The quicker model dtype on ``device``: bfloat16 where it multiplies bf16 natively (CUDA with bf16 support;
    a CPU with AVX512-BF16 or AMX: on this project's CPU, 1.8x faster Qwen prefill than float32), else float32.
    `Engine.load`'s default stays float32 on CPU (the exactness gates and the published runs use it); the demo
    takes this one (``dtype="fast"``)."""
    dev = device or default_device()
    return "bfloat16" if multiplies_natively(torch.bfloat16, dev) else "float32"


@functools.cache  # one machine per process
def cpu_name() -> str:
    """This machine's CPU model ("AMD EPYC", "Intel(R) Xeon(R) ..."): eval rows carry it, since a run resumed on
    another machine times its samples there (TTFT ratios pool them)."""
    with contextlib.suppress(OSError):  # no /proc (macOS, Windows): platform's name
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "unknown"
