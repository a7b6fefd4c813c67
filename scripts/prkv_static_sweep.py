"""PRKV's static-ratio ablation (PRKV Sec. 5.3 / Fig. 8) on the embedded model: attention recall per S.

One prefill of a RULER needle sample, then for each S (0 = fully dynamic pages, 1 = fully static,
"auto" = App. G's online choice) a diagnostic decode teacher-forced with dense decode's tokens, as
`kvstitch bench decode` does. Writes JSON + a markdown table.

    .venv/bin/python scripts/prkv_static_sweep.py --context 8192 --budget 1024 --out docs/results
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from kvstitch import Engine
from kvstitch.decode.model_bench import _Sample, _selecting_recall
from kvstitch.eval.tasks import generate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--ratios", default="0,0.25,0.5,0.75,1,auto")
    ap.add_argument("--page-size", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=160)
    ap.add_argument("--out", type=Path, default=Path("docs/results"))
    a = ap.parse_args()

    eng = Engine.load(a.model) if a.model else Engine.load()
    length = min(a.context, eng.adapter.max_positions - 256)
    count = lambda t: len(eng.tokenizer.encode(t, add_special_tokens=False))  # noqa: E731
    sample = generate("niah_multikey", 1, length, 256, 0, count)[0]
    s = _Sample(eng, sample, "full", 0.0, a.new_tokens + 1, None)
    cache, _ = s.runner(None, None, {})
    ref = [s.first]
    for _ in range(a.new_tokens):
        ref.append(int(torch.argmax(eng.decode_step(cache, ref[-1])[-1])))
    rows = []
    for r in a.ratios.split(","):
        ratio = r if r == "auto" else float(r)
        cache, dec = s.runner("prkv", a.budget, {"static_ratio": ratio, "page_size": a.page_size}, diagnostic=True)
        agree = sum(int(torch.argmax(eng.decode_step(cache, ref[t], dec)[-1])) == ref[t + 1]
                    for t in range(a.new_tokens))
        ratios = [x for x in dec.static_ratios() if x is not None]
        rows.append({"static_ratio": r, "budget": a.budget, "page_size": a.page_size, "context_tokens": s.layout.n_context,
                     **_selecting_recall(dec), "top1_agreement": agree / a.new_tokens,
                     "mean_chosen_ratio": sum(ratios) / len(ratios) if ratios else None})
        print(rows[-1], flush=True)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "prkv_static_sweep.json").write_text(json.dumps(rows, indent=1))
    lines = ["| S | budget | page | context | recall | oracle | top-1 agree | mean S chosen |", "|" + "---|" * 8]
    lines += [f"| {r['static_ratio']} | {r['budget']} | {r['page_size']} | {r['context_tokens']} | {r['recall']:.3f} | "
              f"{r['oracle_recall']:.3f} | {r['top1_agreement']:.2f} | "
              f"{'-' if r['mean_chosen_ratio'] is None else format(r['mean_chosen_ratio'], '.2f')} |" for r in rows]
    (a.out / "prkv_static_sweep.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
