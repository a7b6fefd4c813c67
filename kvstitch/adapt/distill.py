"""Distillation from full prefill (`kvstitch.adapt.train` runs it): the teacher's targets, the student's passes
and the loss between them.

- **teacher** (`teacher_targets`, once per context, kept on disk): full prefill of the passages, then per question
  the suffix (question, end of turn, assistant header) and the teacher's own greedy answer. What is kept is the
  teacher's top-k log-probabilities at every position that predicts a question or answer token (`Targets`).
- **student** (`student_logits`): the stitched cache, then one forward with gradients of the adapter's link
  tokens + the question + the teacher's answer (teacher-forced) over it, out of place. An adapter with a writer
  LoRA also writes the passages' K/V with gradients (`written_chunks`), as precompute would with it.
- **loss** (`sparse_kl`, `questions_loss`): KL(teacher || student) over the top-k tokens plus the tail's mass,
  per position; answer positions weigh 1, question positions ``question_weight``. Optionally plus ``answer_ce``
  times the cross-entropy of the teacher's answer tokens: the KL moves the whole distribution, while what is scored
  is the argmax, which a near tie flips. Or plus ``answer_margin`` times a hinge on each answer token's margin
  (`margin_hinge`): zero once the student prefers the teacher's token by the teacher's own margin (up to
  `MARGIN_CAP`), so it spends the adapter only on the answers whose argmax is wrong or nearly so.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from kvstitch.core.attention import ForwardPlan
from kvstitch.core.cache import StitchCache
from kvstitch.core.chunk import ChunkKV
from kvstitch.models import cache_kwargs
from kvstitch.models.stitch_adapter import gate_of, gated, writing
from .data import Context

MARGIN_CAP = 1.0  # nats: a margin the teacher itself exceeds is not asked of the student beyond this


@dataclass
class Targets:
    """The teacher's view of one question over one context."""

    suffix: torch.Tensor  # [n_s] ids: question, end of turn, assistant header
    answer: torch.Tensor  # [n_a] the teacher's greedy answer (EOS included when it stopped)
    top_ids: torch.Tensor  # [n_s + n_a - 1, k] int32: the teacher's top-k next tokens at every position
    top_logp: torch.Tensor  # [n_s + n_a - 1, k] float32: their log-probabilities


# ---- teacher --------------------------------------------------------------------------------------------
@torch.no_grad()
def teacher_targets(engine, ctx: Context, max_answer: int, top_k: int) -> list[Targets]:
    """Full prefill of ``ctx``'s passages once, then every question over a copy of its cache, and the greedy
    answers of all questions decoded together (one batched step per token)."""
    from kvstitch.engine.batch import DecodeStep

    layouts = [engine.layout(q, list(ctx.passages)) for q in ctx.questions]
    n_ctx = layouts[0].context_end
    cache = StitchCache.empty(engine.adapter, n_ctx, engine.device, engine.dtype)
    engine.forward(cache, layouts[0].ids[:n_ctx], torch.arange(n_ctx))
    keys, values = cache.stacked_keys(), cache.stacked_values()
    caches, rows, answers = [], [], []
    for lay in layouts:
        c = StitchCache.from_stacked(keys, values, capacity=n_ctx + lay.n_suffix + max_answer)
        n_s = lay.n_suffix
        rows.append([engine.forward(c, lay.suffix_ids, torch.arange(n_ctx, n_ctx + n_s), logits_to_keep=n_s)])
        answers.append([int(rows[-1][0][-1].argmax())])
        caches.append(c)

    def done(ans: list[int]) -> bool:  # the first line is the answer (what evaluation scores)
        return engine.finished(ans) or "\n" in engine.answer_text(ans[-1:], strip=False) or len(ans) >= max_answer

    live = [i for i, a in enumerate(answers) if not done(a)]
    while live:
        logits = engine.decode_batch([DecodeStep(caches[i], answers[i][-1]) for i in live])
        for i, lg in zip(live, logits):
            rows[i].append(lg)
            answers[i].append(int(lg[-1].argmax()))
        live = [i for i in live if not done(answers[i])]
    out = []
    for lay, r, answer in zip(layouts, rows, answers):
        logp = torch.log_softmax(torch.cat(r).float(), -1)
        top = logp.topk(top_k, dim=-1)
        out.append(Targets(lay.suffix_ids.clone(), torch.tensor(answer), top.indices.to(torch.int32).cpu(),
                           top.values.cpu()))
    return out


