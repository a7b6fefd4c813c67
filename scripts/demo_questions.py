"""Choose the demo's questions and default model by measurement.

    python scripts/demo_questions.py --model qwen2.5-0.5b [--candidates FILE] [--settings prophet@auto,prophet@0.2]

For every candidate question (the bundled demo's, or FILE's: {"passages": [...], "questions": [{question,
answer}]}): does full prefill's answer contain the expected text (a question full prefill fails is dropped from
the demo for that reason alone, never because a stitched method failed it), and, for each stitched setting,
does its answer say what full prefill says (first 12 words) and at what TTFT speed-up. Prints one line per
question and setting, then per setting: agreement on the questions full prefill answers, median speed-up.
"""

from __future__ import annotations

import argparse
import json
import statistics
from importlib import resources

import torch

from kvstitch import Engine
from kvstitch.engine.budget import AutoBudget, parse_ratio
from kvstitch.tasks.agreement import first_words_agree


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--candidates", default=None)
    ap.add_argument("--settings", default="prophet@auto,prophet@0.2")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--dtype", default=None, help="model dtype (default: float32 on CPU)")
    ap.add_argument("--auto", default=None, help="options of the @auto settings, JSON (default: AutoBudget's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    src = open(args.candidates) if args.candidates else resources.files("kvstitch").joinpath(
        "data/samples/demo.json").open()
    demo = json.load(src)
    eng = Engine.load(args.model, dtype=args.dtype, stitch_adapter=None)
    passages = demo["passages"]
    print(f"{len(passages)} passages, {eng.layout('q', passages).n_context} context tokens", flush=True)
    eng.generate(demo["questions"][0]["question"], passages, method="naive", max_new_tokens=1)  # warm + precompute
    settings = [(m, parse_ratio(r)) for m, r in (s.split("@") for s in args.settings.split(","))]
    auto = AutoBudget.of(json.loads(args.auto)) if args.auto else None  # the @auto settings' budget
    agree = {s: [] for s in settings}
    speed = {s: [] for s in settings}
    for q in demo["questions"]:
        full = eng.generate(q["question"], passages, method="full", max_new_tokens=24)
        ok = q["answer"].lower() in full.text.lower()
        print(f"full {'right' if ok else 'WRONG'} {q['question']!r} -> {full.text!r} ({full.ttft_s:.2f}s)", flush=True)
        for m, r in settings:
            res = eng.generate(q["question"], passages, method=m, max_new_tokens=24,
                               recompute_ratio=auto if r == "auto" and auto is not None else r)
            same = first_words_agree(res.text, full.text)
            if ok:
                agree[(m, r)].append(same)
                speed[(m, r)].append(full.ttft_s / res.ttft_s)
            print(f"   {m}@{r}: {'same' if same else 'DIFFERENT'} {res.text!r} {full.ttft_s / res.ttft_s:.2f}x "
                  f"(used {res.stats.get('ratio_used')}"
                  + "".join(f", round {x['ratio']:.2f} min p {x['min_p']:.3f}"
                            + (f" said {x['answer']!r} verified {x['verified']}" if "verified" in x else "")
                            for x in res.stats.get("round_log", []))
                  + (f", short prompt {res.stats['verify']['answer']!r}" if "verify" in res.stats else "")
                  + ")", flush=True)
    for s in settings:
        if agree[s]:
            print(f"{s[0]}@{s[1]}: agrees on {sum(agree[s])}/{len(agree[s])} questions full prefill answers, median "
                  f"speed-up {statistics.median(speed[s]):.2f}x")


if __name__ == "__main__":
    main()
