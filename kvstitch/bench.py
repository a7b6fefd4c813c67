"""TTFT benchmark: full prefill vs stitched reuse at a recompute ratio, measured in one process.

Absolute times are noisy on shared machines, so every row reports ratios to the full-prefill time
measured in the same run (interleaved repeats), next to the ideal 1/r of a perfect r-budget recompute.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch
from rich.progress import Progress

from .engine import Engine
from .prompt import PromptLayout


def context_of_length(engine: Engine, n_tokens: int, chunk_tokens: int = 256, seed: int = 0,
                      task: str = "niah_multikey") -> tuple[str, list[str]]:
    """A RULER-style sample of about ``n_tokens`` context tokens (question, chunks). The context is
    capped so that prefix + context + question fit the model's positions (8192 for SmolLM2)."""
    from .eval.tasks import generate

    n_tokens = min(n_tokens, engine.adapter.max_positions - 256)

    def count(text: str) -> int:
        return len(engine.tokenizer.encode(text, add_special_tokens=False))

    s = generate(task, n=1, length=n_tokens, chunk_tokens=chunk_tokens, seed=seed, count_tokens=count)[0]
    return s.question, s.chunks


COLD = "@cold"  # suffix of a method timed with its chunks missing from the store (the engine's cold path)
HALF = "@half"  # ... with every other chunk missing (the odd ones: at most half; partially warm store)


def _time_ttft(engine: Engine, layout: PromptLayout, method: str, ratio: float) -> tuple[float, dict]:
    for suffix, evict in ((COLD, slice(None)), (HALF, slice(1, None, 2))):
        if method.endswith(suffix):  # evict (some of) this prompt's chunks: the request's cold path runs
            method = method[: -len(suffix)]
            for ids in layout.chunk_ids[evict]:
                engine.store.delete(engine.chunk_key(layout.prefix_ids, ids))
    res = engine.generate("", [], method=method, recompute_ratio=ratio, max_new_tokens=1, layout=layout)
    return res.ttft_s, res.stats


_STAGES = ("chunk_load_s", "assemble_s", "select_s", "recompute_s")


def bench_ttft(engine: Engine, lengths: list[int], methods: list[str], ratio: float = 0.2, repeats: int = 3,
               chunk_tokens: int = 256, progress: bool = True, cold: bool = False) -> list[dict]:
    """Rows: one per (length, method) with median/min TTFT, ratio to full, stage breakdown.

    Every configuration runs once per repeat, interleaved, so machine noise hits all alike; repeat 0 warms
    up the model and the chunk store and is not timed. ``cold`` adds ``<first method>@cold``: the same
    request with the prompt's chunks evicted from the store first (cold store), and ``<first method>@half``
    with every other chunk evicted (partially warm), next to the warm-store rows and full prefill; their
    ``cold_path`` column says what the engine's cold-path policy did (`kvstitch.cold`). The chunks a
    full-prefill cold request defers are computed after its answer (outside the timed TTFT)."""
    rows = []
    methods = [m for m in methods if m != "full"]
    configs = ["full", *methods] + ([methods[0] + COLD, methods[0] + HALF] if cold and methods else [])
    with Progress(disable=not progress) as bar:
        task = bar.add_task("bench ttft", total=len(lengths) * (repeats + 1) * len(configs))
        for n in lengths:
            question, chunks = context_of_length(engine, n, chunk_tokens)
            layout = engine.layout(question, chunks)
            times: dict[str, list[float]] = {m: [] for m in configs}
            stages: dict[str, list[dict]] = {m: [] for m in configs}
            for rep in range(repeats + 1):
                for m in configs:
                    t, st = _time_ttft(engine, layout, m, ratio)
                    if rep:
                        times[m].append(t)
                        stages[m].append(st)
                    bar.advance(task)
            full_med = statistics.median(times["full"])
            for m in configs:
                med = statistics.median(times[m])
                r = 1.0 if m == "full" else ratio
                stage = {k: statistics.median(s[k] for s in stages[m]) for k in _STAGES if k in stages[m][0]}
                store = {"store": "cold" if m.endswith(COLD) else "half" if m.endswith(HALF) else "warm",
                         "cold_path": stages[m][0].get("cold_path", "stitched")} if m != "full" else {}
                rows.append({"context_tokens": layout.n_context, "total_tokens": layout.n_total, "method": m,
                             "ratio": r, "ttft_median_s": med, "ttft_min_s": min(times[m]),
                             "speedup": full_med / med, "ideal_speedup": 1 / r if r else float("inf"),
                             **store, **stage})
    return rows


def ttft_table(rows: list[dict]) -> str:
    head = ("| context | method | store | cold path | r | TTFT median (s) | TTFT min (s) | speedup vs full | ideal 1/r | "
            "load | assemble | select | recompute |")
    lines = [head, "|" + "---|" * 13]
    for r in rows:
        f = lambda k: f"{r[k]:.3f}" if k in r else "-"  # noqa: E731
        lines.append(f"| {r['context_tokens']} | {r['method']} | {r.get('store', '-')} | {r.get('cold_path', '-')} | "
                     f"{r['ratio']:.2f} | {r['ttft_median_s']:.3f} | "
                     f"{r['ttft_min_s']:.3f} | {r['speedup']:.2f}x | {r['ideal_speedup']:.1f}x | {f('chunk_load_s')} | "
                     f"{f('assemble_s')} | {f('select_s')} | {f('recompute_s')} |")
    return "\n".join(lines)


def write_results(rows: list[dict], out: Path, name: str, table: str, meta: dict | None = None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    payload = {"meta": {**(meta or {}), "time": time.strftime("%Y-%m-%d %H:%M:%S"),
                        "torch": torch.__version__, "threads": torch.get_num_threads()}, "rows": rows}
    (out / f"{name}.json").write_text(json.dumps(payload, indent=1))
    (out / f"{name}.md").write_text(table + "\n")