def cached_targets(engine, folder: Path, ctx: Context, cfg) -> list[Targets]:
    """`teacher_targets`, computed once per context and kept in ``folder`` (runs of one model may share it);
    ``cfg``: an `AdaptConfig` (its ``max_answer`` and ``top_k``)."""
    key = hashlib.sha256(json.dumps([ctx.key, ctx.passages, ctx.questions, cfg.max_answer, cfg.top_k,
                                     engine.fingerprint]).encode()).hexdigest()[:24]
    path = Path(folder) / f"{key}.pt"
    if path.exists():
        return [Targets(**t) for t in torch.load(path, weights_only=True)]
    got = teacher_targets(engine, ctx, cfg.max_answer, cfg.top_k)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # runs may share a teacher folder
    torch.save([asdict(t) for t in got], tmp)
    tmp.replace(path)
    return got


# ---- student --------------------------------------------------------------------------------------------
def sparse_kl(student_logits: torch.Tensor, top_ids: torch.Tensor, top_logp: torch.Tensor) -> torch.Tensor:
    """Per position KL(teacher || student) over the teacher's top-k tokens plus one bucket for the rest."""
    logq = torch.log_softmax(student_logits.float(), -1)
    q_top = logq.gather(-1, top_ids.long())
    p_top = top_logp.exp()
    p_rest = (1 - p_top.sum(-1)).clamp_min(1e-8)
    q_rest = (1 - q_top.exp().sum(-1)).clamp_min(1e-8)
    return (p_top * (top_logp - q_top)).sum(-1) + p_rest * (p_rest.log() - q_rest.log())


def student_logits(engine, cache: StitchCache, layout, tails: list[torch.Tensor],
                   recompute: torch.Tensor | None = None, strength: float = 1.0) -> list[torch.Tensor]:
    """Logits, with gradients to the adapter, at every position of each question's ``tail`` (its suffix and its
    answer but the last token), one row per question: one pass of the recomputed context tokens (``recompute``:
    context indices), the link tokens (``layout``'s) and the tail over ``cache`` (the questions' shared context),
    out of place, reading through the reader LoRA at ``strength``. Rows are right-padded: a token never sees the
    padding after it."""
    n_ctx, links = layout.context_end, layout.suffix_ids[:layout.links]
    rows = [torch.cat([links, t]) for t in tails]
    width = max(r.numel() for r in rows)
    ids = torch.full((len(rows), width), int(rows[0][-1]), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :r.numel()] = r
    slots = torch.arange(n_ctx, n_ctx + width)
    if recompute is not None and recompute.numel():
        ctx_slots = recompute.sort().values + layout.context_start
        slots = torch.cat([ctx_slots, slots])
        ids = torch.cat([layout.ids[ctx_slots].expand(len(rows), -1), ids], dim=1)
    if len(rows) > 1:  # one copy of the stitched context per question (read only: the pass is out of place)
        cache = StitchCache.from_stacked(cache.stacked_keys(0, n_ctx), cache.stacked_values(0, n_ctx),
                                         capacity=n_ctx + width, batch=len(rows))
    keep = width - layout.links  # the link tokens predict nothing
    slots = slots.to(engine.device)
    with cache.mode(slots=slots, write=False), gated(gate_of((slots >= n_ctx) * strength)):  # not recomputed passages
        out = engine.model(input_ids=ids.to(engine.device), position_ids=slots.view(1, -1).expand(len(rows), -1),
                           **cache_kwargs(engine.model, cache), use_cache=True, logits_to_keep=keep,
                           kvstitch_plan=ForwardPlan(q_slots=slots))
    return [out.logits[i, :r.numel() - layout.links] for i, r in enumerate(rows)]


def margin_hinge(logits: torch.Tensor, answer: torch.Tensor, top_logp: torch.Tensor) -> torch.Tensor:
    """Per answer position: how far the student's log-probability margin of the teacher's token over its best other
    token falls short of the teacher's own margin (its top two), capped at `MARGIN_CAP`; 0 when it does not."""
    logq = torch.log_softmax(logits.float(), -1)
    mine = logq.gather(-1, answer.view(-1, 1)).squeeze(-1)
    other = logq.scatter(-1, answer.view(-1, 1), float("-inf")).max(-1).values
    want = (top_logp[:, 0] - top_logp[:, 1]).clamp(max=MARGIN_CAP)
    return (want - (mine - other)).clamp_min(0)


