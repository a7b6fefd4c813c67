"""Token and page importance estimates used by the decode policies.

- `bound_scores`: the bounding-box upper bound of q·k over a page, Σ_d max(q_d·kmin_d, q_d·kmax_d)
  (Quest; ArkVale's cuboid digest; PRKV's dynamic pages, Sec. 4.1 "Hybrid KV Sparsity").
- `moment_query`: the query side of the moments digest (`PageBounds(digest="moments")`): a page's share of
  the attention, log Σ_j exp(s·q·k_j), is to second order log P + s·q·μ + (s²/2)·Σ_d q_d² σ_d² for keys of
  mean μ and per-dimension variance σ² (the Gaussian log-moment), so q·μ + (s/2)·q²·σ² ranks pages by
  their estimated attention mass: one matmul of ``(q | s/2 · q²)`` with ``(μ | σ²)``. A box bound is
  set by the page's most extreme key in every dimension at once, which overrates wide pages.
- `observation_probs` / `observation_scores`: attention of the observation-window queries over the
  keys, GQA-aware as in PRKV Sec. 4.1 / Alg. 1 lines 6-8: keys are repeated for every query head, each
  query head gets its own softmax, and only then are scores averaged within the group (averaging the
  queries first would let opposite-signed heads cancel).
"""

from __future__ import annotations

import torch


def bound_scores(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor) -> torch.Tensor:
    """Upper bound of ``q·k`` for every page: ``q [Hkv, G, D]``, boxes ``[Hkv, C, D]`` -> ``[Hkv, G, C]``.

    max(q_d·lo, q_d·hi) is q_d·hi when q_d >= 0 and q_d·lo otherwise, so the bound is two matmuls.
    """
    q = q.float()
    return q.clamp(min=0) @ kmax.float().transpose(1, 2) + q.clamp(max=0) @ kmin.float().transpose(1, 2)


def box_scores(q: torch.Tensor, box: torch.Tensor) -> torch.Tensor:
    """`bound_scores` from `pool.PageBounds` boxes ``(kmax | -kmin)`` ``[Hkv, C, 2D]`` in one matmul:
    ``relu(q)·kmax + relu(-q)·(-kmin)`` = ``(relu(q) | relu(-q)) @ box^T`` -> ``[Hkv, G, C]``.
    ``q [Hkv, G, D]``; a caller that only needs the group mean can pass ``[Hkv, 1, 2D]`` pre-reduced
    (see `signed_query`), since the bound is linear in the signed query."""
    q2 = q if q.shape[-1] == box.shape[-1] else signed_query(q)
    return torch.bmm(q2, box.transpose(1, 2))


def signed_query(q: torch.Tensor) -> torch.Tensor:
    """``(relu(q) | relu(-q))`` ``[..., 2D]`` (float32)."""
    q = q.float()
    return torch.cat((q, -q), dim=-1).clamp_(min=0)


def moment_query(q: torch.Tensor, scaling: float) -> torch.Tensor:
    """``(q | scaling / 2 · q²)`` ``[..., 2D]`` (float32): times a moments digest ``(μ | σ²)``, the page's
    estimated log attention mass over ``scaling`` (module docstring)."""
    q = q.float()
    return torch.cat((q, q.square() * (scaling / 2)), dim=-1)


def observation_probs(obs_q: torch.Tensor, keys: torch.Tensor, scaling: float) -> torch.Tensor:
    """Attention probabilities of the observation queries, one softmax per query head.

    ``obs_q [Hq, w, D]`` are the queries of the last ``w`` tokens, whose keys are the last ``w`` rows of
    ``keys [Hkv, n, D]``; the causal mask applies among them. Returns ``[Hq, w, n]`` (float32).
    """
    Hq, w, D = obs_q.shape
    Hkv, n, _ = keys.shape
    # query head h uses kv head h // G (repeat_kv), computed per KV group without materialising the repeat
    q = obs_q.float().reshape(Hkv, (Hq // Hkv) * w, D)
    logits = torch.bmm(q, keys.float().transpose(1, 2)).view(Hq, w, n) * scaling
    rows = torch.arange(w, device=keys.device).unsqueeze(1)
    cols = torch.arange(n, device=keys.device).unsqueeze(0)
    logits.masked_fill_(cols > (n - w) + rows, float("-inf"))  # query i sits at position n - w + i
    return logits.softmax(dim=-1)


def group_mean(per_head: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """Average ``[Hq, ..., n]`` query-head scores within each KV group and over the middle axes -> ``[Hkv, n]``."""
    n = per_head.shape[-1]
    return per_head.reshape(num_kv_heads, -1, n).mean(dim=1)


def observation_scores(obs_q: torch.Tensor, keys: torch.Tensor, scaling: float) -> torch.Tensor:
    """Per KV head token importance ``[Hkv, n]``: Alg. 1 lines 6-8 (softmax per query head, then mean over
    the group and the observation window)."""
    return group_mean(observation_probs(obs_q, keys, scaling), keys.shape[0])
