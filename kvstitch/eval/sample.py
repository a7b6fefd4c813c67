"""One sample of an evaluation run: every (method, ratio) of it, one result row each.

Per sample (one prompt layout, chunk caches precomputed once into the engine's store, untimed):

1. ``full``: full prefill, greedy answer. Its answer ids are the teacher-forcing target T of every method.
2. ``naive`` and every (method, ratio): one prefill with the method (timed: that is the TTFT, with the
   engine's per-stage times), then one teacher-forced pass of T over the same cache -> next-token logits
   ``[|T|, V]`` for KL(full || method) and the answer NLL. The greedy answer is read off that pass when its
   argmax reproduces T token by token (greedy decoding then yields exactly T: every step conditions on the
   same tokens); otherwise decoding resumes from the first divergence, reusing the K/V of the agreeing
   prefix. So a method costs one prefill plus one |T|-token pass (plus the decode steps after a divergence)
   instead of generate + answer_logits (two prefills + a full decode).
3. Fidelity next to the task score: ``kl`` (mean over answer positions), ``kl_first`` (first token),
   ``nll`` (nats/token of T), ``nll_recovery`` = (NLL_naive - NLL_m) / (NLL_naive - NLL_full) and
   ``overlap`` = |S ∩ G| / |G| with G the ``oracle`` selection at the same budget (when `oracle` is
   registered). Methods that reorder chunks (``infoflow_reorder``) have their indices mapped back to the
   original token order first.
4. What would redo the reference's full prefill reuses it and is charged its measured time; a prefill timed
   while the process was paused is timed again (`eval/timing.py`).

The run over all samples (resume, shards, progress, reports) is `eval/runner.py`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from kvstitch.core.errors import InputError
from kvstitch.engine.budget import AUTO, join_ratio
from kvstitch.engine.engine import cpu_name
from kvstitch.engine.forcing import force_greedy
from kvstitch.tasks.agreement import first_token_agree, first_words_agree
from kvstitch.tasks.grading import (abstains, answer_correct, exact_match, qa_f1, scorer_for, squad_correct, squad_em,
                                     squad_f1)
from kvstitch.tasks.metrics import answer_nll, kl_full_vs_method, nll_gap_recovery, overlap_ratio
from kvstitch.tasks.tasks import Sample
from .config import EvalConfig
from .rows import REFERENCES
from .selection import oracle_sets, select_tokens, to_original_order
from .timing import SampleFullPrefill, cpu_clock, paused, score_memo, timed_again


# ---------------------------------------------------------------------------------------------------
# Prompt
# ---------------------------------------------------------------------------------------------------

def sample_layout(engine, sample: Sample, answer_prefix: bool = True):
    """The engine's layout for the sample; with `answer_prefix`, RULER's answer prefix is appended after the
    assistant header (it belongs to the suffix, so query-driven selectors see it as part of the query)."""
    from kvstitch.core.prompt import with_answer_prefix

    layout = engine.layout(sample.question, sample.chunks)
    return with_answer_prefix(layout, engine.tokenizer, sample.meta.get("answer_prefix") if answer_prefix else None)


def answer_budget(engine, sample: Sample, cfg: EvalConfig) -> int:
    if cfg.max_new_tokens is not None:
        return cfg.max_new_tokens
    if sample.meta.get("max_new_tokens"):  # real QA: a fixed cap (the gold answer's length says little)
        return int(sample.meta["max_new_tokens"])
    n = len(engine.tokenizer.encode(", ".join(sample.answers), add_special_tokens=False))
    return max(8, n + cfg.answer_slack)


# ---------------------------------------------------------------------------------------------------
# One (sample, method, ratio)
# ---------------------------------------------------------------------------------------------------

@dataclass
class MethodRun:
    method: str
    ratio: float | None
    tokens: list[int]  # greedy answer ids (EOS included when produced)
    text: str
    ttft_s: float
    indices: torch.Tensor  # recomputed context indices, in the ORIGINAL token order
    logits: torch.Tensor | None  # [|target|, V] teacher-forced on the target (None: no target)
    stats: dict = field(default_factory=dict)
    reused_tokens: int = 0  # answer tokens read off the teacher-forced pass (not decoded step by step)


# Methods that keep chunk caches of their own (CacheClip's auxiliary model): warmed with the store, untimed.
OWN_CHUNK_CACHES = ("cacheclip",)


@torch.no_grad()
def run_method(engine, layout, method: str, ratio: float | None, max_new_tokens: int,
               target: Sequence[int] | None = None, method_options: dict | None = None,
               score_cache: dict | None = None, auto: dict | None = None,
               full: SampleFullPrefill | None = None) -> MethodRun:
    """Prefill with `method` (timed, = TTFT), teacher-force `target`, and produce the greedy answer (see the
    module doc). With `target` None (the full-prefill reference itself), the answer is decoded normally.
    ``full``: the sample's full prefill, reused (and its time charged) where the method would redo it."""
    from kvstitch.select import make_selector

    selector = make_selector(method, **(method_options or {}))
    budget = join_ratio(0.0 if ratio is None else ratio, auto)  # "auto" with options: its `AutoBudget`
    score_hook, cached_select_s = score_memo(method, score_cache, full)
    target_t = torch.zeros(0, dtype=torch.long) if target is None else torch.as_tensor(target, dtype=torch.long).flatten()
    T = target_t.numel()
    c0, t0 = cpu_clock(), time.perf_counter()
    with full.replaying() if full is not None and not selector.full_prefill else nullcontext(), \
            engine.hooked(score=score_hook) if score_hook is not None else nullcontext():
        pre = engine.prefill(layout, method, budget, max(max_new_tokens, T), selector=selector)
    ttft = time.perf_counter() - t0
    stats, cache, used = pre.stats, pre.cache, pre.layout
    n = used.n_total  # the prompt as prefilled: a stitch adapter's link tokens are part of it
    stats["timed_s"], stats["cpu_share"] = ttft, (cpu_clock() - c0) / ttft if ttft > 0 else None
    if full is not None and (fallback := full.take_charge()):  # `auto` fell back: the sample's full prefill
        ttft += fallback
        for k in ("fallback_s", "recompute_s"):
            stats[k] = stats.get(k, 0.0) + fallback
        stats["fallback_reused"] = True
    if cached_select_s():  # scores reused from this sample's other ratio: charge their measured cost
        ttft += cached_select_s()
        stats["select_s"] = stats.get("select_s", 0.0) + cached_select_s()
        stats["select_cached"] = True
    order = list(used.order)
    dplan = selector.decode_plan(engine, cache, used, stats)
    # greedy answer: the target as far as the teacher-forced argmax reproduces it, then decoded from there
    run = force_greedy(engine, cache, n, target_t.tolist(), max_new_tokens, first=pre.logits[-1], plan=dplan)
    tokens, tf_logits = run.tokens, run.forced
    reused = min(run.agreed + 1, max(T, 1))  # answer tokens read off the teacher-forced pass
    if not T:  # the reference itself: logits of its own answer, teacher-forced in one pass like the others
        tf_logits = force_greedy(engine, cache, n, tokens, first=pre.logits[-1], plan=dplan).forced
    text = engine.answer_text(tokens)
    idx = to_original_order(pre.indices.cpu(), order, [c.numel() for c in layout.chunk_ids])
    stats.pop("order", None)
    return MethodRun(method, ratio, tokens, text, ttft, idx, tf_logits, stats, reused)


