"""Ship a trained stitch adapter for an embedded model: kvstitch/data/adapters/NAME.safetensors (its
tensors in float16: half the size, what `Engine.load(NAME, stitch_adapter="default")` reads) and NAME.json (the
command, corpus, steps and CPU-hours that made it, from the adapter's own header).

    python scripts/ship_adapter.py RUN_DIR NAME [--note "how the run was made, where its command alone does not say"]
        [--on-by-default]  (used when none is asked for: only where it measured better than none)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from kvstitch.adapt.train import adapter_card
from kvstitch.models.loader import embedded_name
from kvstitch.models.stitch_adapter import SHIPPED_DIR, StitchAdapter


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path, help="a `kvstitch adapt --out` directory")
    ap.add_argument("name", help="the embedded model (smollm2, qwen2.5-0.5b, ...)")
    ap.add_argument("--note", default="", help="kept in the card beside the command")
    ap.add_argument("--on-by-default", action="store_true",
                    help="`stitch_adapter=\"auto\"` (the default of Engine.load, run, demo, serve) uses it")
    args = ap.parse_args(argv)
    ad = StitchAdapter.load(args.run_dir / "adapter.safetensors")
    if embedded_name(ad.weights_id) not in (None, args.name):
        raise SystemExit(f"{args.run_dir} holds an adapter for {embedded_name(ad.weights_id)}, not {args.name}")
    path = ad.save(SHIPPED_DIR / f"{args.name}.safetensors", dtype=torch.float16)
    made = adapter_card(path)
    if args.note:
        made["note"] = args.note
    made["on_by_default"] = args.on_by_default
    (SHIPPED_DIR / f"{args.name}.json").write_text(json.dumps(made, indent=1) + "\n", encoding="utf-8")
    print(f"{path} ({path.stat().st_size / 1e6:.2f} MB): {ad.config.form}, {made['steps']} steps, "
          f"{made['cpu_hours']} CPU-hours")


if __name__ == "__main__":
    main()
