"""Verification against full prefill and teacher forcing: the guard (``guard="full"``: the stitched greedy
answer, checked and if need be corrected against full prefill) and `teacher_force` (logits of a given answer
in one pass), both read through `forcing.force_greedy`.

The functions take the `Engine` as their first argument and reach it through its public members.
"""

from __future__ import annotations

import time

import torch

from kvstitch.core.attention import ForwardPlan
from kvstitch.core.errors import InputError
from kvstitch.core.prompt import PromptLayout
from .answer import decode_tokens, make_result
from .forcing import force_greedy
from .request import STOP, GenerationRequest, Prefill


@torch.no_grad()
def teacher_force(engine, pre: Prefill, answer_ids: torch.Tensor, plan: ForwardPlan | None = None) -> torch.Tensor:
    """Logits ``[T, V]`` (float32, cpu) predicting each of ``answer_ids`` after ``pre`` (one pass of the
    first T-1 answer tokens; the cache keeps their K/V)."""
    answer_ids = torch.as_tensor(answer_ids, dtype=torch.long).flatten().tolist()
    return force_greedy(engine, pre.cache, pre.layout.n_total, answer_ids, first=pre.logits[-1], plan=plan).forced


@torch.no_grad()
def verify_against_full(engine, layout: PromptLayout, tokens: list[int], max_new_tokens: int):
    """Check a greedy answer against full prefill: teacher-force ``tokens`` after a full prefill of ``layout``
    (one pass); when full prefill's argmax reproduces every token, full prefill's greedy answer IS ``tokens``.
    Otherwise full prefill's own greedy answer is decoded from the first divergence.
    -> (full prefill's greedy answer, {"agreed", "first_divergence"})."""
    cache, logits = engine.full_prefill(layout, extra=max_new_tokens)
    full = force_greedy(engine, cache, layout.n_total, tokens, max_new_tokens, first=logits[-1])
    agreed = full.agreed == len(tokens)
    return full.tokens, {"agreed": agreed, "first_divergence": None if agreed else full.agreed}


def guarded(engine, req: GenerationRequest, pre: Prefill, t_start: float):
    """guard="full": yield the stitched greedy answer, verified (and if need be corrected) against full
    prefill, then its `GenerationResult`."""
    if req.temperature > 0:
        raise InputError("guard='full' verifies the greedy answer: use temperature 0")
    tokens = list(decode_tokens(engine, pre, req.max_new_tokens, 0.0, 1.0, req.seed, req.decode, req.kv_budget,
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
