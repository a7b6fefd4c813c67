"""TTFT benchmark: full prefill vs stitched reuse at a recompute ratio, measured in one process.

Absolute times are noisy on shared machines, so every row reports ratios to the full-prefill time
measured in the same run (interleaved repeats), next to the ideal 1/r of a perfect r-budget recompute.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from rich.progress import Progress

from kvstitch.engine import Engine
from kvstitch.core.prompt import PromptLayout


def context_of_length(engine: Engine, n_tokens: int, chunk_tokens: int = 256, seed: int = 0,
                      task: str = "niah_multikey") -> tuple[str, list[str]]:
    """A RULER-style sample of about ``n_tokens`` context tokens (question, chunks). The context is
    capped so that prefix + context + question fit the model's positions (8192 for SmolLM2)."""
    from kvstitch.tasks.tasks import generate

    n_tokens = min(n_tokens, engine.adapter.max_positions - 256)

    def count(text: str) -> int:
        return len(engine.tokenizer.encode(text, add_special_tokens=False))

    s = generate(task, n=1, length=n_tokens, chunk_tokens=chunk_tokens, seed=seed, count_tokens=count)[0]
    return s.question, s.chunks


COLD = "@cold"  # suffix of a method timed with its chunks missing from the store (the engine's cold path)
HALF = "@half"  # ... with every other chunk missing (the odd ones: at most half; partially warm store)


