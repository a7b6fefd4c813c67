"""Why does `deltaprop` corrupt a needle's digits where prophet copies them? One NIAH sample at a time: each
variant's greedy answer beside the gold one, and which of the answer's context tokens the variant recomputed
(R), left uncorrected by a guard (G) or left stale (.), from 6 tokens before each needle value (gold and
distractors) to 2 after.

Two fixes are tried here, outside the library (the script subclasses `deltaprop`):
- guard: stale tokens within ``window`` positions of the base's top-scored ``top`` fraction of the context keep
  their stitched K/V (no correction), i.e. the spans the query reads from are left as a plain recompute leaves them;
- span: those same tokens are recomputed first (inside the budget), then the base's ranking fills the rest.

No full prefill is run (it is the costly part at 8K): the gold answer is the reference here, and
`docs/results/own-method/qwen-niah-8k-report/results.jsonl` holds full prefill's answers for the report samples.

    python scripts/deltaprop_diagnose.py --model qwen2.5-0.5b --task niah_multikey --seed 13 --n 40 --index 11,16
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvstitch import Engine
from kvstitch.eval.runner import EvalConfig, answer_budget, sample_layout
from kvstitch.select import make_selector
from kvstitch.select.context import top_k_indices
from kvstitch.select.deltaprop import DeltaProp
from kvstitch.tasks import generate


def guard_mask(scores: torch.Tensor, top: float, window: int) -> torch.Tensor:
    """bool [n]: within ``window`` positions of one of the ``ceil(top * n)`` highest ``scores``."""
    n = scores.numel()
    anchors = torch.zeros(n)
    anchors[top_k_indices(scores.float().cpu(), max(1, int(-(-top * n // 1))))] = 1.0
    return torch.nn.functional.max_pool1d(anchors[None, None], 2 * window + 1, stride=1, padding=window)[0, 0] > 0


@dataclass
class Guarded(DeltaProp):
    """deltaprop, with the guarded span left uncorrected ("guard") or recomputed first ("span")."""

    name: ClassVar[str] = "deltaprop (diagnosis)"
    top: float = 0.01
    window: int = 8
    mode: str = "guard"

    def pick(self, scores, ctx):
        g = guard_mask(scores, self.top, self.window)
        if self.mode == "span":
            scores = torch.where(g, scores.max() + 1 + scores, scores)  # the span first, inside the budget
        idx = super().pick(scores, ctx)
        if self.mode == "guard":
            ctx.cache.fresh |= g.to(ctx.cache.fresh.device)  # "fresh" context tokens are never corrected
        return idx


VARIANTS = {  # name -> selector factory
    "prophet": lambda: make_selector("prophet"),
    "deltaprop": lambda: make_selector("deltaprop"),
    "deltaprop values only": lambda: make_selector("deltaprop", alpha_k=0.0),
    "deltaprop keys only": lambda: make_selector("deltaprop", alpha_v=0.0),
    "deltaprop guard 1%/8": lambda: Guarded(top=0.01, window=8),
    "deltaprop guard 0.2%/8": lambda: Guarded(top=0.002, window=8),
    "deltaprop guard 5%/8": lambda: Guarded(top=0.05, window=8),
    "deltaprop span 0.2%/8": lambda: Guarded(top=0.002, window=8, mode="span"),
    "prophet span 0.2%/8": lambda: Guarded(top=0.002, window=8, mode="span", alpha_v=0.0, alpha_k=0.0,
                                            probe_stride=0),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen2.5-0.5b")
    ap.add_argument("--task", default="niah_multikey")
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--seed", type=int, default=13)
    ap.add_argument("--n", type=int, default=40, help="the run's --n (a sample's depth depends on it)")
    ap.add_argument("--index", default="11", help="comma list of sample indices")
    ap.add_argument("--ratio", type=float, default=0.2)
    ap.add_argument("--variants", default="all", help="comma list of variant names (default all)")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    eng = Engine.load(args.model, stitch_adapter=None)
    count = lambda t: len(eng.tokenizer.encode(t, add_special_tokens=False))  # noqa: E731
    samples = list(generate(args.task, args.n, args.length, 256, args.seed, count, haystack="essays"))
    cfg = EvalConfig(tasks=[], lengths=[args.length], methods=[], ratios=[])
    print(f"# {args.model}, {args.task} {args.length}, seed {args.seed}, n {args.n}, ratio {args.ratio}", flush=True)
    for i in map(int, args.index.split(",")):
        s = samples[i]
        lay = sample_layout(eng, s)
        budget = answer_budget(eng, s, cfg)
        eng.chunk_kvs(lay)
        ctx = torch.cat(lay.chunk_ids).tolist()
        values = s.answers + [v for v in dict.fromkeys(re.findall(r"\b\d{7}\b", " ".join(s.chunks)))
                              if v not in s.answers]  # the gold values, then the distractor needles'
        spans = []
        for a in values:
            ids = eng.tokenizer.encode(a, add_special_tokens=False)
            spans += [(i0, i0 + len(ids)) for i0 in range(len(ctx) - len(ids) + 1) if ctx[i0:i0 + len(ids)] == ids]
        print(f"\n## {args.task} #{i}: gold {s.answers}, distractors {values[len(s.answers):]}; value tokens "
              f"at {spans}; marks: R recomputed, G left uncorrected by a guard, . stale (corrected, under deltaprop)", flush=True)
        for name in (list(VARIANTS) if args.variants == "all" else args.variants.split(",")):
            make = VARIANTS[name]
            pre = eng.prefill(lay, "deltaprop", args.ratio, budget, selector=make())
            answer = eng.tokenizer.decode(list(eng.decode_tokens(pre, budget))).strip()
            got = all(a in answer for a in s.answers[:1]) if "multikey" in args.task else \
                sum(a in answer for a in s.answers) / len(s.answers)
            sel = set(pre.indices.tolist())
            kept = pre.cache.fresh.tolist() if hasattr(pre.cache, "fresh") else [False] * len(ctx)
            marks = " ".join("".join("R" if j in sel else "G" if kept[j] else "." for j in range(a - 6, b + 2))
                             for a, b in spans)
            print(f"{name:24s} gold {float(got):.2f}  {answer[:40]!r:44s} {marks}", flush=True)


if __name__ == "__main__":
    main()
