"""Fidelity metrics against full prefill: they separate "the stitched cache is close to the real one" from
"a small model happens to answer the task", which matters when the model fails a task even with full
prefill (task score then says nothing about the method)."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F


def _as_2d(logits: torch.Tensor) -> torch.Tensor:
    """[V] or [..., T, V] -> [N, V] in float64 (KL of near-identical distributions needs the precision)."""
    x = torch.as_tensor(logits)
    if x.dim() == 0:
        raise ValueError("logits must have a vocabulary dimension")
    return x.reshape(-1, x.shape[-1]).to(torch.float64)


def kl_full_vs_method(logits_full: torch.Tensor, logits_method: torch.Tensor) -> float:
    """Mean over positions of KL(p_full || p_method), in nats.

    Both `[T, V]` (or `[V]`): next-token logits at the same positions, teacher-forced on the full-prefill
    answer so that both runs condition on the same tokens."""
    full, method = _as_2d(logits_full), _as_2d(logits_method)
    if full.shape != method.shape:
        raise ValueError(f"logit shapes differ: {tuple(full.shape)} vs {tuple(method.shape)}")
    log_p, log_q = F.log_softmax(full, dim=-1), F.log_softmax(method, dim=-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(dim=-1)
    return float(kl.clamp_min(0.0).mean())


def answer_nll(logits: torch.Tensor, target_ids: torch.Tensor) -> float:
    """Mean negative log-likelihood (nats/token) of `target_ids` [T] under `logits` [T, V], where row t is
    the distribution that predicts target t (the caller does the one-position shift)."""
    x = _as_2d(logits)
    y = torch.as_tensor(target_ids, dtype=torch.long).reshape(-1)
    if x.shape[0] != y.shape[0]:
        raise ValueError(f"{x.shape[0]} logit rows for {y.shape[0]} targets")
    return float(F.cross_entropy(x, y, reduction="mean"))


def nll_gap_recovery(nll_naive: float, nll_method: float, nll_full: float, eps: float = 1e-4) -> float:
    """Share of the naive-reuse NLL gap a method closes: (naive - method) / (naive - full).

    1 = as good as full prefill, 0 = no better than naive reuse (can leave [0, 1]). NaN when naive and
    full are within `eps` nats: there is no gap to recover and the ratio would be noise."""
    gap = nll_naive - nll_full
    if not math.isfinite(gap) or abs(gap) < eps:
        return math.nan
    return (nll_naive - nll_method) / gap


def _index_set(x: Iterable[int] | torch.Tensor) -> set[int]:
    if isinstance(x, torch.Tensor):
        return {int(i) for i in x.reshape(-1).tolist()}
    return {int(i) for i in x}


def overlap_ratio(selected: Iterable[int] | torch.Tensor, reference: Iterable[int] | torch.Tensor) -> float:
    """|S ∩ G| / |G| (ProphetKV Fig. 3): how much of the critical set G the selection S covers.

    The project's one definition (the oracle's reference set G is scored with it too). NaN if G is empty:
    0/0 is undefined, and a NaN cannot be averaged into a mean by mistake the way 1.0 or 0.0 could."""
    s, g = _index_set(selected), _index_set(reference)
    return len(s & g) / len(g) if g else math.nan
