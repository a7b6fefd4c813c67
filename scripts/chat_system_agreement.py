"""What caching chunks once for every system prompt costs in agreement with full prefill.

Two layouts of the same conversation prompt (identical token ids, so one full prefill is the reference):

    segment  chunks precomputed after the canonical chat prefix, the system prompt stitched as one more
             segment (what kvstitch does: one set of chunk caches serves every system prompt)
    prefix   the system prompt inside the shared prefix: chunks precomputed after prefix + system prompt
             (one set of chunk caches per system prompt)

For each layout and method: mean KL(full || method) over the teacher-forced full-prefill answer, answer NLL,
first-token and per-token top-1 agreement, and the number of chunk caches K system prompts need.
Writes JSON + a markdown table.

    .venv/bin/python scripts/chat_system_agreement.py --task niah_multikey --length 2048 --n 10 \\
        --methods naive,random,prophet,infoflow --ratio 0.2 --threads 1 --out docs/results
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from kvstitch import Engine
from kvstitch.tasks.metrics import answer_nll, kl_full_vs_method
from kvstitch.tasks.tasks import generate
from kvstitch.core.prompt import PromptLayout

SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are the support agent of Acme Corp. Be concise and polite, and never make up facts.",
    "You are a research assistant. Answer from the passages only; if they do not say, say you do not know.",
]


def layouts(eng: Engine, system: str, question: str, chunks: list[str]) -> dict[str, PromptLayout]:
    seg = eng.builder.build_messages([{"role": "system", "content": system}, {"role": "user", "content": question}],
                                     chunks)
    pre = PromptLayout(torch.cat([seg.prefix_ids, seg.chunk_ids[0]]), seg.chunk_ids[1:], seg.suffix_ids)
    assert torch.equal(seg.ids, pre.ids)  # the same prompt, only the caching differs
    return {"segment": seg, "prefix": pre}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--task", default="niah_multikey")
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--chunk-tokens", type=int, default=256)
    ap.add_argument("--n", type=int, default=10)
    ap.add_argument("--systems", type=int, default=len(SYSTEM_PROMPTS), help="how many system prompts (<= 3)")
    ap.add_argument("--methods", default="naive,random,prophet,infoflow")
    ap.add_argument("--ratio", type=float, default=0.2)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", type=Path, default=Path("docs/results"))
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)

    eng = Engine.load(a.model, stitch_adapter=None)
    count = lambda t: len(eng.tokenizer.encode(t, add_special_tokens=False))  # noqa: E731
    samples = generate(a.task, a.n, a.length, a.chunk_tokens, 0, count)
    methods = [m for m in a.methods.split(",") if m]
    systems = SYSTEM_PROMPTS[:a.systems]
    rows: dict[tuple[str, str], dict[str, list[float]]] = {}
    keys: dict[str, set] = {"segment": set(), "prefix": set()}
    t0 = time.perf_counter()
    for si, sample in enumerate(samples):
        for system in systems:
            lays = layouts(eng, system, sample.question, sample.chunks)
            for name, lay in lays.items():
                keys[name].update(eng.chunk_key(lay.prefix_ids, c) for c in lay.chunk_ids)
            ref = eng.generate(method="full", layout=lays["segment"], max_new_tokens=a.new_tokens)
            answer = torch.tensor(ref.token_ids, dtype=torch.long)
            full, _, _ = eng.answer_logits(lays["segment"], answer, "full")
            for m in methods:
                for name, lay in lays.items():
                    logits, _, _ = eng.answer_logits(lay, answer, m, a.ratio)
                    r = rows.setdefault((name, m), {"kl": [], "nll": [], "first": [], "top1": [], "nll_full": []})
                    r["kl"].append(kl_full_vs_method(full, logits))
                    r["nll"].append(answer_nll(logits, answer))
                    r["nll_full"].append(answer_nll(full, answer))
                    r["first"].append(float(int(logits[0].argmax()) == int(answer[0])))
                    r["top1"].append(float((logits.argmax(-1) == answer).float().mean()))
        print(f"sample {si + 1}/{len(samples)} done ({time.perf_counter() - t0:.0f} s)", flush=True)

    table = []
    for (name, m), r in sorted(rows.items(), key=lambda kv: (methods.index(kv[0][1]), kv[0][0])):
        table.append({"layout": name, "method": m, "ratio": a.ratio, "n": len(r["kl"]),
                      "kl": statistics.fmean(r["kl"]), "nll": statistics.fmean(r["nll"]),
                      "nll_full": statistics.fmean(r["nll_full"]), "first_token_agree": statistics.fmean(r["first"]),
                      "top1_agree": statistics.fmean(r["top1"])})
    out = {"model": a.model or "smollm2", "task": a.task, "length": a.length, "chunk_tokens": a.chunk_tokens,
           "n": a.n, "systems": systems, "methods": methods, "ratio": a.ratio, "new_tokens": a.new_tokens,
           "chunk_caches": {k: len(v) for k, v in keys.items()}, "rows": table,
           "seconds": round(time.perf_counter() - t0, 1)}
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "chat_system_agreement.json").write_text(json.dumps(out, indent=2))
    md = ["# System prompt as a stitched segment vs inside the shared prefix\n",
          f"`scripts/chat_system_agreement.py --task {a.task} --length {a.length} --n {a.n} --methods {a.methods} "
          f"--ratio {a.ratio}`; {len(systems)} system prompts x {a.n} samples; teacher-forced on the "
          f"full-prefill answer ({a.new_tokens} tokens). Chunk caches needed: segment "
          f"{out['chunk_caches']['segment']}, prefix {out['chunk_caches']['prefix']}.\n",
          "| method | layout | KL(full‖method) | answer NLL (full) | first token agrees | top-1 agrees |",
          "|---|---|---|---|---|---|"]
    for r in table:
        md.append(f"| {r['method']} | {r['layout']} | {r['kl']:.4f} | {r['nll']:.3f} ({r['nll_full']:.3f}) | "
                  f"{r['first_token_agree']:.0%} | {r['top1_agree']:.0%} |")
    (a.out / "chat_system_agreement.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
