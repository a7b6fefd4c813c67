"""Ablation of `deltaprop` (kvstitch's own method) against its base selection, on NIAH tuning seeds.

Per sample: full prefill's greedy answer T (the reference), naive reuse, then every variant at the same ratio;
each variant's NLL of T (teacher-forced) gives the pooled NLL-gap recovery (naive -> full), and its greedy
answer (read off the teacher-forced pass when its argmax reproduces T, i.e. the same answer as full prefill's)
gives the agreement. Prefill times are measured in the same process (ratios of means).

    python scripts/deltaprop_ablation.py --length 2048 --n 4 --seed 5 --out docs/results/own-method/ablation-2k-s5
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from kvstitch import Engine
from kvstitch.select import SelectionContext, make_selector
from kvstitch.tasks import generate
from kvstitch.tasks.metrics import answer_nll
from kvstitch.eval.runner import EvalConfig, answer_budget, sample_layout

VARIANTS = {  # name -> (method, options); deltaprop's options spelled out (its defaults: alpha_k 0.25, probes/25)
    "prophet": ("prophet", {}),
    "infoflow": ("infoflow", {}),
    "oracle": ("oracle", {}),
    "deltaprop v, chunk mean": ("deltaprop", {"alpha_k": 0.0, "probe_stride": 0}),
    "deltaprop v, tau=32": ("deltaprop", {"alpha_k": 0.0, "probe_stride": 0, "tau": 32.0}),
    "deltaprop v+k/4": ("deltaprop", {"alpha_k": 0.25, "probe_stride": 0}),
    "deltaprop v+k/2": ("deltaprop", {"alpha_k": 0.5, "probe_stride": 0}),
    "deltaprop v, probes/25": ("deltaprop", {"alpha_k": 0.0, "probe_stride": 25}),
    "deltaprop": ("deltaprop", {}),  # the defaults: v + k/4, probes/25
    "deltaprop v+k/2, probes/25": ("deltaprop", {"alpha_k": 0.5, "probe_stride": 25}),
    "deltaprop v+k, probes/25": ("deltaprop", {"alpha_k": 1.0, "probe_stride": 25}),
    "deltaprop(infoflow)": ("deltaprop", {"base": "infoflow"}),
    "deltaprop, tau=32": ("deltaprop", {"tau": 32.0}),  # nearby probes' shifts count more than the chunk's mean
    "deltaprop v/2": ("deltaprop", {"alpha_v": 0.5}),  # half the measured value shift
    # re-select after a first recompute: the probes' pass corrects the cache, then the base scores over it
    "deltaprop, probes first": ("deltaprop", {"probe_first": True}),
    # the per-token part (fit="linear"): a ridge regression of each token's departure from its chunk's mean shift
    "deltaprop linear": ("deltaprop", {"fit": "linear"}),
    "deltaprop linear, v+k/2": ("deltaprop", {"fit": "linear", "alpha_k": 0.5}),
    "deltaprop linear, v+k": ("deltaprop", {"fit": "linear", "alpha_k": 1.0}),
    # the budget as causal work (budget_unit="work"): the base's top tokens' work buys the most score per unit work
    "deltaprop, work budget": ("deltaprop", {"budget_unit": "work"}),
    "prophet, work budget": ("deltaprop", {"alpha_v": 0.0, "alpha_k": 0.0, "probe_stride": 0, "budget_unit": "work"}),
    # from the newest methods: the probe over anchors selects (QCFuse); tokens by their best rank over the base's
    # layers (RelaxKV's per-layer choice, fusion="union"); recomputed tokens see prefix, own and top passages only
    "qcfuse": ("qcfuse", {}),
    "deltaprop(qcfuse)": ("deltaprop", {"base": "qcfuse"}),
    "deltaprop, union": ("deltaprop", {"fusion": "union"}),
    "deltaprop(infoflow), union": ("deltaprop", {"base": "infoflow", "fusion": "union"}),
    "deltaprop, attend top 2": ("deltaprop", {"attend_top": 2}),
    "deltaprop, attend own": ("deltaprop", {"attend_top": 0}),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--tasks", default="niah_multikey,niah_multivalue,niah_single_essay")
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--ratio", type=float, default=0.2)
    ap.add_argument("--variants", default="all", help="variant names separated by ; (they contain commas; default all)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    names = list(VARIANTS) if args.variants == "all" else [v.strip() for v in args.variants.split(";")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    eng = Engine.load(args.model, stitch_adapter=None)
    cfg = EvalConfig(tasks=[], lengths=[args.length], methods=[], ratios=[])
    count = lambda t: len(eng.tokenizer.encode(t, add_special_tokens=False))  # noqa: E731
    log = out / "rows.jsonl"
    done = {(r["task"], r["index"], r["variant"]) for r in map(json.loads, log.read_text().splitlines())} \
        if log.exists() else set()
    eng.generate("What is the number?", ["The number is 7.", "Bob lives in Rome."], method="prophet",
                 max_new_tokens=2)  # warm-up
    with log.open("a") as f:
        for task in args.tasks.split(","):
            for i, s in enumerate(generate(task, args.n, args.length, 256, args.seed, count, haystack="essays")):
                todo = [v for v in ["full", "naive", *names] if (task, i, v) not in done]
                if not todo:
                    continue
                lay = sample_layout(eng, s)
                work = SelectionContext(engine=eng, cache=None, layout=lay, budget=0).token_work()  # per token
                b = answer_budget(eng, s, cfg)
                eng.chunk_kvs(lay)
                t0 = time.perf_counter()
                fpre = eng.prefill(lay, "full", 0.0, b)
                t_full = time.perf_counter() - t0
                ans = torch.tensor(list(eng.decode_tokens(fpre, b)))
                for v in todo:
                    m, opts = {"full": ("full", {}), "naive": ("naive", {})}.get(v) or VARIANTS[v]
                    t0 = time.perf_counter()
                    pre = eng.prefill(lay, make_selector(m, **opts), args.ratio, b)
                    dt = time.perf_counter() - t0
                    tf = eng.teacher_force(pre, ans)
                    row = {"task": task, "index": i, "variant": v, "nll": answer_nll(tf, ans),
                           "agree": tf.argmax(-1).tolist() == ans.tolist(), "prefill_s": dt, "full_s": t_full,
                           "recomputed": pre.indices.numel() / lay.n_context,
                           "work": float(work[pre.indices.cpu()].sum() / work.sum())}
                    f.write(json.dumps(row) + "\n")
                    f.flush()
                print(task, i, flush=True)
    rows = [json.loads(x) for x in log.read_text().splitlines()]
    report(rows, names, args, out)


def report(rows, names, args, out: Path) -> None:
    by = {}
    for r in rows:
        by.setdefault((r["task"], r["index"]), {})[r["variant"]] = r
    keys = [k for k, d in by.items() if all(v in d for v in ["full", "naive", *names])]
    F = sum(by[k]["full"]["nll"] for k in keys)
    N = sum(by[k]["naive"]["nll"] for k in keys)
    tf = sum(by[k]["full"]["prefill_s"] for k in keys)
    lines = [f"# deltaprop ablation: {args.model or 'SmolLM2-135M'}, NIAH {args.length}, seed {args.seed}, "
             f"ratio {args.ratio}, n = {len(keys)}", "",
             f"`python scripts/deltaprop_ablation.py --length {args.length} --n {args.n} --seed {args.seed} "
             f"--ratio {args.ratio}" + (f" --variants '{args.variants}'" if args.variants != "all" else "")
             + (f" --model {args.model}" if args.model else "") + f" --out {args.out}`", "",
             "NLL rec. = pooled (naive - method) / (naive - full) answer NLL; agrees = greedy answer equals full "
             "prefill's (whole answer); speed-up = mean full-prefill time / mean prefill time (same process); "
             "tokens / work = mean share of the context's tokens / of their causal work (`SelectionContext.token_work`) "
             "recomputed.", "",
             "| variant | NLL rec. (pooled) | agrees with full | speed-up vs full | tokens | work |",
             "|---|---|---|---|---|---|"]
    for v in names:
        M = sum(by[k][v]["nll"] for k in keys)
        a = sum(by[k][v]["agree"] for k in keys) / max(len(keys), 1)
        t = sum(by[k][v]["prefill_s"] for k in keys)
        share = []
        for col in ("recomputed", "work"):  # older rows lack them: "-", not made up
            fr = [by[k][v][col] for k in keys if col in by[k][v]]
            share.append(f"{sum(fr) / len(fr):.3f}" if len(fr) == len(keys) and fr else "-")
        lines.append(f"| {v} | {(N - M) / (N - F):.3f} | {a:.2f} | {tf / t:.2f} | {' | '.join(share)} |")
    # per task, and paired against deltaprop (the first variant when deltaprop is not in the table)
    ref = "deltaprop" if "deltaprop" in names else names[0]
    tasks = sorted({k[0] for k in keys})
    lines += ["", f"Agreement with full prefill per task (samples agreeing / samples), and paired against {ref}: "
              f"samples where the variant agrees and {ref} does not (won) and the reverse (lost).", "",
              f"| variant | {' | '.join(tasks)} | won / lost vs {ref} |", "|---|" + "---|" * (len(tasks) + 1)]
    for v in names:
        per = [f"{sum(by[k][v]['agree'] for k in keys if k[0] == t)} / {sum(k[0] == t for k in keys)}" for t in tasks]
        won = sum(by[k][v]["agree"] and not by[k][ref]["agree"] for k in keys)
        lost = sum(by[k][ref]["agree"] and not by[k][v]["agree"] for k in keys)
        lines.append(f"| {v} | {' | '.join(per)} | {'' if v == ref else f'{won} / {lost}'} |")
    (out / "ablation.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
