"""Time one layer's attention forward + backward in a stitch-adapter training step (docs/design.md, "CPU dtype"):
Qwen2.5 0.5B's shape (14 query heads over 2 KV heads, head size 64), the question and answer's 36 tokens over a
6K-token stitched context, gradients to queries, keys and values. bfloat16 on torch's half flash kernel against the
float32 path `kvstitch.core.attention` takes when gradients are on.

    python scripts/time_attention_backward.py --threads 1
"""

from __future__ import annotations

import argparse
import time
from types import SimpleNamespace

import torch

from kvstitch.core import attention
from kvstitch.core.attention import ForwardPlan, kvstitch_attention


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--keys", type=int, default=6000)
    ap.add_argument("--queries", type=int, default=36)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    hq, hkv, d, n, t = 14, 2, 64, args.keys, args.queries
    slots = torch.arange(n - t, n)
    gen = torch.Generator().manual_seed(0)
    q0, k0, v0 = (torch.randn(1, h, m, d, generator=gen).bfloat16() for h, m in ((hq, t), (hkv, n), (hkv, n)))

    def step(float32: bool) -> None:
        q, k, v = (x.clone().requires_grad_(True) for x in (q0, k0, v0))
        if float32:
            out, _ = kvstitch_attention(SimpleNamespace(layer_idx=0), q, k, v, scaling=d ** -0.5,
                                        kvstitch_plan=ForwardPlan(q_slots=slots))
        else:  # the same split kernel call, in bfloat16
            out = attention._attend_split(q, k, v, slots, d ** -0.5)
        out.float().sum().backward()

    ms = {}
    for name, float32 in (("bfloat16 (torch's half kernel)", False), ("float32 (kvstitch, with gradients)", True)):
        step(float32)
        t0 = time.perf_counter()
        for _ in range(args.repeats):
            step(float32)
        ms[name] = (time.perf_counter() - t0) / args.repeats * 1000
    print(f"| attention, forward + backward, one layer ({t} queries over {n} keys, {args.threads} thread(s)) | ms |")
    print("|---|---|")
    for name, v in ms.items():
        print(f"| {name} | {v:.1f} |")
    first, second = ms.values()
    print(f"\nratio: {first / second:.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