# ---------------------------------------------------------------------------------------------------
# One sample
# ---------------------------------------------------------------------------------------------------

def _clean(x: float | None) -> float | None:
    return None if x is None or (isinstance(x, float) and not math.isfinite(x)) else float(x)


def _auto_fields(stats: dict) -> dict:
    """What an adaptive budget did (`kvstitch.engine.budget`): its options as a spec (``auto_spec``; the row's
    ``ratio`` stays "auto", what tables group by), rounds, convergence, signal, ratios per round."""
    if "round_log" not in stats:
        return {}
    out = {"auto_spec": stats.get("auto_spec"), "rounds": stats.get("rounds"), "converged": stats.get("converged"),
           "signal": _clean(stats.get("signal")), "round_ratios": [r["ratio"] for r in stats["round_log"]]}
    if "verify" in stats:  # the verification's short prompt (chunks, answer) and each round's verdict
        out.update(verify=stats["verify"], round_verified=[r.get("verified") for r in stats["round_log"]])
    return out


def method_spec(label: str) -> str:
    """A row's ``method_spec``: the canonical spec of its ``method`` label (every option spelled out that is not
    at its default; ``method`` itself is what tables group by)."""
    from kvstitch.select import make_selector

    return make_selector(label).spec


def _stage_fields(stats: dict) -> dict:
    return {k: float(stats[k]) for k in ("chunk_load_s", "assemble_s", "select_s", "recompute_s") if k in stats}


