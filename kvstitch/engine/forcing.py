"""Teacher forcing, and the greedy answer read off it: a given answer goes through the model in one pass, and
the model's own greedy answer is that answer as far as its argmax reproduces it, then its own tokens, decoded
step by step from the first token where it disagrees. Greedy decoding conditions every step on the tokens
before it, so where the argmax agrees the given tokens ARE the greedy answer: reading a given answer costs one
forward of its tokens instead of one step a token, and nothing more when the model agrees throughout.

Every reader of a given answer goes through `force_greedy`: `Engine.teacher_force` (an answer's logits), the
guard (`verify.verify_against_full`: the stitched answer under full prefill), ``recompute_ratio="auto"`` (each
round reads the previous round's probe; its short prompt reads a round's probe) and the eval (a method's
logits of full prefill's answer, and its own greedy answer).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvstitch.tasks.agreement import agreeing_prefix
from .sampling import finished


@dataclass
class Forced:
    """What `force_greedy` read: the given answer's teacher-forced logits, how far the model's argmax agrees
    with it, and (when asked for) the model's greedy answer with the logits that chose each of its tokens."""

    forced: torch.Tensor  # [max(T, 1), V] float32 cpu: row i predicts given token i (row 0: the prompt's last)
    agreed: int  # the argmax reproduces the given answer's first ``agreed`` tokens
    tokens: list[int]  # the model's greedy answer (empty when not asked for)
    logits: torch.Tensor  # [len(tokens), V] float32 cpu: row i chose tokens[i]


@torch.no_grad()
def force_greedy(engine, cache, start: int, given, max_tokens: int | None = None, *,
                 first: torch.Tensor | None = None, forced: torch.Tensor | None = None, plan=None) -> Forced:
    """Teacher-force ``given`` after the ``start`` prompt tokens of ``cache``; with ``max_tokens``, also the
    greedy answer: ``given`` as far as the argmax reproduces it, then the model's own tokens one step at a time,
    to EOS, a base model's line break (`sampling.finished`: the answer ends at its first finished prefix) or
    ``max_tokens``. The cache then holds the K/V of the answer's tokens but its last.

    ``first``: the logits predicting the answer's first token (the prompt's last row); the cache is cut back to
    the prompt and every given token but the last runs in one pass (their K/V stay). ``forced`` instead: those
    rows, from a pass that already forced ``given`` with other work (``auto``'s rounds force the previous
    round's probe in their recompute pass). ``plan``: the forward plan of every pass (a method's decode plan)."""
    given = [int(t) for t in given]
    T = len(given)
    if forced is None:
        cache.truncate(start)
        rows = [first.reshape(1, -1).float().cpu()]
        if T > 1:
            rows.append(engine.forward(cache, torch.tensor(given[:-1]), torch.arange(start, start + T - 1), plan,
                                       logits_to_keep=T - 1).float().cpu())
        forced = torch.cat(rows)
    forced = forced.float().cpu()[:max(T, 1)]
    pred = forced.argmax(-1).tolist()
    k = agreeing_prefix(pred, given)
    if max_tokens is None:
        return Forced(forced, k, [], forced[:0])
    tokens = given[:k] + pred[k:k + 1]  # and where it leaves ``given`` (or given nothing), its own token
    for j in range(1, len(tokens) + 1):
        if j >= max_tokens or finished(engine, tokens[:j]):
            tokens = tokens[:j]
            break
    cache.truncate(start + len(tokens) - 1)  # forced K/V past the answer's start are not this answer's
    logits = list(forced[:len(tokens)])
    while len(tokens) < max_tokens and not finished(engine, tokens):
        out = engine.forward(cache, torch.tensor([tokens[-1]]), torch.tensor([start + len(tokens) - 1]), plan)[-1]
        tokens.append(int(torch.argmax(out)))
        logits.append(out.float().cpu())
    return Forced(forced, k, tokens, torch.stack(logits))
