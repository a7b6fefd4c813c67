"""CPU only (numba): the page ranking of the bound decode policies in one call.

The page ranking of the bound policies has a numba form too (`top_pages`, any pool dtype: the digests are
float32): the digest scores, the group rule and the top-k of one row and layer in one call, where torch runs a
half-dozen small ops. Lone and batched steps rank through the same call (`rank_ok`), so a row picks the same
pages either way; with `ENABLED` off both rank with torch.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from . import kernel_common
from .kernel_common import numba

if numba is not None:

    @numba.njit(nogil=True, fastmath={"reassoc", "contract"}, cache=True)
    def _rank_pages(q, data, first, count, k, moments, reduce, scale, out):
        """Per KV head: score pages ``first .. first + count - 1`` of ``data [Hkv, capacity, 2D]`` for the
        query heads ``q [Hkv, G, D]`` as `policies.BoundPolicy.box_scores` does (``moments``: the digest kind;
        ``reduce``: 0 max, 1 mean, 2 sum, 3 softmax) -> the ``k`` best pages' offsets from ``first``, best
        first, into ``out [Hkv, k]``."""
        H, G, D = q.shape
        q2d = q.reshape((H * G, D))
        for h in range(H):
            rank_head(q2d, h * G, G, data[h], first, count, k, moments, reduce, scale, out[h])

    @numba.njit(nogil=True, fastmath={"reassoc", "contract"}, cache=True)
    def rank_head(q, q0, G, digests, first, count, k, moments, reduce, scale, out):
        """`_rank_pages` for one KV head: the query heads ``q[q0 : q0 + G]`` over the digests ``[capacity, 2D]``
        of its pages -> the ``k`` best offsets from ``first`` into ``out [k]``."""
        D = q.shape[1]
        linear = reduce == 1 or reduce == 2  # mean / sum: reduce the query first (the score is linear in it)
        Gs = 1 if linear else G
        q2 = np.zeros((Gs, 2 * D), dtype=np.float32)
        dots = np.empty((Gs, count), dtype=np.float32)
        score = np.empty(count, dtype=np.float32)
        half = np.float32(scale / 2)
        for g in range(G):
            row = q2[0] if linear else q2[g]
            for d in range(D):
                v = q[q0 + g, d]
                if moments:  # (q | s/2 q^2) . (mu | var)
                    row[d] += v
                    row[D + d] += half * v * v
                elif v > 0:  # (relu(q) | relu(-q)) . (kmax | -kmin)
                    row[d] += v
                else:
                    row[D + d] -= v
        if reduce == 1:
            for d in range(2 * D):
                q2[0, d] /= G
        for c in range(count):  # each digest read once for every query row
            digest = digests[first + c]
            for gi in range(Gs):
                qg = q2[gi]
                acc = np.float32(0.0)
                for d in range(2 * D):
                    acc += qg[d] * digest[d]
                dots[gi, c] = acc
        if linear:
            score[:] = dots[0]
        elif reduce == 0:
            for c in range(count):
                best = dots[0, c]
                for gi in range(1, G):
                    best = max(best, dots[gi, c])
                score[c] = best
        else:  # log of the group's summed softmax over the pages (scores scaled by ``scale``)
            for gi in range(G):
                dg = dots[gi]
                top = -np.inf
                for c in range(count):
                    dg[c] *= scale
                    top = max(top, dg[c])
                total = 0.0
                for c in range(count):
                    total += math.exp(dg[c] - top)
                lse = top + math.log(total)
                for c in range(count):
                    dg[c] -= lse
            for c in range(count):
                top = -np.inf
                for gi in range(G):
                    top = max(top, dots[gi, c])
                total = 0.0
                for gi in range(G):
                    total += math.exp(dots[gi, c] - top)
                score[c] = top + math.log(total)
        _top_k(score, k, out)

    @numba.njit(nogil=True, cache=True)
    def _worse(a_v, a_i, b_v, b_i):
        """Ranking order: a lower score is worse; of equal scores, the later page."""
        return a_v < b_v or (a_v == b_v and a_i > b_i)

    @numba.njit(nogil=True, cache=True)
    def _top_k(score, k, out):
        """The ``k`` best indices of ``score``, best first (ties: the earlier index), into ``out``: a heap of the k
        best seen, its worst at the root (a full sort of every candidate cost more than the scores)."""
        val = np.empty(k, dtype=np.float32)
        idx = np.empty(k, dtype=np.int64)
        n = 0
        for c in range(score.shape[0]):
            v = score[c]
            if n < k:  # sift the new entry up while it is worse than its parent
                j = n
                n += 1
                while j > 0 and _worse(v, c, val[(j - 1) >> 1], idx[(j - 1) >> 1]):
                    p = (j - 1) >> 1
                    val[j], idx[j] = val[p], idx[p]
                    j = p
                val[j], idx[j] = v, c
            elif _worse(val[0], idx[0], v, c):  # better than the worst kept: replace it, sift down
                j = 0
                while True:
                    m = 2 * j + 1
                    if m >= k:
                        break
                    if m + 1 < k and _worse(val[m + 1], idx[m + 1], val[m], idx[m]):
                        m += 1
                    if not _worse(val[m], idx[m], v, c):
                        break
                    val[j], idx[j] = val[m], idx[m]
                    j = m
                val[j], idx[j] = v, c
        for i in range(1, n):  # best first (insertion sort: k is a few dozen)
            v, c = val[i], idx[i]
            j = i
            while j > 0 and _worse(val[j - 1], idx[j - 1], v, c):
                val[j], idx[j] = val[j - 1], idx[j - 1]
                j -= 1
            val[j], idx[j] = v, c
        out[:n] = idx[:n]



REDUCES = {"max": 0, "mean": 1, "sum": 2, "softmax": 3}


def rank_ok(policy, device) -> bool:
    """Whether `top_pages` ranks ``policy``'s pages on ``device``: numba present and `ENABLED`, the CPU, and a
    bound policy whose scores are `BoundPolicy.box_scores` itself (a subclass that changes them, e.g. ArkVale's
    shared groups, ranks with torch)."""
    from .policies import BoundPolicy

    return (kernel_common.usable(device) and isinstance(policy, BoundPolicy)
            and type(policy).box_scores is BoundPolicy.box_scores)


def top_pages(policy, q: torch.Tensor, bounds, start: int, end: int, k: int, scaling: float | None) -> torch.Tensor:
    """CPU only (numba). ``policy``'s ``k`` best pages of ``[start, end)`` per KV head, best first, from the
    layer's `PageBounds` ``bounds``: `box_scores` + ``topk`` in one call (a lone step's half-dozen small torch
    ops cost more than the scores). ``q [Hkv, G, D]`` -> page ids ``[Hkv, k]`` (int64)."""
    H, G, D = q.shape
    bounds.settle(start, end)
    out = np.empty((H, k), dtype=np.int64)
    scale = scaling if scaling is not None else D ** -0.5
    _rank_pages(q.float().contiguous().numpy(), bounds.data.contiguous().numpy(), start, end - start, k,
                policy.digest == "moments", REDUCES[policy.group_reduce], float(scale), out)
    return torch.from_numpy(out).add_(start)