# what a method reports about how it ran (kept in its row): CacheClip's auxiliary model / self-guidance,
# grouping's unspent budget, the layers InfoFlow / QCFuse scored with and why, the chunk store's precompute mode
METHOD_STATS = ("cacheclip_aux", "cacheclip_self_guided", "selection_budget", "grouping_dropped",
                "infoflow_layers", "infoflow_layer_rule", "precompute", "qcfuse_critical_layers",
                "qcfuse_layer_rule", "qcfuse_anchor_ratio")


def _method_fields(stats: dict) -> dict:
    return {k: stats[k] for k in METHOD_STATS if k in stats}


def _chunk_anchors(methods):
    """The anchor pass the chunk caches need for ``methods`` (`Selector.chunk_anchors`; qcfuse), or None."""
    from kvstitch.select import SELECTORS, make_selector

    for m in sorted(methods):
        spec = make_selector(m).chunk_anchors() if m in SELECTORS else None
        if spec is not None:
            return spec
    return None


def _oracle_registered() -> bool:
    from kvstitch.select import methods

    return "oracle" in methods()


def sample_fields(sample: Sample, layout) -> dict:
    """The fields every row of the sample shares (which sample, its prompt's size, the CPU it ran on)."""
    meta = sample.meta
    base = {"task": sample.task, "seed": meta.get("seed"), "index": meta.get("index"), "length": meta.get("length"),
            "chunk_tokens": meta.get("chunk_tokens"), "depth": meta.get("depth"), "n_tokens": layout.n_context,
            "prompt_tokens": layout.n_total, "n_chunks": len(layout.chunk_ids), "cpu": cpu_name()}
    if meta.get("squad"):
        base.update(qid=meta["qid"], gold_position=meta["gold_position"], n_passages=meta["n_passages"],
                    answerable=meta["answerable"])
    return base


def precompute(engine, sample: Sample, layout, budget: int, methods: set[str]) -> float:
    """Check the prompt fits the model, then precompute the chunk caches `methods` read (untimed for the
    methods: the store is warm, as in RAG reuse), with qcfuse's offline anchor pass. -> seconds it took."""
    limit = engine.adapter.max_positions
    if layout.n_total + budget > limit:
        raise InputError(f"{sample.task}#{sample.meta.get('index')}: prompt {layout.n_total} + {budget} tokens > "
                         f"the model's {limit} positions")
    t0 = time.perf_counter()
    engine.chunk_kvs(layout, {}, anchors=_chunk_anchors(methods))
    for m in methods & set(OWN_CHUNK_CACHES):  # their own (auxiliary) chunk caches, likewise
        select_tokens(engine, layout, m, 0.5)
    return time.perf_counter() - t0


