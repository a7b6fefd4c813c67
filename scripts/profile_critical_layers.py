"""Profile a model's critical layers for `qcfuse` (`kvstitch.select.critical`): per layer, how much of full
prefill's selection that layer's QCFuse selection alone recovers, on a few tuning samples; the ranking (best
first) is what `kvstitch.models.loader.CRITICAL_LAYERS` records.

    python scripts/profile_critical_layers.py --model qwen2.5-0.5b --samples 0:3 --max-chunks 5 \
        --out docs/results/qcfuse/critical-qwen2.5-0.5b.json

Samples come from a dataset (default the bundled MuSiQue; its samples 0-49 are the tuning range, the
report split is 50-149) and run at 1 thread by default.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from kvstitch import Engine
from kvstitch.select.critical import profile_critical_layers
from kvstitch.tasks.datasets import load_dataset, parse_range


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="embedded model name or path (default smollm2)")
    ap.add_argument("--dataset", default="musique")
    ap.add_argument("--samples", default="0:4", help="sample range start:stop (tuning samples)")
    ap.add_argument("--max-chunks", type=int, default=None,
                    help="keep only each sample's first N passages (shorter runs)")
    ap.add_argument("--ratio", type=float, default=0.2, help="selection size as a share of the context")
    ap.add_argument("--top", type=int, default=10, help="how many layers the table keeps")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None, help="JSON file for the ranking and per-layer recalls")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    start, stop = parse_range(args.samples)
    samples = load_dataset(args.dataset, start, stop)
    eng = Engine.load(args.model, cold_path="stitched", stitch_adapter=None)
    layouts = [eng.layout(s.question, s.chunks[:args.max_chunks]) for s in samples]
    t0 = time.perf_counter()
    got = profile_critical_layers(eng, layouts, args.ratio)
    got.update(model=args.model or "smollm2", weights=eng.weights_id, dataset=args.dataset, range=args.samples,
               max_chunks=args.max_chunks,
               top=got["ranking"][:args.top], context_tokens=[lay.n_context for lay in layouts],
               seconds=round(time.perf_counter() - t0, 1), threads=args.threads)
    line = ", ".join(f"{i}: {got['recall'][i]:.3f}" for i in got["top"])
    print(f"{got['model']}: critical layers (best first) {got['top']}  recall {line}  ({got['seconds']} s)")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(got, indent=1) + "\n")


if __name__ == "__main__":
    main()
