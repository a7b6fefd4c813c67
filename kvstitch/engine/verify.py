"""Verification against full prefill and teacher forcing: the guard (``guard="full"``: the stitched greedy
answer, checked and if need be corrected against full prefill) and `teacher_force` (logits of a given answer
in one pass).

The functions take the `Engine` as their first argument and reach it through its public members.
"""

from __future__ import annotations

import time

import torch

from kvstitch.core.attention import ForwardPlan
from kvstitch.core.errors import InputError
from kvstitch.core.prompt import PromptLayout
from kvstitch.select import make_selector
from kvstitch.tasks.agreement import agreeing_prefix
from .decoding import make_result
from .request import STOP, GenerationRequest, Prefill


@torch.no_grad()
def teacher_force(engine, pre: Prefill, answer_ids: torch.Tensor, plan: ForwardPlan | None = None) -> torch.Tensor:
    """Logits ``[T, V]`` (float32, cpu) predicting each of ``answer_ids`` after ``pre`` (one pass of the
    first T-1 answer tokens; the cache keeps their K/V)."""
    answer_ids = torch.as_tensor(answer_ids, dtype=torch.long).flatten()
    n, T = pre.layout.n_total, answer_ids.numel()
    pre.cache.truncate(n)
    rows = [pre.logits[-1:].float().cpu()]
    if T > 1:
        rows.append(engine.forward(pre.cache, answer_ids[:-1], torch.arange(n, n + T - 1), plan,
                                   logits_to_keep=T - 1).float().cpu())
    return torch.cat(rows)[:max(T, 1)]


@torch.no_grad()
def verify_against_full(engine, layout: PromptLayout, tokens: list[int], max_new_tokens: int):
    """Check a greedy answer against full prefill: teacher-force ``tokens`` after a full prefill of ``layout``
    (one pass); when full prefill's argmax reproduces every token, full prefill's greedy answer IS ``tokens``.
    Otherwise full prefill's own greedy answer is decoded from the first divergence.
    -> (full prefill's greedy answer, {"agreed", "first_divergence"})."""
    n = layout.n_total
    cache, logits = engine.full_prefill(layout, extra=max_new_tokens)
    rows = [logits[-1:]]
    if len(tokens) > 1:
        rows.append(engine.forward(cache, torch.tensor(tokens[:-1]), torch.arange(n, n + len(tokens) - 1),
                                   logits_to_keep=len(tokens) - 1))
    pred = torch.cat(rows).argmax(-1).tolist()
    k = agreeing_prefix(pred, tokens)
    if k == len(tokens):
        return list(tokens), {"agreed": True, "first_divergence": None}
    cache.truncate(n + k)
    pre = Prefill(cache, layout, logits[-1:], torch.arange(layout.n_context), {}, make_selector("full"),
                  greedy=tokens[:k] + [pred[k]])
    return list(engine.decode_tokens(pre, max_new_tokens)), {"agreed": False, "first_divergence": k}


def guarded(engine, req: GenerationRequest, pre: Prefill, t_start: float):
    """guard="full": yield the stitched greedy answer, verified (and if need be corrected) against full
    prefill, then its `GenerationResult`."""
    if req.temperature > 0:
        raise InputError("guard='full' verifies the greedy answer: use temperature 0")
    tokens = list(engine.decode_tokens(pre, req.max_new_tokens, 0.0, 1.0, req.seed, req.decode, req.kv_budget,
                                       req.decode_options))
    t0 = time.perf_counter()
    tokens, check = verify_against_full(engine, pre.layout.without_links(), tokens, req.max_new_tokens)
    pre.stats.update(guard={**check, "check_s": time.perf_counter() - t0})
    pre.stats["ttft_s"] = time.perf_counter() - t_start
    for i, tok in enumerate(tokens):
        if (yield tok) is STOP:
            tokens = tokens[:i + 1]
            break
    yield make_result(engine, pre, tokens, 0.0)