def run_reference(engine, layout, budget: int, full: SampleFullPrefill,
                  target: list[int] | None) -> tuple[MethodRun, list[int]]:
    """The full-prefill reference, recorded into `full`; its target ids are ``target`` when given (logged, on
    resume), else its own greedy answer. -> (its run, the target ids)."""
    with full.recording():
        if target:
            return run_method(engine, layout, "full", None, budget, target), list(target)
        ref = run_method(engine, layout, "full", None, budget)
        return ref, ref.tokens


class SampleRows:
    """Builds the rows of one sample: grades an answer and measures its fidelity against the reference (its
    target, logits and NLL; naive's NLL for the recovery; the oracle's set at the same budget for the overlap)."""

    def __init__(self, engine, sample: Sample, layout, budget: int, precompute_s: float, ref: MethodRun,
                 target: list[int], full: SampleFullPrefill, overlap: bool):
        self.engine, self.sample, self.layout, self.budget = engine, sample, layout, budget
        self.precompute_s, self.ref, self.target, self.full = precompute_s, ref, target, full
        self.qa = bool(sample.meta.get("qa"))  # real QA (F1 + exact match), else the RULER task's string match
        self.squad = bool(sample.meta.get("squad"))  # SQuAD's official EM / F1; v2.0 has unanswerable questions
        self.scorer = squad_f1 if self.squad else qa_f1 if self.qa else scorer_for(sample.task)
        self.base = sample_fields(sample, layout)
        self.nll_full = answer_nll(ref.logits, torch.tensor(target))
        self.nll_naive: float | None = None
        self.runs: dict[tuple[str, float | None], MethodRun] = {}
        self.has_oracle = overlap and _oracle_registered()
        self.g_sets: dict[float, torch.Tensor] = {}

    def reference_set(self, r: float | None) -> torch.Tensor | None:
        if not self.has_oracle or r is None or r == AUTO or r <= 0:  # auto: no single budget to compare at
            return None
        if r not in self.g_sets:
            if ("oracle", r) in self.runs:
                self.g_sets[r] = self.runs[("oracle", r)].indices
            else:
                self.g_sets.update(oracle_sets(self.engine, self.layout, [r], exact_cache=self.full.cache))
        return self.g_sets[r]

    def grades(self, text: str) -> tuple[float, dict]:
        """(score, the task's other grades: correct, and for real QA exact match / abstention)."""
        answers = self.sample.answers
        score = self.scorer(text, answers)
        if self.squad:
            return score, {"em": squad_em(text, answers), "correct": squad_correct(text, answers),
                           "abstained": abstains(text)}
        if self.qa:
            return score, {"em": exact_match(text, answers), "correct": answer_correct(text, answers)}
        return score, {"correct": score >= 1.0}

    def row(self, run: MethodRun) -> dict:
        logits_full, target, ref = self.ref.logits, self.target, self.ref
        kl = kl_full_vs_method(logits_full, run.logits)
        kl_first = kl_full_vs_method(logits_full[:1], run.logits[:1])
        nll = answer_nll(run.logits, torch.tensor(target))
        rec = None if self.nll_naive is None else nll_gap_recovery(self.nll_naive, nll, self.nll_full)
        G = self.reference_set(run.ratio) if run.method not in REFERENCES else None
        overlap = overlap_ratio(run.indices, G) if G is not None and G.numel() else None
        extra = {"select_cached": True} if run.stats.get("select_cached") else {}
        if run.stats.get("retimed"):
            extra["retimed"] = True
        score, grades = self.grades(run.text)
        extra.update(grades)
        return {**self.base, **extra, "method": run.method, "method_spec": method_spec(run.method), "ratio": run.ratio,
                "score": score,
                "pred": run.text[:300], "answers": list(self.sample.answers), "recomputed": int(run.indices.numel()),
                "kl": _clean(kl), "kl_first": _clean(kl_first), "nll": _clean(nll), "nll_full": _clean(self.nll_full),
                "nll_recovery": _clean(rec), "overlap": _clean(overlap), "ttft_s": run.ttft_s,
                "cpu_share": _clean(run.stats.get("cpu_share")), **_stage_fields(run.stats), **_method_fields(run.stats), "answer_tokens": len(target),
                "max_new_tokens": self.budget, "reused_tokens": run.reused_tokens, "precompute_s": self.precompute_s,
                # agreement with full prefill's own answer, and what it cost
                "agree_words": first_words_agree(run.text, ref.text), "agree_first": first_token_agree(run.tokens, ref.tokens),
                "ttft_full_s": ref.ttft_s, "ratio_used": _clean(run.stats.get("ratio_used")),
                "recompute_cost": _clean(run.stats.get("recompute_cost")), **_auto_fields(run.stats)}


