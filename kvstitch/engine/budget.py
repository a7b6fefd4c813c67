"""Adaptive recompute budget (``recompute_ratio="auto"``): recompute in rounds of growing budget until the
answer stops changing, then stop; fall back to full prefill when it never does.

Why not a fixed ratio: some requests are answered by full prefill's words at 5%, others need 40% or all of
it. The per-request question is "would more recompute change the answer?", so that is what the rounds test:

- The selector ranks the context once (one Stage I / scoring pass, at the largest round's budget, so
  selectors that reorder or regroup do so once). Round ``i`` recomputes the tokens of its budget that no
  earlier round recomputed (never a token twice), plus the suffix, reusing every K/V earlier rounds wrote.
- ``mode="refresh"``: every round is instead one pass over its whole set from the stitched K/V (earlier
  rounds' tokens are restored and recomputed again), so round ``i``'s cache is exactly a fixed-ratio prefill
  at its budget. It costs the sum of the rounds' budgets, but measured on the calibration seed it agrees
  with full prefill more often: the incremental rounds leave the most important tokens (picked first) with
  K/V computed against an almost entirely stale context (docs/design.md, "Adaptive budget").
- Round 1 greedy-decodes a *probe*: the first ``probe_tokens`` answer tokens. Every later round appends the
  previous round's probe to its recompute pass (teacher-forced, one forward): its logits say, at every
  probe position, whether this round's greedy answer would still write the same token.
- **Signal**: round ``i`` agrees with round ``i-1`` when its argmax reproduces the whole probe and the mean
  KL(previous || current) over the probe positions is below ``tol``. The first-token distribution alone is
  not enough: RULER-style answers share a template ("The special magic number for X is") and diverge at the
  content tokens, so the probe reaches past them. ``patience`` consecutive agreeing rounds = converged.
- **Confidence** (``min_p``, off by default): a round also converges, on its own, when every probe token
  has greedy probability >= ``min_p`` under that round's cache. One round then suffices (``schedule=(0.2,)``):
  a model sure of its answer from a 20% cache rarely changes it with more recompute, and a model unsure of it
  is sent to full prefill after paying one round, not two (calibration: docs/design.md, "Adaptive budget").
- **Verification** (``verify_chunks`` = m > 0, off by default): a round is accepted only when its probe says
  what a *full* prefill of a short prompt says, the question over the m chunks most relevant to it (BM25 of
  the question against each chunk's text; pinned chunks kept; original order). That short prompt has exact
  cross-chunk attention among the chunks that hold the answer, and it errs differently from a stitched
  cache: stitched rounds of every budget share one bias (e.g. a numbered list where full prefill writes the
  bare value), so they agree with each other while all differing from full prefill, and the KL and
  confidence tests pass them. The short prompt's answer is computed once per request (about m chunks of
  work, counted in ``recompute_cost``); a round whose probe differs is not accepted, and the next round, or
  full prefill, answers. Calibration (Qwen, NIAH 8K): docs/results/own-method/qwen-auto-calibration-8k.
- Converged: the answer starts with the probe, whose K/V are already in the cache (decoding continues from
  there). Not converged by ``max_ratio``: with ``max_ratio`` = 1 (default) a real full prefill answers (exact),
  else the last round's cache is used and ``stats["converged"]`` is False (the server reports it).

Contexts shorter than ``min_context`` tokens (default 1024) go straight to full prefill: there the probe's
decode steps and two rounds cost more than the whole prefill (``stats["auto_skipped"] = "short_context"``).

``stats``: ``ratio_used`` (context tokens whose K/V are fresh in the final cache / context tokens; 1.0 after
the fallback), ``rounds``, ``converged``, ``signal`` (last round's mean KL), ``round_log`` (per round: ratio,
new tokens, agreed, KL, first divergence), ``recompute_cost`` (context tokens forwarded over all rounds,
fallback included, / context tokens). ``tol=0`` never converges: every request falls back to full prefill.

The options are an `AutoBudget` object, and ``recompute_ratio`` takes one directly (``AutoBudget(tol=0.05)``)
or its spec string in the grammar of `kvstitch.core.spec` (``"auto(verify_by=attention,accept=answer)"``,
``"auto:tol=0.05"``); ``"auto"`` alone is the engine's default options (`split_ratio`). `AutoBudget.spec` is
the canonical spec: ``auto`` then the options that differ from their defaults.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, fields
from typing import ClassVar, Literal, get_args

import torch

from kvstitch.core.errors import BadAutoOption, BadRatio, InputError
from kvstitch.core.options import check_options, format_options
from kvstitch.core.spec import Call, format_value, parse_call
from kvstitch.tasks.agreement import first_words_agree, same_answer
from .forcing import Forced, force_greedy
from .sampling import answer_text
from .short_prompt import ShortPrompt, verification_chunks
from .short_prompt import reference_answer  # noqa: F401  (re-exported: scripts and tests import it here)

AUTO = "auto"
Mode = Literal["incremental", "refresh"]
VerifyBy = Literal["bm25", "attention", "order"]  # how the verification's short prompt picks its chunks
Accept = Literal["words", "answer"]  # what "the same answer" means for verification
MODES, VERIFY_BY, ACCEPT = get_args(Mode), get_args(VerifyBy), get_args(Accept)
DEFAULT_SCHEDULE = (0.05, 0.1)  # probe cheaply, then stitched or full prefill: docs/design.md


@dataclass(frozen=True)
class AutoBudget:
    """Options of ``recompute_ratio="auto"`` (see the module doc). Types are checked from the annotations
    (`kvstitch.core.options`); `_check` adds the ranges."""

    name: ClassVar[str] = AUTO
    schedule: tuple[float, ...] = DEFAULT_SCHEDULE  # budgets of the rounds, increasing
    max_ratio: float = 1.0  # ceiling; 1.0 = fall back to full prefill when no round converges
    tol: float = 0.01  # mean KL (nats) between consecutive rounds over the probe; calibrated: docs/design.md
    probe_tokens: int = 16  # answer tokens compared between rounds (~12 words)
    patience: int = 1  # consecutive agreeing rounds needed
    mode: Mode = "refresh"  # or "incremental" (see the module doc)
    min_context: int = 1024  # shorter contexts: full prefill directly (rounds + probe would cost more than it)
    min_p: float | None = None  # confidence signal: accept a round whose probe tokens all have p >= min_p
    verify_chunks: int = 0  # > 0: accept a round only if a full prefill over this many top chunks agrees
    verify_by: VerifyBy = "bm25"  # those chunks: BM25 against the question, the stitched pass's own selection
    #                               ("attention": the chunks holding most of the first round's recomputed tokens),
    #                               or the first ones in prompt order ("order": a retriever's ranking)
    accept: Accept = "words"  # verified when the first 12 words agree, or ("answer") the SQuAD-normalised first
    #                           lines are equal: the answer, not its wording

    # options added after the first eval logs, with the value that switches them off: an eval's protocol leaves
    # them out when off, so those logs resume (kvstitch.eval.runner.EvalConfig.protocol)
    OFF: ClassVar[dict] = {"min_p": None, "verify_chunks": 0, "verify_by": "bm25", "accept": "words"}

    def __post_init__(self):
        if isinstance(self.schedule, (int, float)) and not isinstance(self.schedule, bool):
            object.__setattr__(self, "schedule", (self.schedule,))  # "auto(schedule=0.1)": one round
        check_options(self, BadAutoOption)
        self._check()

    def _check(self) -> None:
        """The ranges (the types are checked already)."""
        sched = self.schedule
        if not sched or any(not (0.0 < r <= 1.0) for r in sched) or list(sched) != sorted(set(sched)):
            raise BadAutoOption(f"auto: schedule must be increasing ratios in (0, 1], got {format_value(sched)}")
        if not 0.0 < self.max_ratio <= 1.0:
            raise BadAutoOption(f"auto: max_ratio must be in (0, 1], got {self.max_ratio!r}")
        if not (math.isfinite(self.tol) and self.tol >= 0):
            raise BadAutoOption(f"auto: tol must be a finite number >= 0, got {self.tol!r}")
        for name, low in (("probe_tokens", 1), ("patience", 1), ("min_context", 0), ("verify_chunks", 0)):
            if getattr(self, name) < low:
                raise BadAutoOption(f"auto: {name} must be an integer >= {low}, got {getattr(self, name)!r}")
        if self.min_p is not None and not 0.0 < self.min_p <= 1.0:
            raise BadAutoOption(f"auto: min_p must be a probability in (0, 1] (or none), got {self.min_p!r}")

    @classmethod
    def of(cls, value: "AutoBudget | Call | dict | str | None") -> "AutoBudget":
        """The options from an object, a spec string (``"auto(tol=0.05)"``), a parsed spec or config table (a
        `Call`), a dict of them or None (defaults)."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            value = parse_call(value, "auto budget", BadAutoOption)
        if isinstance(value, Call):
            if value.name.lower() != AUTO:
                raise BadAutoOption(f"an auto budget spec starts with 'auto', got {value.name!r:.60}")
            value = value.options
        if isinstance(value, dict):
            known = [f.name for f in fields(cls)]
            if set(value) - set(known):
                raise BadAutoOption(f"unknown auto option(s) {sorted(set(value) - set(known))}; known: "
                                    f"{', '.join(known)}")
            return cls(**value)
        raise BadAutoOption(f"auto options must be an auto spec, an AutoBudget or a dict, got {type(value).__name__}")

    @property
    def spec(self) -> str:
        """The canonical spec string (``auto``, or ``auto(tol=0.05,...)``): parses back to an equal object."""
        return format_options(self)

    def options(self) -> dict:
        """The options that differ from their defaults, in declaration order (lists for tuples: JSON)."""
        return {f.name: list(v) if isinstance(v, tuple) else v for f in fields(self)
                if (v := getattr(self, f.name)) != f.default}

    def __str__(self) -> str:
        return self.spec

    def rounds(self) -> list[float]:
        """The rounds' ratios below the ceiling, then the ceiling itself when it is < 1 (its own last round)."""
        out = [r for r in self.schedule if r < self.max_ratio]
        if self.max_ratio < 1.0:
            out.append(self.max_ratio)
        return out or [self.max_ratio]


