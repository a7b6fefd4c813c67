"""Time the two things that made the demo fit in four minutes (docs/results/demo/README.md, docs/design.md):

1. converting Qwen's GGUF into the cached safetensors directory, with transformers' three metadata parses
   and with kvstitch's one (`kvstitch.models.loader._gguf_parsed_once`), each into an empty temporary cache;
2. a 1K-token Qwen prefill in float32 and in bfloat16 (the demo's `dtype="fast"` on a CPU with AVX512-BF16);
   on a CPU without native bf16 also with torch's own bf16 kernels, against kvstitch's float32-multiplying
   linear layers (`kvstitch.models.half_cpu`), which `load_model` uses there.

    python scripts/time_conversion_and_dtype.py --threads 1 > docs/results/demo/conversion-and-dtype.log
    python scripts/time_conversion_and_dtype.py --threads 1 --no-conversion > docs/results/demo/dtype-avx2.log
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch


def time_conversion() -> None:
    from kvstitch.models import loader

    gguf = loader.embedded_gguf("qwen2.5-0.5b")
    parse_once = loader._gguf_parsed_once
    for label, ctx in (("transformers' three parses", contextlib.nullcontext), ("one parse (kvstitch)", parse_once)):
        with tempfile.TemporaryDirectory() as tmp:
            os.environ["KVSTITCH_CACHE"] = tmp
            local = Path(tmp) / "gguf" / gguf.name
            local.parent.mkdir(parents=True)
            shutil.copyfile(gguf, local)
            loader._gguf_parsed_once = ctx
            t0 = time.perf_counter()
            loader._dequantized_dir(local, "timing")
            print(f"convert Qwen GGUF, {label}: {time.perf_counter() - t0:.1f} s", flush=True)
    loader._gguf_parsed_once = parse_once


def time_dtypes(tokens: int) -> None:
    from torch import nn

    from kvstitch.models.half_cpu import UpcastLinear
    from kvstitch.models.loader import load_model

    ids = torch.randint(100, 20000, (1, tokens), generator=torch.Generator().manual_seed(0))
    for dtype in (torch.float32, torch.bfloat16):
        model, _, _ = load_model("qwen2.5-0.5b", "cpu", dtype)
        upcast = [m for m in model.modules() if type(m) is UpcastLinear]
        variants = [("", None)]
        if upcast:  # no native bf16 here: kvstitch's layers, then torch's own kernels for comparison
            variants = [(" (linear layers multiply in float32)", UpcastLinear), (" (torch's bf16 kernels)", nn.Linear)]
        for label, cls in variants:
            for m in upcast:
                m.__class__ = cls
            with torch.no_grad():
                model(ids[:, :64])  # warm-up
                t0 = time.perf_counter()
                logits = model(ids, logits_to_keep=1).logits[0, -1].float()
            print(f"prefill {tokens} tokens, {str(dtype).removeprefix('torch.')}{label}: "
                  f"{time.perf_counter() - t0:.1f} s, next token {int(logits.argmax())}", flush=True)
        del model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--no-conversion", action="store_true", help="time the prefills only")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch threads: {torch.get_num_threads()}", flush=True)
    if not args.no_conversion:
        time_conversion()
    time_dtypes(args.tokens)


if __name__ == "__main__":
    main()
