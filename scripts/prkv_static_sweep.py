"""PRKV's static-ratio ablation (PRKV Sec. 5.3 / Fig. 8) on the embedded model: attention recall per S.

One prefill of a RULER needle sample, then for each S (0 = fully dynamic pages, 1 = fully static,
"auto" = App. G's online choice) a diagnostic decode teacher-forced with dense decode's tokens, as
`kvstitch bench decode` does. Writes JSON (rows + the command that wrote them) and a markdown table,
named ``prkv_static_sweep`` for the default page size 16 and ``prkv_static_sweep_page<N>`` otherwise:

    .venv/bin/python scripts/prkv_static_sweep.py --context 8192 --budget 1024 --out docs/results
    .venv/bin/python scripts/prkv_static_sweep.py --context 8192 --budget 1024 --page-size 8 \
        --ratios 0.25,0.75,auto --out docs/results      # -> prkv_static_sweep_page8.{json,md}
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import torch

from kvstitch import Engine
from kvstitch.bench.decode import _Sample, _selecting_recall
from kvstitch.tasks.tasks import generate

DEFAULT_PAGE_SIZE = 16


def output_name(page_size: int, name: str | None = None) -> str:
    """File stem of the results: the default page size keeps the historical name."""
    if name:
        return name
    return "prkv_static_sweep" if page_size == DEFAULT_PAGE_SIZE else f"prkv_static_sweep_page{page_size}"


def table(rows: list[dict]) -> str:
    lines = ["| S | budget | page | context | recall | oracle | top-1 agree | mean S chosen |", "|" + "---|" * 8]
    lines += [f"| {r['static_ratio']} | {r['budget']} | {r['page_size']} | {r['context_tokens']} | {r['recall']:.3f} | "
              f"{r['oracle_recall']:.3f} | {r['top1_agreement']:.2f} | "
              f"{'-' if r['mean_chosen_ratio'] is None else format(r['mean_chosen_ratio'], '.2f')} |" for r in rows]
    return "\n".join(lines) + "\n"


def write(rows: list[dict], out: Path, name: str, command: str) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    js, md = out / f"{name}.json", out / f"{name}.md"
    meta = {"command": command, "time": time.strftime("%Y-%m-%d %H:%M:%S"), "torch_threads": torch.get_num_threads()}
    js.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    md.write_text(table(rows))
    return js, md


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--ratios", default="0,0.25,0.5,0.75,1,auto")
    ap.add_argument("--page-size", type=int, default=DEFAULT_PAGE_SIZE)
    ap.add_argument("--new-tokens", type=int, default=160)
    ap.add_argument("--out", type=Path, default=Path("docs/results"))
    ap.add_argument("--name", default=None, help="file stem (default: prkv_static_sweep[_page<N>])")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    command = "python scripts/prkv_static_sweep.py " + " ".join(shlex.quote(x) for x in sys.argv[1:])

    eng = Engine.load(a.model, stitch_adapter=None)
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
    js, md = write(rows, a.out, output_name(a.page_size, a.name), command)
    print(md.read_text())
    print(f"-> {js}, {md}")


if __name__ == "__main__":
    main()
