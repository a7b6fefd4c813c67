"""How far the stale K/V a method leaves are from full prefill's: the mechanism behind `deltaprop`'s correction.

First, with no method: of the true shift of every context token (full prefill minus stitched; keys pre-RoPE), how
much energy an estimate from a fifth of the tokens (plus every 25th, deltaprop's probes) removes on the others
(beside the best a constant per chunk could do, the held-out tokens' own mean): their chunk's mean shift (deltaprop's `fit="mean"`), or that plus a ridge regression on how the token's stitched
vector departs from its chunk's (`fit="linear"`, same ridges). Then, per sample and variant: prefill at the ratio, then, over the context tokens the variant did not recompute, the
squared error of their values and (post-RoPE) keys against full prefill's, summed per band of layers (lower,
middle, upper third). Reported relative to prophet's (a plain recompute of the same selection): below 1 means
the correction brought the stale tokens closer to full prefill.

    python scripts/deltaprop_stale_error.py --length 2048 --n 2 --seed 5 --out docs/results/own-method/stale-error-2k-s5
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from kvstitch import Engine
from kvstitch.eval.runner import sample_layout
from kvstitch.core.rope import rerotate
from kvstitch.select import make_selector
from kvstitch.tasks import generate

VARIANTS = {  # name -> (method, options)
    "prophet": ("prophet", {}),
    "deltaprop": ("deltaprop", {}),
    "deltaprop linear": ("deltaprop", {"fit": "linear"}),
    "deltaprop linear, ridge_v 1": ("deltaprop", {"fit": "linear", "ridge_v": 1.0}),
    "deltaprop linear, ridge_v 0.1": ("deltaprop", {"fit": "linear", "ridge_v": 0.1}),
    "deltaprop linear, ridge_k 1": ("deltaprop", {"fit": "linear", "ridge_k": 1.0}),
}
BANDS = ("lower", "middle", "upper")


def stale_errors(eng, layout, full_cache, method: str, options: dict, ratio: float) -> dict:
    """{(kind, band): summed squared error of the stale tokens' K or V against full prefill}."""
    pre = eng.prefill(layout, make_selector(method, **options), ratio, 1)
    c0, c1 = layout.context_start, layout.context_end
    stale = torch.ones(c1 - c0, dtype=torch.bool)
    stale[pre.indices] = False
    n_layers = len(full_cache.layers)
    out = {}
    for li, (mine, ref) in enumerate(zip(pre.cache.layers, full_cache.layers)):
        band = BANDS[min(2, 3 * li // n_layers)]
        for kind in ("values", "keys"):
            a = getattr(mine, kind)[0, :, c0:c1][:, stale].float()
            b = getattr(ref, kind)[0, :, c0:c1][:, stale].float()
            out[(kind, band)] = out.get((kind, band), 0.0) + float(((a - b) ** 2).sum())
    return out


ESTIMATES = ("best constant per chunk (oracle)", "chunk mean (fitted tokens)", "chunk mean + linear (fitted tokens)")


def shift_energy(eng, layout, full_cache, ridge_v: float = 10.0, ridge_k: float = 0.1, seed: int = 0) -> dict:
    """{(kind, band, estimate): energy of the true shift left after the estimate, summed over the held-out
    tokens of chunks after the first}, with estimate "none" the shift's own energy."""
    stitched = eng.stitch(layout, eng.chunk_kvs(layout))
    c0, c1 = layout.context_start, layout.context_end
    chunk = layout.chunk_index()
    n_chunks = int(chunk.max()) + 1
    starts = torch.tensor(layout.chunk_starts) - c0
    offset = torch.arange(c1 - c0) - starts[chunk]
    later = (chunk > 0).nonzero().flatten()
    g = torch.Generator().manual_seed(seed)
    fitted = torch.zeros(c1 - c0, dtype=torch.bool)
    fitted[later[torch.randperm(later.numel(), generator=g)[:later.numel() // 5]]] = True
    fitted |= (offset % 25 == 12) & (chunk > 0)
    test = (chunk > 0) & ~fitted
    pos = torch.arange(c0, c1, dtype=torch.float64)

    def chunk_mean(x, mask):  # [H, n, d] -> per-token mean over the masked tokens of its chunk
        total = torch.zeros(n_chunks, x.shape[0], x.shape[2])
        total.index_add_(0, chunk[mask], x[:, mask].permute(1, 0, 2))
        count = torch.bincount(chunk[mask], minlength=n_chunks).clamp(min=1)
        return (total / count[:, None, None])[chunk].permute(1, 0, 2)

    n_layers = len(full_cache.layers)
    out = {}
    for li, (st, ref) in enumerate(zip(stitched.layers, full_cache.layers)):
        band = BANDS[min(2, 3 * li // n_layers)]
        inv = eng.inv_freq[li]
        for kind, ridge in (("values", ridge_v), ("keys", ridge_k)):
            x, y = getattr(st, kind)[0, :, c0:c1].float(), getattr(ref, kind)[0, :, c0:c1].float()
            if kind == "keys":
                x, y = (rerotate(t, -pos, inv).float() for t in (x, y))
            d = y - x
            best, mean_fit, x_fit = chunk_mean(d, test), chunk_mean(d, fitted), chunk_mean(x, fitted)
            X, Y = (x - x_fit)[:, fitted], (d - mean_fit)[:, fitted]
            A = X.transpose(1, 2) @ X
            A = A + ridge * A.diagonal(dim1=1, dim2=2).mean(-1)[:, None, None] * torch.eye(A.shape[-1])
            W = torch.linalg.solve(A, X.transpose(1, 2) @ Y)
            linear = mean_fit[:, test] + (x - x_fit)[:, test] @ W
            for name, est in zip(("none", *ESTIMATES), (0.0, best[:, test], mean_fit[:, test], linear)):
                out[(kind, band, name)] = out.get((kind, band, name), 0.0) + float(((d[:, test] - est) ** 2).sum())
    return out


COLUMNS = [(kind, band) for kind in ("values", "keys") for band in BANDS]


def table(first: str, names, value) -> list[str]:
    """Markdown rows: one per name, a column per (kind, band), each cell ``value(name, (kind, band))``."""
    return ["| " + first + " | " + " | ".join(f"{k} {b}" for k, b in COLUMNS) + " |", "|---|" + "---|" * len(COLUMNS),
            *(f"| {name} | " + " | ".join(f"{value(name, c):.3f}" for c in COLUMNS) + " |" for name in names)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--tasks", default="niah_multikey,niah_multivalue,niah_single_essay")
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--n", type=int, default=2)
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--ratio", type=float, default=0.2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    eng = Engine.load(args.model, stitch_adapter=None)
    count = lambda t: len(eng.tokenizer.encode(t, add_special_tokens=False))  # noqa: E731
    total: dict = {}
    energy: dict = {}
    n = 0
    for task in args.tasks.split(","):
        for sample in generate(task, args.n, args.length, 256, args.seed, count, haystack="essays"):
            layout = sample_layout(eng, sample)
            full_cache, _ = eng.full_prefill(layout)
            for key, e in shift_energy(eng, layout, full_cache, seed=n).items():
                energy[key] = energy.get(key, 0.0) + e
            for name, (method, options) in VARIANTS.items():
                for key, err in stale_errors(eng, layout, full_cache, method, options, args.ratio).items():
                    total[(name, *key)] = total.get((name, *key), 0.0) + err
            n += 1
            print(task, n, flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lines = [f"# Stale K/V error against full prefill, relative to prophet: {args.model or 'SmolLM2-135M'}, NIAH "
             f"{args.length}, seed {args.seed}, ratio {args.ratio}, n = {n}", "",
             f"`python scripts/deltaprop_stale_error.py --length {args.length} --n {args.n} --seed {args.seed} "
             f"--ratio {args.ratio}" + (f" --model {args.model}" if args.model else "") + f" --out {args.out}`", "",
             "Summed squared error of the tokens each variant left stale (values; keys after RoPE), per third of "
             "the layers, divided by prophet's (the same selection without a correction). Below 1: closer to full "
             "prefill.", "",
             *table("variant", VARIANTS, lambda name, c: total[(name, *c)] / total[("prophet", *c)]),
             "", "The true shift (full prefill minus stitched; keys pre-RoPE) of the tokens of every chunk after the "
             "first: the fraction of its energy left after each estimate, on tokens it was not fitted on (a fifth "
             "of each sample's tokens at random, plus every 25th, fit the estimates).", "",
             *table("estimate", ESTIMATES, lambda name, c: energy[(*c, name)] / energy[(*c, "none")])]
    (out / "stale_error.md").write_text("\n".join(lines) + "\n")
    (out / "stale_error.json").write_text(json.dumps(
        {"args": vars(args), "n": n, "stale_error": {" / ".join(k): v for k, v in total.items()},
         "shift_energy": {" / ".join(k): v for k, v in energy.items()}}, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