def questions_loss(engine, cache: StitchCache, layout, targets: list[Targets], question_weight: float,
                   recompute: torch.Tensor | None = None, strength: float = 1.0,
                   answer_ce: float = 0.0, answer_margin: float = 0.0,
                   agree: list | None = None) -> torch.Tensor:
    """The mean over ``targets`` (questions over one context) of each one's weighted KL, plus ``answer_ce`` x the
    mean cross-entropy of the teacher's answer tokens and ``answer_margin`` x their mean `margin_hinge`, in one
    pass. ``agree``, if given, gets per question whether the student's argmax is the teacher's answer token at each
    answer position (teacher forced)."""
    tails = [torch.cat([t.suffix, t.answer[:-1]]) for t in targets]
    losses = []
    for logits, t in zip(student_logits(engine, cache, layout, tails, recompute, strength), targets):
        kl = sparse_kl(logits, t.top_ids.to(logits.device), t.top_logp.to(logits.device))
        w = torch.ones_like(kl)
        w[:t.suffix.numel() - 1] = question_weight  # positions that predict the question's own next token
        loss = (kl * w).sum() / w.sum()
        answer_logits, answer = logits[t.suffix.numel() - 1:].float(), t.answer.to(logits.device)
        if agree is not None:
            agree.append((answer_logits.argmax(-1) == answer).tolist())
        if answer_ce:
            loss = loss + answer_ce * torch.nn.functional.cross_entropy(answer_logits, answer)
        if answer_margin:
            top = t.top_logp[t.suffix.numel() - 1:].to(logits.device)
            loss = loss + answer_margin * margin_hinge(answer_logits, answer, top).mean()
        losses.append(loss)
    return torch.stack(losses).mean()


def written_chunks(engine, layout, group: int = 4) -> list[ChunkKV]:
    """Every passage's K/V written through the stitch adapter's writer LoRA, with gradients when they are on: as
    `kvstitch.engine.precompute.forward_chunks` computes them (after the shared prefix, or alone from position 0
    in isolated mode), right-padded. With gradients, ``group`` passages a pass, each pass checkpointed: its
    activations are recomputed in the backward instead of kept, so a context of 40 passages holds one group's
    (without it, training over 40 SQuAD passages outgrew 17 GB)."""
    pk, pv = engine.prefix_kv(layout.prefix_ids)
    p = layout.prefix_ids.numel()
    if engine.precompute_mode == "isolated":
        pk, pv, p = pk[:, :, :0], pv[:, :, :0], 0
    chunks = layout.chunk_ids
    if not torch.is_grad_enabled():
        return _written(engine, chunks, pk, pv, p)
    from torch.utils.checkpoint import checkpoint

    out = []
    for g in range(0, len(chunks), group):
        part = chunks[g:g + group]
        kv = checkpoint(lambda part=part: _written_kv(engine, part, pk, pv, p), use_reentrant=False)
        out += _as_chunks(engine, part, *kv, p)
    return out


def _written(engine, chunks, pk, pv, p: int) -> list[ChunkKV]:
    return _as_chunks(engine, chunks, *_written_kv(engine, chunks, pk, pv, p), p)


def _written_kv(engine, chunks, pk, pv, p: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One pass of ``chunks`` (right-padded) through the writer: their stacked keys and values."""
    n = max(c.numel() for c in chunks)
    ids = torch.full((len(chunks), n), int(chunks[0][0]), dtype=torch.long)
    for i, c in enumerate(chunks):
        ids[i, :c.numel()] = c
    cache = StitchCache.from_stacked(pk, pv, capacity=p + n, batch=len(chunks))
    slots = torch.arange(p, p + n, device=engine.device)
    with cache.mode(slots=slots, write=True), writing(True):
        engine.model(input_ids=ids.to(engine.device), position_ids=slots.view(1, -1).expand(len(chunks), -1),
                     **cache_kwargs(engine.model, cache), use_cache=True, logits_to_keep=1,
                     kvstitch_plan=ForwardPlan(q_slots=slots))
    return cache.stacked_keys(p, p + n, batch=True), cache.stacked_values(p, p + n, batch=True)


def _as_chunks(engine, chunks, keys: torch.Tensor, values: torch.Tensor, p: int) -> list[ChunkKV]:
    return [ChunkKV(keys[i, :, :, :c.numel()], values[i, :, :, :c.numel()], c.cpu(), p, engine.fingerprint)
            for i, c in enumerate(chunks)]
