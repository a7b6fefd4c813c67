"""Static token selection: PRKV Alg. 1 (lines 9-11) and the online static ratio of App. G.

The static set of a layer is, per KV head, the sinks plus the top tokens by observation-window score
(`scoring.observation_scores`). It is moved to the front of the cache (storage order), the remaining
tokens keep their relative (token) order behind it, so the static set fills whole pages and the pages
after it are ordinary page-granular candidates.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def static_permutation(scores: torch.Tensor, token_pos: torch.Tensor, n_static: int, n_sinks: int) -> torch.Tensor:
    """New storage order ``[Hkv, R]`` (indices into the current order) of the restructured region.

    ``scores``/``token_pos`` ``[Hkv, R]`` describe the region's current storage order. The first
    ``n_static`` entries are the sinks (token positions ``< n_sinks``, always kept) and the best-scoring
    other tokens, in token order; the rest follow in token order (Alg. 1 lines 9-11).
    """
    R = scores.shape[1]
    n_static = min(n_static, R)
    forced = scores.float().masked_fill(token_pos.to(scores.device) < n_sinks, float("inf"))
    chosen = torch.zeros_like(forced, dtype=torch.bool)
    chosen.scatter_(1, forced.topk(n_static, dim=1).indices, True)
    order_key = token_pos.to(scores.device) + (~chosen).long() * (int(token_pos.max()) + 1)
    return order_key.argsort(dim=1)


def pool_in_token_order(scores: torch.Tensor, token_pos: torch.Tensor, kernel_size: int) -> torch.Tensor:
    """SnapKV's 1-D average pooling of token scores, taken over neighbours in *token* order (the storage
    order of a restructured cache is not the token order). ``kernel_size`` must be odd; 1 = no pooling."""
    if kernel_size <= 1:
        return scores
    order = token_pos.to(scores.device).argsort(dim=1)
    pooled = F.avg_pool1d(scores.gather(1, order).unsqueeze(1), kernel_size, stride=1,
                          padding=kernel_size // 2, count_include_pad=False).squeeze(1)
    return torch.empty_like(pooled).scatter_(1, order, pooled)


def online_static_ratio(probs: torch.Tensor, budget: int, page_size: int) -> float:
    """PRKV App. G: S from the overlap of the first and last observation queries' top-k.

    ``probs [Hq, w, n]`` are the observation attention probabilities over the candidate keys (the cache
    without the local window). C_h = |topk(S_h^(1), k) ∩ topk(S_h^(T), k)| (Eq. 4), and
    S = P·floor(E_h[C_h] / P) / k (Eq. 5), the mean overlap rounded down to whole pages.
    """
    Hq, _, n = probs.shape
    k = min(budget, n)
    if k == 0:
        return 0.0
    in_first = torch.zeros(Hq, n, dtype=torch.bool, device=probs.device)
    in_first.scatter_(1, probs[:, 0].topk(k, dim=1).indices, True)
    overlap = in_first.gather(1, probs[:, -1].topk(k, dim=1).indices).sum(dim=1).float()  # C_h
    return page_size * math.floor(overlap.mean().item() / page_size) / budget