class StageTimer:
    """Wall time inside the attention kernel (kvstitch's attention function) and inside the MLP blocks,
    summed over every forward pass while active: the recompute pass and any scoring pass (Stage I).

    Installed for the bench only: a wrapper re-registered under the attention implementation's name
    and pre/post hooks on each layer's ``mlp``. On CUDA every boundary synchronizes (GPU-only path: the
    timed run is then slightly slower); on CPU a boundary costs a clock read."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.attn_s = self.mlp_s = 0.0
        self._t_mlp = 0.0

    def _sync(self) -> None:
        if self.engine.device.type == "cuda":  # GPU-only: kernels are asynchronous
            torch.cuda.synchronize(self.engine.device)

    def take(self) -> dict:
        out = {"attn_s": self.attn_s, "mlp_s": self.mlp_s}
        self.attn_s = self.mlp_s = 0.0
        return out

    @contextmanager
    def active(self):
        from transformers import AttentionInterface

        from kvstitch.core.attention import ATTN_IMPL, kvstitch_attention

        def timed(*args, **kwargs):
            self._sync()
            t0 = time.perf_counter()
            try:
                return kvstitch_attention(*args, **kwargs)
            finally:
                self._sync()
                self.attn_s += time.perf_counter() - t0

        def pre(module, args):
            self._sync()
            self._t_mlp = time.perf_counter()

        def post(module, args, out):
            self._sync()
            self.mlp_s += time.perf_counter() - self._t_mlp

        handles = []
        for layer in self.engine.adapter.backbone.layers:
            handles += [layer.mlp.register_forward_pre_hook(pre), layer.mlp.register_forward_hook(post)]
        AttentionInterface.register(ATTN_IMPL, timed)
        try:
            yield self
        finally:
            AttentionInterface.register(ATTN_IMPL, kvstitch_attention)
            for h in handles:
                h.remove()


def causal_work(layout: PromptLayout, recomputed: list[int] | None) -> dict:
    """How much of full prefill's work a recompute pass over these tokens is: ``token_frac`` (tokens
    through the layers: the linear layers' share) and ``attn_work`` (sum over the recomputed tokens
    of the keys each attends to, causal: its position + 1, over full prefill's sum: the attention
    kernel's share). The suffix is always recomputed; ``pos_mean`` is the mean position of the
    recomputed context tokens in the context (0 = first, 1 = last). ``recomputed=None``: full prefill."""
    n, c0, nc = layout.n_total, layout.context_start, layout.n_context
    full = n * (n + 1) / 2
    if recomputed is None:
        return {"token_frac": 1.0, "attn_work": 1.0, "pos_mean": 0.5}
    ctx = torch.as_tensor(recomputed, dtype=torch.float64)
    suffix = torch.arange(c0 + nc, n, dtype=torch.float64)
    pos = torch.cat([ctx + c0, suffix])
    return {"token_frac": pos.numel() / n, "attn_work": float((pos + 1).sum()) / full,
            "pos_mean": float(ctx.mean()) / max(1, nc - 1) if ctx.numel() else float("nan")}


def _time_ttft(engine: Engine, layout: PromptLayout, method: str, ratio: float,
               timer: StageTimer | None = None) -> tuple[float, dict]:
    warm = not method.endswith((COLD, HALF))
    for suffix, evict in ((COLD, slice(None)), (HALF, slice(1, None, 2))):
        if method.endswith(suffix):  # evict (some of) this prompt's chunks: the request's cold path runs
            method = method[: -len(suffix)]
            for ids in layout.chunk_ids[evict]:
                engine.store.delete(engine.chunk_key(layout.prefix_ids, ids))
    res = engine.generate("", [], method=method, recompute_ratio=ratio, max_new_tokens=1, layout=layout)
    stats = res.stats.to_dict()
    if timer is not None:
        split = timer.take()
        if warm:  # warm store: everything the timer saw happened before the first token
            stats.update(split)  # (a cold request may precompute its chunks after answering: not split)
    stats["other_s"] = res.ttft_s - sum(stats.get(k, 0.0) for k in _STAGES)  # layout, first token, bookkeeping
    if method != "full" and stats.get("cold_path", "stitched") == "stitched":
        stats.update(causal_work(layout, res.recomputed))
    else:
        stats.update(causal_work(layout, None))
    return res.ttft_s, stats


_STAGES = ("chunk_load_s", "assemble_s", "select_s", "recompute_s")
_BREAKDOWN = (*_STAGES, "attn_s", "mlp_s", "other_s", "token_frac", "attn_work", "pos_mean")


def bench_ttft(engine: Engine, lengths: list[int], methods: list[str], ratio: float = 0.2, repeats: int = 3,
               chunk_tokens: int = 256, progress: bool = True, cold: bool = False,
               breakdown: bool = True) -> list[dict]:
    """Rows: one per (length, method) with median/min TTFT, ratio to full, stage breakdown.

    Every configuration runs once per repeat, interleaved, so machine noise hits all alike; repeat 0 warms
    up the model and the chunk store and is not timed. ``cold`` adds ``<first method>@cold``: the same
    request with the prompt's chunks evicted from the store first (cold store), and ``<first method>@half``
    with every other chunk evicted (partially warm), next to the warm-store rows and full prefill; their
    ``cold_path`` column says what the engine's cold-path policy did (`kvstitch.engine.cold`). The chunks a
    full-prefill cold request defers are computed after its answer (outside the timed TTFT).

    ``breakdown`` (`StageTimer`): every row also has ``attn_s`` / ``mlp_s`` (time in the attention kernel
    and the MLPs, every pass of the request), ``other_s`` (TTFT outside the engine's stages: first token,
    bookkeeping) and the selection's `causal_work`; ``work_bound`` is the speed-up a pass over exactly
    that work would reach, from full prefill's measured split: full / (attn * attn_work + rest * token_frac)."""
    rows = []
    timer = StageTimer(engine) if breakdown else None
    methods = [m for m in methods if m != "full"]
    anchors = _anchor_pass(methods)
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
                    with timer.active() if timer else _nothing():
                        t, st = _time_ttft(engine, layout, m, ratio, timer)
                    if m.endswith((COLD, HALF)):
                        _rewarm(engine, layout, chunks, anchors)
                    if rep:
                        times[m].append(t)
                        stages[m].append(st)
                    bar.advance(task)
            full_med = statistics.median(times["full"])
            full_attn = statistics.median(s["attn_s"] for s in stages["full"]) if timer else None
            for m in configs:
                med = statistics.median(times[m])
                r = 1.0 if m == "full" else ratio
                stage = {k: statistics.median(s[k] for s in stages[m]) for k in _BREAKDOWN if k in stages[m][0]}
                if full_attn is not None:  # the speed-up of a pass doing exactly this selection's work
                    rest = full_med - full_attn
                    stage["work_bound"] = full_med / (full_attn * stage["attn_work"] + rest * stage["token_frac"])
                store = {"store": "cold" if m.endswith(COLD) else "half" if m.endswith(HALF) else "warm",
                         "cold_path": stages[m][0].get("cold_path", "stitched")} if m != "full" else {}
                rows.append({"context_tokens": layout.n_context, "total_tokens": layout.n_total, "method": m,
                             "ratio": r, "ttft_median_s": med, "ttft_min_s": min(times[m]),
                             "speedup": full_med / med, "ideal_speedup": 1 / r if r else float("inf"),
                             **store, **stage})
    return rows


