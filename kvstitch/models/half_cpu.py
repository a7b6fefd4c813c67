"""Half precision (bfloat16 / float16) on a CPU that cannot multiply it natively.

A CPU without AVX512-BF16 or AMX (an AVX2 EPYC, most laptops) has no fast half-precision GEMM: torch falls back to
a scalar kernel, and a Qwen2.5 0.5B prefill in bfloat16 measured 6x slower than in float32, 98% of it in the
linear layers (`scripts/time_conversion_and_dtype.py`). That kernel already multiplies in float32 and rounds the
result to the half dtype once (products of two bf16 / fp16 numbers are exact in float32), so a linear layer that
upcasts its input and weight, multiplies with the float32 BLAS and rounds the output gives the same numbers, up to
the order of the float32 sum (measured: 1 element in 10^4 differs by one half-precision ulp), at float32's speed
(the same 1K-token Qwen prefill: 16.8 s, against 89.7 s on torch's kernel and 15.9 s in float32,
`docs/results/demo/dtype-avx2.log`).

`upcast_linears` switches a loaded model's half-precision `nn.Linear`s to `UpcastLinear`; `load_model` does it on
such CPUs. Weights stay in the half dtype (half the memory); only the layer being run is upcast, and only for
inputs of at least `UPCAST_MIN_ROWS` tokens (one decode token is cheaper on the scalar kernel than converting the
weight). GPUs and CPUs with native bf16 never take this path.

``KVSTITCH_NATIVE_HALF=0`` takes it on any CPU (to reproduce, on an AVX512-BF16 machine, what an AVX2 machine
runs) and ``=1`` never takes it; unset, the CPU's features decide.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

HALF_DTYPES = (torch.bfloat16, torch.float16)
UPCAST_MIN_ROWS = 16  # measured break-even on an AVX2 CPU: 4 rows 4.5 ms scalar vs 10 ms upcast, 64 rows 59 vs 17


def multiplies_natively(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether ``device`` has a fast GEMM for ``dtype`` (float32 always; bfloat16 on CUDA with bf16 support or a
    CPU with AVX512-BF16 / AMX; float16 on CUDA or a CPU with AMX-FP16)."""
    if dtype not in HALF_DTYPES:
        return True
    if device.type == "cuda":
        return dtype == torch.float16 or torch.cuda.is_bf16_supported()
    if device.type != "cpu":
        return False  # other accelerators (mps, xpu): not known to
    forced = os.environ.get("KVSTITCH_NATIVE_HALF", "").strip()
    if forced in ("0", "1"):
        return forced == "1"
    # torch.cpu's feature probes are private: where one is missing, assume no native support
    names = ("_is_avx512_bf16_supported", "_is_amx_tile_supported") if dtype == torch.bfloat16 else ("_is_amx_fp16_supported",)
    probes = [getattr(torch.cpu, name, None) for name in names]
    return any(p is not None and p() for p in probes)


class UpcastLinear(nn.Linear):
    """An `nn.Linear` with half-precision weights that multiplies in float32 for inputs of many rows, rounding
    the output back to the weight's dtype (the arithmetic of a native half-precision GEMM)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() < UPCAST_MIN_ROWS * self.in_features:
            return super().forward(x)
        bias = None if self.bias is None else self.bias.float()
        return F.linear(x.float(), self.weight.float(), bias).to(self.weight.dtype)


def upcast_linears(model: nn.Module) -> int:
    """Switch every half-precision `nn.Linear` of ``model`` to `UpcastLinear` in place (parameters untouched);
    returns how many."""
    n = 0
    for module in model.modules():
        if type(module) is nn.Linear and module.weight.dtype in HALF_DTYPES:
            module.__class__ = UpcastLinear
            n += 1
    return n
