"""What the CPU decode kernels (`paged_kernel`, `rank_kernel`, `append_kernel`) share: numba when the optional
``kvstitch[fast]`` extra is installed, the switch that turns them off, raw-address intrinsics, and the split of a
batch's (row, KV head) pairs over threads."""

from __future__ import annotations

import os

import numpy as np
import torch

from .row_threads import row_pool

try:
    import numba
    from numba import types
    from numba.extending import intrinsic
    from llvmlite import ir
except ImportError:  # the optional `fast` extra is not installed: the torch path runs
    numba = None


# Switch for the kernels: used when they apply (``KVSTITCH_PAGED_KERNEL=0``: never, e.g. to time the torch path;
# tests set it to compare both). Read at every call, so setting it here switches every kernel module.
ENABLED = os.environ.get("KVSTITCH_PAGED_KERNEL", "1") != "0"


def available() -> bool:
    """Whether the numba kernels can run (numba importable)."""
    return numba is not None


def usable(device) -> bool:
    """Whether the kernels run for tensors on ``device``: numba present, `ENABLED`, and the CPU."""
    return ENABLED and numba is not None and (device if isinstance(device, torch.device)
                                              else torch.device(device)).type == "cpu"


if numba is not None:

    def _address_as(element):
        """An intrinsic viewing an int64 address as an ``element*``: each row's pool is a separate tensor, and a
        list of arrays would cost ~100 us per call to build (numba's typed list) where the addresses cost ~1 us."""

        @intrinsic
        def cast(typingctx, address):
            sig = types.CPointer(element)(types.int64)

            def codegen(context, builder, signature, args):
                return builder.inttoptr(args[0], context.get_value_type(signature.return_type))

            return sig, codegen

        return cast

    f32_pointer = _address_as(types.float32)  # pools and digests
    i64_pointer = _address_as(types.int64)  # token-position maps

    @intrinsic
    def prefetch(typingctx, address):
        """A hint to start loading the cache line at ``address`` (int64) into every cache level (x86 PREFETCHT0)."""
        sig = types.void(types.int64)

        def codegen(context, builder, signature, args):
            i8p, i32 = ir.PointerType(ir.IntType(8)), ir.IntType(32)
            fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
            fn = builder.module.declare_intrinsic("llvm.prefetch", [i8p], fnty)
            builder.call(fn, [builder.inttoptr(args[0], i8p), i32(0), i32(3), i32(1)])  # read, keep, data
            return context.get_dummy_value()

        return sig, codegen


def addresses(tensors: list[torch.Tensor]) -> np.ndarray:
    """Each tensor's data address (a kernel views row b's tensor through `f32_pointer` / `i64_pointer`)."""
    return np.array([t.data_ptr() for t in tensors], dtype=np.int64)


def split_pairs(kernel, args: tuple, pairs: int, workers: int | None) -> None:
    """``kernel(*args, share, shares)`` over its ``pairs`` (row, KV head) pairs, split over ``workers`` threads
    (default: torch's intra-op thread count; the kernel releases the GIL)."""
    workers = min(workers or torch.get_num_threads(), pairs)
    if workers < 2:
        kernel(*args, 0, 1)
        return
    futures = [row_pool(workers - 1).submit(kernel, *args, w, workers) for w in range(1, workers)]
    kernel(*args, 0, workers)
    for f in futures:
        f.result()


def int64_array(t: torch.Tensor) -> np.ndarray:
    """``t`` as a contiguous int64 numpy array on the CPU (what the kernels index with)."""
    return t.to("cpu", torch.int64).contiguous().numpy()
