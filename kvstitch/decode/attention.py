"""Single-query GQA attention over a gathered token set (the sparse paged attention of PRKV Sec. 4.1).

Query head h uses KV head ``h // (Hq // Hkv)``. Softmax runs in float32; masked tokens get exactly zero
weight, so attending to a superset of the tokens padded with masked rows gives the dense result.
"""

from __future__ import annotations

import torch


def grouped_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float,
                      valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``q [Hq, 1, D]``, ``keys/values [Hkv, T, D]``, ``valid [Hkv, T]`` (bool, None = all).

    Returns the output ``[Hq, 1, D]`` (dtype of ``q``) and the probabilities ``[Hkv, G, T]`` (float32).
    Two batched matmuls and a softmax: a decode step calls this once per layer, so no op is spent on
    dtype conversions that are no-ops (float32 in, float32 out).
    """
    Hq, _, D = q.shape
    Hkv = keys.shape[0]
    f32 = torch.float32
    qf = q if q.dtype == f32 else q.float()
    kf = keys if keys.dtype == f32 else keys.float()
    vf = values if values.dtype == f32 else values.float()
    logits = torch.bmm(qf.reshape(Hkv, Hq // Hkv, D), kf.transpose(1, 2)).mul_(scaling)  # [Hkv, G, T]
    if valid is not None:
        logits.masked_fill_(~valid.unsqueeze(1), float("-inf"))
    probs = logits.softmax(dim=-1)
    out = torch.bmm(probs, vf).view(Hq, 1, D)  # [Hkv, G, D] -> [Hq, 1, D]
    return (out if q.dtype == f32 else out.to(q.dtype)), probs


def biased_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float,
                     bias: torch.Tensor) -> torch.Tensor:
    """`grouped_attention` (float32) with an additive ``bias [Hkv, T]`` (0 / -inf) as the mask:
    ``softmax(scaling * q k^T + bias) v`` -> ``[Hq, 1, D]``. (A broadcast ``baddbmm`` measured 4x slower
    than this bmm + add_ on CPU.)"""
    Hq, _, D = q.shape
    Hkv = keys.shape[0]
    keys, values = keys.float(), values.float()  # no-ops for float32 buffers
    logits = torch.bmm(q.float().reshape(Hkv, Hq // Hkv, D), keys.transpose(1, 2)).mul_(scaling)
    logits.add_(bias.unsqueeze(1))
    return torch.bmm(logits.softmax(dim=-1), values).view(Hq, 1, D).to(q.dtype)