def eval_sample(engine, sample: Sample, todo: Sequence[tuple[str, float | None]], done: dict[tuple, dict],
                cfg: EvalConfig, on_row=None, on_start=None) -> list[dict]:
    """Run the missing (method, ratio) combos `todo` of one sample; `done` maps (method, ratio) -> rows
    already logged for it (their target / NLLs are reused on resume). -> new rows (also passed to
    `on_row` as they complete)."""
    layout = sample_layout(engine, sample, cfg.answer_prefix)
    budget = answer_budget(engine, sample, cfg)
    precompute_s = precompute(engine, sample, layout, budget, {m for m, _ in todo})
    new_rows: list[dict] = []

    def emit(row: dict) -> None:
        new_rows.append(row)
        if on_row is not None:
            on_row(row)

    def start(m, r):
        if on_start is not None:
            on_start(sample, m, r)

    # the reference: target ids, its logits and NLL
    start("full", None)
    full = SampleFullPrefill(engine, layout)  # kept for the oracles' scores and auto's fallback
    where = f"{sample.task}#{sample.meta.get('index')}"
    logged = (done.get(("full", None)) or {}).get("answer_ids")
    ref, target = run_reference(engine, layout, budget, full, [int(t) for t in logged] if logged else None)
    if paused(ref):  # on the same target, so the same answer
        ref = timed_again(lambda: run_reference(engine, layout, budget, full, target)[0], ref, f"{where} full")
    rows = SampleRows(engine, sample, layout, budget, precompute_s, ref, target, full, cfg.overlap)
    naive_row = done.get(("naive", None))
    if naive_row is not None and naive_row.get("nll") is not None:
        rows.nll_naive = float(naive_row["nll"])
    pending_full = {**rows.row(ref), "answer_ids": list(target)} if ("full", None) in todo else None

    # naive next: its NLL is the recovery baseline of every other row (and of full's own row)
    if rows.nll_naive is None:
        start("naive", None)
        naive = run_method(engine, layout, "naive", None, budget, target)
        if paused(naive):
            naive = timed_again(lambda: run_method(engine, layout, "naive", None, budget, target), naive,
                                f"{where} naive")
        rows.runs[("naive", None)] = naive
        rows.nll_naive = answer_nll(naive.logits, torch.tensor(target))
    if pending_full is not None:
        pending_full["nll_recovery"] = _clean(nll_gap_recovery(rows.nll_naive, rows.nll_full, rows.nll_full))
        emit(pending_full)
    if ("naive", None) in todo:
        emit(rows.row(rows.runs[("naive", None)]))

    score_cache: dict = {}
    for m, r in todo:
        if m in REFERENCES:
            continue
        start(m, r)

        def measure(m=m, r=r):
            return run_method(engine, layout, m, r, budget, target, score_cache=score_cache, auto=cfg.auto, full=full)

        run = measure()
        if paused(run):
            score_cache.pop(m, None)  # scores a paused run kept would be charged at their paused time
            run = timed_again(measure, run, f"{where} {m} at {r}")
        rows.runs[(m, r)] = run
        emit(rows.row(run))
    return new_rows