def ratio_value(value) -> "float | str | AutoBudget":
    """A recompute ratio as given -> a fraction in [0, 1], "auto" (the engine's default options), or the
    `AutoBudget` of an object or an auto spec string (``"auto(tol=0.05)"``); else a `BadRatio` naming the forms."""
    if isinstance(value, AutoBudget):
        return value
    if isinstance(value, str):
        v = value.strip()
        if v.lower() == AUTO:
            return AUTO
        if v[:len(AUTO)].lower() == AUTO and v[len(AUTO):].lstrip()[:1] in ("(", ":"):
            return AutoBudget.of(v)
        try:
            value = float(v)
        except ValueError:
            raise BadRatio(f"{_RATIO_FORMS}, got {value!r:.60}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or not 0.0 <= value <= 1.0:
        raise BadRatio(f"{_RATIO_FORMS}, got {value!r:.60}")
    return float(value)


_RATIO_FORMS = "recompute_ratio must be a number in [0, 1] or 'auto' (with options: 'auto(tol=0.05)')"


def parse_ratio(value) -> float | str:
    """A fixed ratio in [0, 1] or "auto" (an auto spec or object is "auto": its options, `split_ratio`)."""
    v = ratio_value(value)
    return AUTO if isinstance(v, AutoBudget) else v


def split_ratio(value, auto: "AutoBudget | dict | str | None" = None) -> tuple:
    """A request's ``recompute_ratio`` and ``auto`` -> (a fraction or "auto", the auto options or None: the
    engine's default). A ratio that is itself an auto budget (an object, a spec) carries the options; ``auto``
    given beside it must be the same options."""
    v = ratio_value(value)
    if not isinstance(v, AutoBudget):
        if auto is not None:
            AutoBudget.of(auto)  # bad options fail here, whatever the ratio
        return v, auto
    if auto is not None and AutoBudget.of(auto) != v:
        raise BadAutoOption(f"two auto budgets: recompute_ratio is {v.spec!r}, auto is {AutoBudget.of(auto).spec!r}; "
                            f"give one")
    return AUTO, v


def join_ratio(value, auto: "AutoBudget | dict | str | None" = None) -> "float | str | AutoBudget":
    """A ratio and auto options given beside it -> the one spelling of ``recompute_ratio``: the `AutoBudget`
    when the ratio is "auto" with options (an auto spec's and ``auto`` must agree), else the ratio."""
    ratio, options = split_ratio(value, auto)
    return AutoBudget.of(options) if ratio == AUTO and options is not None else ratio


@dataclass
class RoundsResult:
    cache: object
    layout: object
    logits: torch.Tensor  # suffix logits of the final pass (row -1 predicts the first answer token)
    indices: torch.Tensor  # context indices fresh in the final cache
    greedy: list[int] = field(default_factory=list)  # probe tokens already in the cache (all but the last)


def _kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """Per row KL(p || q) of two logit tensors [T, V]."""
    lp, lq = torch.log_softmax(p_logits.float(), -1), torch.log_softmax(q_logits.float(), -1)
    return (lp.exp() * (lp - lq)).sum(-1)


def _restore(cache, stale, done: torch.Tensor, c0: int, c1: int) -> None:
    """``mode="refresh"``: put the stitched K/V of the tokens earlier rounds recomputed back, and mark none done."""
    back = done.nonzero().flatten().to(cache.layers[0].keys.device)
    for layer, (k, v) in zip(cache.layers, stale):
        layer.keys[:, :, c0:c1].index_copy_(2, back, k.index_select(2, back))
        layer.values[:, :, c0:c1].index_copy_(2, back, v.index_select(2, back))
    done[:] = False


def _compare(engine, cache, N: int, out: torch.Tensor, prev: Forced, n_probe: int, tol: float,
             entry: dict) -> tuple[Forced, float]:
    """A later round against the previous one's probe (teacher-forced in its pass, logits ``out``): records in
    ``entry`` whether it agrees (the whole probe reproduced, mean KL below ``tol``) -> (this round's probe: the
    previous one, or its own from the first divergence; the mean KL)."""
    probe = force_greedy(engine, cache, N, prev.tokens, n_probe, forced=out)
    same = probe.agreed == len(prev.tokens)
    kls = _kl(prev.logits, probe.forced)
    kl = max(0.0, float(kls.mean()))  # rounding can make it -1e-9
    entry.update(agreed=same and kl < tol, kl=round(kl, 6), first_divergence=None if same else probe.agreed,
                 max_kl=round(float(kls.max()), 6))
    return probe, kl


def _verify(engine, short: ShortPrompt, probe: Forced, accept: str, entry: dict, verify: dict) -> None:
    """Verification (module doc): the round's probe against the short prompt's greedy answer, in ``entry``."""
    t0 = time.perf_counter()
    ref = short.answer_given(probe.tokens)  # the short prompt's greedy answer
    verify.update(answer=ref, seconds=round(verify["seconds"] + time.perf_counter() - t0, 4))
    entry["answer"] = answer_text(engine, list(probe.tokens), strip=False)
    entry["verified"] = same_answer(entry["answer"], ref) if accept == "answer" \
        else first_words_agree(entry["answer"], ref)


def _short_prompt(engine, layout, auto: AutoBudget, ranking, first_k: int, n_probe: int,
                  stats: dict) -> ShortPrompt:
    """The verification's short prompt over ``auto.verify_chunks`` passages (by ``auto.verify_by``; "attention"
    reads the first round's ``first_k`` selected tokens), its chunks and set-up time recorded in ``stats``."""
    t0 = time.perf_counter()
    chunks = verification_chunks(engine, layout, auto.verify_chunks, auto.verify_by,
                                 ranking(first_k) if auto.verify_by == "attention" else None)
    short = ShortPrompt(engine, layout, auto.verify_chunks, n_probe, chunks)
    stats["verify"] = {"chunks": [layout.order[i] for i in short.chunks], "answer": None,
                       "seconds": time.perf_counter() - t0}
    return short


def adaptive_prefill(engine, layout, selector, auto: AutoBudget, extra: int, stats: dict, recompute_plan=None):
    """Run the rounds (module doc) -> `RoundsResult`, or None when the engine must fall back to full prefill.
    ``selector``: ranks the context (`Selector.ranking`); ``extra``: decode room after the prompt."""
    n = layout.n_context
    if selector.zero_budget:  # naive, APE: nothing to rank (checked first: an error whatever the length)
        raise InputError(f"method {selector.name!r} does not rank context tokens, so it cannot choose a budget "
                         f"adaptively (recompute_ratio='auto'); use a scoring method such as prophet")
    if n < auto.min_context:  # too short for rounds to pay off
        _skip(stats, "short_context")
        return None
    n_probe = max(1, min(auto.probe_tokens, extra))  # never probe past the answer's own cap
    rounds = auto.rounds()
    if auto.verify_chunks and len(layout.chunk_ids) - layout.pinned <= auto.verify_chunks:
        _skip(stats, "few_chunks")  # the short prompt would be the whole prompt
        return None
    ctx, ranking = _ranked(engine, layout, selector, rounds, extra, n_probe, stats)
    layout, cache = ctx.layout, ctx.cache
    short = _short_prompt(engine, layout, auto, ranking, round(rounds[0] * n), n_probe, stats) \
        if auto.verify_chunks else None
    plan = recompute_plan(ctx) if recompute_plan is not None else None
    c0, c1 = layout.context_start, layout.context_end
    # refresh mode restores the stitched K/V of earlier rounds' tokens before recomputing them again
    stale = [(l.keys[:, :, c0:c1].clone(), l.values[:, :, c0:c1].clone()) for l in cache.layers] \
        if auto.mode == "refresh" else None
    done = torch.zeros(n, dtype=torch.bool)
    log: list[dict] = []
    stats["round_log"] = log
    prev: Forced | None = None
    streak = 0
    forwarded = short.layout.n_context if short is not None else 0  # the verification's prefill is work too
    N = layout.n_total
    for i, r in enumerate(rounds):
        new = _new_tokens(ranking(round(r * n)), done, cache, stale, c0, c1)
        forwarded += int(new.numel())
        out = _round_pass(engine, cache, layout, new, prev, plan)
        entry = {"ratio": round(float(done.sum()) / max(n, 1), 6), "new_tokens": int(new.numel())}
        if prev is None:
            probe = force_greedy(engine, cache, N, [], n_probe, forced=out)
            entry.update(agreed=None, kl=None)
        else:
            probe, stats["signal"] = _compare(engine, cache, N, out, prev, n_probe, auto.tol, entry)
            streak = streak + 1 if entry["agreed"] else 0
        confident = _confidence(probe, entry, auto.min_p)
        if short is not None:  # verification decides alone (module doc)
            _verify(engine, short, probe, auto.accept, entry, stats["verify"])
        log.append(entry)
        prev = probe
        if entry["verified"] if short is not None else (streak >= auto.patience or confident):
            stats.update(converged=True, rounds=i + 1)
            break
    else:
        stats.update(converged=False, rounds=len(rounds))
        if auto.max_ratio >= 1.0:
            stats["recompute_cost"] = forwarded / max(n, 1)
            return None  # the engine answers with full prefill
    stats.update(ratio_used=float(done.sum()) / max(n, 1), recompute_cost=forwarded / max(n, 1))
    # the probe is this cache's greedy answer start; its K/V (all but the last token's) are in the cache
    cache.truncate(N + len(prev.tokens) - 1)
    return RoundsResult(cache, layout, out[:1], done.nonzero().flatten(), greedy=list(prev.tokens))


def _skip(stats: dict, reason: str) -> None:
    """No rounds: full prefill answers (ratio_used 1, 0 rounds); ``auto_skipped`` says why."""
    stats.update(converged=False, rounds=0, recompute_cost=0.0, round_log=[], auto_skipped=reason)


def _ranked(engine, layout, selector, rounds: list[float], extra: int, n_probe: int, stats: dict):
    """The stitched cache (room for the probe too) and the selector's ranking of the context, scored once at the
    largest round's budget -> (the selection context, the ranking). The ranking may reorder chunks (InfoFlow):
    the context's layout and cache are the ones to use from here on."""
    from kvstitch.select import SelectionContext
    from .precompute import load_chunk_kvs
    from .stitch import stitch, with_adapter

    n = layout.n_context
    kvs = load_chunk_kvs(engine, layout, stats, anchors=selector.chunk_anchors())
    layout, adapted = with_adapter(engine, layout, rounds[0], stats)  # the strength of its first, smallest round
    cache = stitch(engine, layout, kvs, extra=extra + n_probe, adapted=adapted)
    ctx = SelectionContext(engine, cache, layout, max(1, round(rounds[-1] * n)), stats,
                           precompute=engine.precompute_mode, chunks=kvs, score_hook=engine.hooks.score)
    return ctx, selector.ranking(ctx)


def _new_tokens(want: torch.Tensor, done: torch.Tensor, cache, stale, c0: int, c1: int) -> torch.Tensor:
    """The context indices of ``want`` this round recomputes, marked in ``done``: those no earlier round did, or
    (refresh, ``stale`` given) all of them, one pass from the stitched K/V."""
    if stale is not None:
        _restore(cache, stale, done, c0, c1)
    new = want[~done[want]] if want.numel() else want
    done[new] = True
    return new


def _round_pass(engine, cache, layout, new: torch.Tensor, prev: Forced | None, plan) -> torch.Tensor:
    """One round's forward: its ``new`` context tokens, the suffix and, teacher-forced, the previous round's probe
    but its last token -> the logits of the suffix's last token and of each of those probe tokens."""
    N = layout.n_total
    tf = prev.tokens[:-1] if prev is not None else []
    slots = torch.cat([new.sort().values + layout.context_start, torch.arange(layout.context_end, N),
                       torch.arange(N, N + len(tf))])
    ids = torch.cat([layout.ids[:N], torch.tensor(prev.tokens if prev else [], dtype=torch.long)])[slots]
    return engine.forward(cache, ids, slots, plan, logits_to_keep=1 + len(tf))


def _confidence(probe: Forced, entry: dict, min_p: float | None) -> bool:
    """Records the probe and its least likely token's probability in ``entry`` -> the confidence signal: every
    probe token has probability >= ``min_p`` (False when ``min_p`` is None)."""
    p_tok = torch.softmax(probe.logits.float(), -1).gather(1, torch.tensor(probe.tokens).view(-1, 1)).flatten()
    entry.update(probe=list(probe.tokens), min_p=round(float(p_tok.min()), 6))
    confident = min_p is not None and float(p_tok.min()) >= min_p
    entry["confident"] = confident
    return confident
