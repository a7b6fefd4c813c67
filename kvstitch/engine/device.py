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
    """This machine's CPU model and the kernels torch runs on it ("AMD EPYC (AVX2)", "AMD EPYC (AVX512, native
    bf16)"): eval rows carry it, since a run resumed on another machine times its samples there (TTFT ratios pool
    them), and one model name covers CPUs whose half-precision prefill differs 4x in speed."""
    name = ""
    with contextlib.suppress(OSError):  # no /proc (macOS, Windows): platform's name
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    name = name or platform.processor() or platform.machine() or "unknown"
    kernels = [torch.backends.cpu.get_cpu_capability()]
    if multiplies_natively(torch.bfloat16, torch.device("cpu")):
        kernels.append("native bf16")
    return f"{name} ({', '.join(kernels)})"