def _anchor_pass(methods: list[str]):
    """The anchor pass some configured method needs its chunks to carry (`qcfuse`), else None."""
    from kvstitch.select import make_selector

    return next((a for a in (make_selector(m).chunk_anchors() for m in methods) if a is not None), None)


def _rewarm(engine: Engine, layout: PromptLayout, chunks: list[str], anchors) -> None:
    """After a cold or half-warm row: the prompt's chunks stored again as a precompute stores them, with the anchors
    a configured method reads, so the next repeat's warm rows are warm for every method (the cold path stores
    chunks without anchors, and qcfuse would pay for them again in its timed TTFT)."""
    for ids in layout.chunk_ids:
        engine.store.delete(engine.chunk_key(layout.prefix_ids, ids))
    engine.precompute(chunks, progress=False, anchors=anchors)


@contextmanager
def _nothing():
    yield


def ttft_table(rows: list[dict]) -> str:
    head = ("| context | method | store | cold path | r | TTFT median (s) | TTFT min (s) | speedup vs full | ideal 1/r | "
            "work bound | load | assemble | select | recompute | attn kernel | MLP | other | tokens | attn work | "
            "pos mean |")
    lines = [head, "|" + "---|" * 20]
    for r in rows:
        f = lambda k, fmt=".3f": format(r[k], fmt) if r.get(k) is not None else "-"  # noqa: E731
        bound = f"{r['work_bound']:.2f}x" if r.get("work_bound") is not None else "-"
        lines.append(f"| {r['context_tokens']} | {r['method']} | {r.get('store', '-')} | {r.get('cold_path', '-')} | "
                     f"{r['ratio']:.2f} | {r['ttft_median_s']:.3f} | "
                     f"{r['ttft_min_s']:.3f} | {r['speedup']:.2f}x | {r['ideal_speedup']:.1f}x | {bound} | "
                     f"{f('chunk_load_s')} | {f('assemble_s')} | {f('select_s')} | {f('recompute_s')} | {f('attn_s')} | "
                     f"{f('mlp_s')} | {f('other_s')} | {f('token_frac', '.2f')} | {f('attn_work', '.2f')} | "
                     f"{f('pos_mean', '.2f')} |")
    return "\n".join(lines)


def write_results(rows: list[dict], out: Path, name: str, table: str, meta: dict | None = None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    command = "kvstitch " + " ".join(sys.argv[1:])  # what wrote these numbers (the README cites it)
    payload = {"meta": {"command": command, **(meta or {}), "time": time.strftime("%Y-%m-%d %H:%M:%S"),
                        "torch": torch.__version__, "threads": torch.get_num_threads()}, "rows": rows}
    (out / f"{name}.json").write_text(json.dumps(payload, indent=1))
    (out / f"{name}.md").write_text(table + "\n")
