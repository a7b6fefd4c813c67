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
from typing import ClassVar

import torch

from kvstitch.core.errors import BadAutoOption, BadRatio, InputError
from kvstitch.core.spec import format_value, parse_call
from kvstitch.tasks.agreement import agreeing_prefix, first_words_agree, same_answer

AUTO = "auto"
MODES = ("incremental", "refresh")
VERIFY_BY = ("bm25", "attention", "order")  # how the verification's short prompt picks its chunks
ACCEPT = ("words", "answer")  # what "the same answer" means for verification
DEFAULT_SCHEDULE = (0.05, 0.1)  # probe cheaply, then stitched or full prefill: docs/design.md


@dataclass(frozen=True)
class AutoBudget:
    """Options of ``recompute_ratio="auto"`` (see the module doc)."""

    schedule: tuple[float, ...] = DEFAULT_SCHEDULE  # budgets of the rounds, increasing
    max_ratio: float = 1.0  # ceiling; 1.0 = fall back to full prefill when no round converges
    tol: float = 0.01  # mean KL (nats) between consecutive rounds over the probe; calibrated: docs/design.md
    probe_tokens: int = 16  # answer tokens compared between rounds (~12 words)
    patience: int = 1  # consecutive agreeing rounds needed
    mode: str = "refresh"  # or "incremental" (see the module doc)
    min_context: int = 1024  # shorter contexts: full prefill directly (rounds + probe would cost more than it)
    min_p: float | None = None  # confidence signal: accept a round whose probe tokens all have p >= min_p
    verify_chunks: int = 0  # > 0: accept a round only if a full prefill over this many top chunks agrees
    verify_by: str = "bm25"  # those chunks: BM25 against the question, the stitched pass's own selection
    #                          ("attention": the chunks holding most of the first round's recomputed tokens),
    #                          or the first ones in prompt order ("order": a retriever's ranking)
    accept: str = "words"  # verified when the first 12 words agree, or ("answer") the SQuAD-normalised first
    #                        lines are equal: the answer, not its wording

    # options added after the first eval logs, with the value that switches them off: an eval's protocol leaves
    # them out when off, so those logs resume (kvstitch.eval.runner.EvalConfig.protocol)
    OFF: ClassVar[dict] = {"min_p": None, "verify_chunks": 0, "verify_by": "bm25", "accept": "words"}

    def __post_init__(self):
        sched = self.schedule
        if isinstance(sched, (int, float)) and not isinstance(sched, bool):
            sched = (sched,)  # "auto(schedule=0.1)": one round
        if not isinstance(sched, (list, tuple)) or any(isinstance(r, bool) or not isinstance(r, (int, float))
                                                       for r in sched):
            raise BadAutoOption(f"auto schedule must be increasing ratios in (0, 1], got {self.schedule!r}")
        sched = tuple(float(r) for r in sched)
        if not sched or any(not (0.0 < r <= 1.0) for r in sched) or list(sched) != sorted(set(sched)):
            raise BadAutoOption(f"auto schedule must be increasing ratios in (0, 1], got {self.schedule!r}")
        object.__setattr__(self, "schedule", sched)
        for name in ("max_ratio", "tol", "min_p"):  # numbers: 1 and 1.0 are one option value, one spec
            v = getattr(self, name)
            if isinstance(v, int) and not isinstance(v, bool):
                object.__setattr__(self, name, float(v))
        self._check()

    def _check(self) -> None:
        if isinstance(self.max_ratio, bool) or not (isinstance(self.max_ratio, float) and 0.0 < self.max_ratio <= 1.0):
            raise BadAutoOption(f"auto max_ratio must be in (0, 1], got {self.max_ratio!r}")
        if isinstance(self.tol, bool) or not (isinstance(self.tol, float) and math.isfinite(self.tol) and self.tol >= 0):
            raise BadAutoOption(f"auto tol must be a finite number >= 0, got {self.tol!r}")
        for name, low in (("probe_tokens", 1), ("patience", 1), ("min_context", 0), ("verify_chunks", 0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not (isinstance(v, int) and v >= low):
                raise BadAutoOption(f"auto {name} must be an integer >= {low}, got {v!r}")
        if self.min_p is not None and (isinstance(self.min_p, bool) or not (isinstance(self.min_p, float)
                                                                           and 0.0 < self.min_p <= 1.0)):
            raise BadAutoOption(f"auto min_p must be a probability in (0, 1] (or None), got {self.min_p!r}")
        for name, allowed in (("mode", MODES), ("verify_by", VERIFY_BY), ("accept", ACCEPT)):
            if getattr(self, name) not in allowed:
                raise BadAutoOption(f"auto {name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")

    @classmethod
    def of(cls, value: "AutoBudget | dict | str | None") -> "AutoBudget":
        """The options from an object, a dict of them, a spec string (``"auto(tol=0.05)"``) or None (defaults)."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            call = parse_call(value, "auto budget", BadAutoOption)
            if call.name.lower() != AUTO:
                raise BadAutoOption(f"an auto budget spec starts with 'auto', got {value!r:.60}")
            value = call.options
        if isinstance(value, dict):
            known = [f.name for f in fields(cls)]
            if set(value) - set(known):
                raise BadAutoOption(f"unknown auto option(s) {sorted(set(value) - set(known))}; known: "
                                    f"{', '.join(known)}")
            return cls(**value)
        raise BadAutoOption(f"auto options must be a dict, an AutoBudget or an auto spec, got {type(value).__name__}")

    @property
    def spec(self) -> str:
        """The canonical spec string (``auto``, or ``auto(tol=0.05,...)``): parses back to an equal object."""
        opts = [f"{k}={format_value(v)}" for k, v in self.options().items()]
        return AUTO + (f"({','.join(opts)})" if opts else "")

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


@dataclass
class Probe:
    """A round's greedy answer start: ``tokens`` and the next-token logits ``[len(tokens), V]`` that chose them."""

    tokens: list[int]
    logits: torch.Tensor


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


def _greedy_probe(engine, cache, start_slot: int, first_logits: torch.Tensor, tokens: list[int],
                  logits: list[torch.Tensor], n_probe: int) -> Probe:
    """Extend ``tokens`` greedily (their K/V but the last's are in the cache) to ``n_probe`` tokens or EOS.
    ``first_logits`` chose ``tokens[-1]`` (or, with ``tokens`` empty, are the logits of the first token)."""
    tokens, logits = list(tokens), list(logits)
    if not tokens:
        tokens.append(int(torch.argmax(first_logits)))
        logits.append(first_logits.float().cpu())
    while len(tokens) < n_probe and not engine.finished(tokens):
        slot = start_slot + len(tokens) - 1
        out = engine.forward(cache, torch.tensor([tokens[-1]]), torch.tensor([slot]))[-1]
        tokens.append(int(torch.argmax(out)))
        logits.append(out.float().cpu())
    return Probe(tokens, torch.stack(logits))


@dataclass
class Reference:
    """The verification's answer: a full prefill of the question over the most relevant chunks only."""

    text: str
    chunks: list[int]  # chunk indices kept (original order)
    n_context: int  # context tokens prefilled


def verification_chunks(engine, layout, m: int, by: str = "bm25", selected: torch.Tensor | None = None) -> list[int]:
    """The pinned chunks plus ``m`` others, in prompt order: those whose text scores highest by BM25 against
    the question (``by="bm25"``), those holding most of the context indices ``selected`` (``"attention"``: the
    tokens the stitched pass chose to recompute, i.e. where the question's attention went), or the first ``m``
    (``"order"``: the retriever's ranking, when it put its best first)."""
    free = list(range(layout.pinned, len(layout.chunk_ids)))
    if by == "order":
        return list(range(layout.pinned)) + free[:m]
    if by == "attention":
        if selected is None:
            raise ValueError("verification by attention needs the selected context indices")
        ends = torch.tensor([c.numel() for c in layout.chunk_ids]).cumsum(0)
        owner = torch.bucketize(selected.cpu(), ends, right=True)
        scores = torch.bincount(owner, minlength=len(layout.chunk_ids))[layout.pinned:].float()
    else:
        from kvstitch.text.bm25 import BM25

        question = layout.question or engine.tokenizer.decode(layout.suffix_ids, skip_special_tokens=True)
        texts = [engine.tokenizer.decode(layout.chunk_ids[i], skip_special_tokens=True) for i in free]
        scores = BM25(texts).scores(question)
    top = torch.argsort(scores, descending=True, stable=True)[:m].tolist()  # ties: the earlier chunk
    return list(range(layout.pinned)) + sorted(free[j] for j in top)


class ShortPrompt:
    """The verification's short prompt, prefilled in full once: the question over `verification_chunks` only.

    `greedy_given(guess)` is its greedy answer (``n_probe`` tokens or EOS). The guess (a round's probe) is read
    teacher-forced in one pass, and step-by-step decoding starts only where the short prompt's argmax leaves
    it: when a round says what the short prompt says, checking it costs one forward of its few tokens instead
    of decoding the short prompt's answer token by token."""

    @torch.no_grad()
    def __init__(self, engine, layout, m: int, n_probe: int, chunks: list[int] | None = None):
        from kvstitch.core.prompt import PromptLayout

        self.engine, self.n_probe = engine, n_probe
        self.chunks = verification_chunks(engine, layout, m) if chunks is None else chunks
        layout = layout.without_links()  # a full prefill: the prompt as the model reads it, no adapter
        self.layout = PromptLayout(layout.prefix_ids, [layout.chunk_ids[i] for i in self.chunks], layout.suffix_ids,
                                   [layout.order[i] for i in self.chunks], layout.pinned, layout.question)
        self.cache, logits = engine.full_prefill(self.layout, extra=n_probe)
        self.first = logits[-1].float().cpu()

    @torch.no_grad()
    def greedy_given(self, guess: list[int]) -> list[int]:
        N, eng, first = self.layout.n_total, self.engine, self.first
        guess = list(guess[:self.n_probe])
        self.cache.truncate(N)
        if not guess or int(torch.argmax(first)) != guess[0]:
            return _greedy_probe(eng, self.cache, N, first, [], [], self.n_probe).tokens
        out = [] if len(guess) == 1 else list(eng.forward(self.cache, torch.tensor(guess[:-1]),
                                                         torch.arange(N, N + len(guess) - 1),
                                                         logits_to_keep=len(guess) - 1).float().cpu())
        logits = [first] + out  # logits[i] chose the short prompt's token i; guess[:k] is its own so far
        k = 1
        while True:
            if eng.finished(guess[:k]) or k == self.n_probe:
                return guess[:k]
            if k == len(guess):  # all of the guess is its own: continue after it (its last K/V not written yet)
                return _greedy_probe(eng, self.cache, N, first, guess, logits[:k], self.n_probe).tokens
            own = int(torch.argmax(logits[k]))
            if own != guess[k]:  # it leaves the guess here: its own token, then step by step
                self.cache.truncate(N + k)
                return _greedy_probe(eng, self.cache, N, first, guess[:k] + [own], logits[:k + 1], self.n_probe).tokens
            k += 1

    @torch.no_grad()
    def probs_given(self, guess: list[int]) -> torch.Tensor:
        """The short prompt's probability of each token of ``guess`` (teacher-forced, one forward) -> [len]."""
        N, guess = self.layout.n_total, list(guess[:self.n_probe])
        if not guess:
            return torch.empty(0)
        self.cache.truncate(N)
        rows = [self.first]
        if len(guess) > 1:
            rows += list(self.engine.forward(self.cache, torch.tensor(guess[:-1]), torch.arange(N, N + len(guess) - 1),
                                             logits_to_keep=len(guess) - 1).float().cpu())
        self.cache.truncate(N)
        return torch.softmax(torch.stack(rows), -1).gather(1, torch.tensor(guess).view(-1, 1)).flatten()

    def answer_given(self, guess: list[int]) -> str:
        """`greedy_given` as text."""
        return self.engine.answer_text(self.greedy_given(guess), strip=False)


def reference_answer(engine, layout, m: int, n_probe: int) -> Reference:
    """Full prefill of ``layout`` reduced to `verification_chunks`, greedy for ``n_probe`` tokens."""
    short = ShortPrompt(engine, layout, m, n_probe)
    return Reference(short.answer_given([]), short.chunks, short.layout.n_context)


def _restore(cache, stale, done: torch.Tensor, c0: int, c1: int) -> None:
    """``mode="refresh"``: put the stitched K/V of the tokens earlier rounds recomputed back, and mark none done."""
    back = done.nonzero().flatten().to(cache.layers[0].keys.device)
    for layer, (k, v) in zip(cache.layers, stale):
        layer.keys[:, :, c0:c1].index_copy_(2, back, k.index_select(2, back))
        layer.values[:, :, c0:c1].index_copy_(2, back, v.index_select(2, back))
    done[:] = False


def _compare(engine, cache, N: int, out: torch.Tensor, prev: Probe, n_probe: int, tol: float,
             entry: dict) -> tuple[Probe, float]:
    """A later round against the previous one's probe (teacher-forced in its pass, logits ``out``): records in
    ``entry`` whether it agrees (the whole probe reproduced, mean KL below ``tol``) -> (this round's probe: the
    previous one, or its own from the first divergence; the mean KL)."""
    pred = out.argmax(-1).tolist()
    k = agreeing_prefix(pred, prev.tokens)
    kl = max(0.0, float(_kl(prev.logits, out.cpu()).mean()))  # rounding can make it -1e-9
    entry.update(agreed=k == len(prev.tokens) and kl < tol, kl=round(kl, 6),
                 first_divergence=None if k == len(prev.tokens) else k,
                 max_kl=round(float(_kl(prev.logits, out.cpu()).max()), 6))
    if k == len(prev.tokens):
        return Probe(list(prev.tokens), out.float().cpu()), kl
    cache.truncate(N + k)  # this round writes another answer: its own probe, from the divergence on
    return _greedy_probe(engine, cache, N, out[k], prev.tokens[:k] + [pred[k]], list(out[:k + 1].float().cpu()),
                         n_probe), kl


def _verify(engine, short: ShortPrompt, probe: Probe, accept: str, entry: dict, verify: dict) -> None:
    """Verification (module doc): the round's probe against the short prompt's greedy answer, in ``entry``."""
    t0 = time.perf_counter()
    ref = short.answer_given(probe.tokens)  # the short prompt's greedy answer
    verify.update(answer=ref, seconds=round(verify["seconds"] + time.perf_counter() - t0, 4))
    entry["answer"] = engine.answer_text(probe.tokens, strip=False)
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
    from kvstitch.select import SelectionContext
    from .stitch import stitch, with_adapter

    n = layout.n_context
    if selector.zero_budget:  # naive, APE: nothing to rank (checked first: an error whatever the length)
        raise InputError(f"method {selector.name!r} does not rank context tokens, so it cannot choose a budget "
                         f"adaptively (recompute_ratio='auto'); use a scoring method such as prophet")
    if n < auto.min_context:  # too short for rounds to pay off: full prefill answers (ratio_used 1, 0 rounds)
        stats.update(converged=False, rounds=0, recompute_cost=0.0, round_log=[], auto_skipped="short_context")
        return None
    n_probe = max(1, min(auto.probe_tokens, extra))  # never probe past the answer's own cap
    rounds = auto.rounds()
    if auto.verify_chunks and len(layout.chunk_ids) - layout.pinned <= auto.verify_chunks:
        # the short prompt would be the whole prompt
        stats.update(converged=False, rounds=0, recompute_cost=0.0, round_log=[], auto_skipped="few_chunks")
        return None
    kvs = engine.chunk_kvs(layout, stats, anchors=selector.chunk_anchors())
    layout, adapted = with_adapter(engine, layout, "auto", stats)
    cache = stitch(engine, layout, kvs, extra=extra + n_probe, adapted=adapted)
    ctx = SelectionContext(engine, cache, layout, max(1, round(rounds[-1] * n)), stats,
                           precompute=engine.precompute_mode, chunks=kvs, score_hook=engine.hooks.score)
    ranking = selector.ranking(ctx)  # may reorder chunks (InfoFlow): use ctx's layout and cache from here on
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
    prev: Probe | None = None
    streak = 0
    forwarded = short.layout.n_context if short is not None else 0  # the verification's prefill is work too
    N = layout.n_total
    for i, r in enumerate(rounds):
        want = ranking(round(r * n))
        if stale is not None:  # refresh: this round is one pass over its whole set, from the stitched K/V
            _restore(cache, stale, done, c0, c1)
        new = want[~done[want]] if want.numel() else want
        done[new] = True
        forwarded += int(new.numel())
        tf = prev.tokens[:-1] if prev is not None else []
        slots = torch.cat([new.sort().values + layout.context_start, torch.arange(layout.context_end, N),
                           torch.arange(N, N + len(tf))])
        ids = torch.cat([layout.ids[:N], torch.tensor(prev.tokens if prev else [], dtype=torch.long)])[slots]
        out = engine.forward(cache, ids, slots, plan, logits_to_keep=1 + len(tf))
        entry = {"ratio": round(float(done.sum()) / max(n, 1), 6), "new_tokens": int(new.numel())}
        if prev is None:
            probe = _greedy_probe(engine, cache, N, out[-1], [], [], n_probe)
            entry.update(agreed=None, kl=None)
        else:
            probe, stats["signal"] = _compare(engine, cache, N, out, prev, n_probe, auto.tol, entry)
            streak = streak + 1 if entry["agreed"] else 0
        p_tok = torch.softmax(probe.logits.float(), -1).gather(1, torch.tensor(probe.tokens).view(-1, 1)).flatten()
        entry.update(probe=list(probe.tokens), min_p=round(float(p_tok.min()), 6))
        confident = auto.min_p is not None and float(p_tok.min()) >= auto.min_p
        entry["confident"] = confident
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
