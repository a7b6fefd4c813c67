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
    """
    Hq, _, D = q.shape
    Hkv = keys.shape[0]
    logits = (q.float().view(Hkv, Hq // Hkv, D) @ keys.float().transpose(1, 2)) * scaling  # [Hkv, G, T]
    if valid is not None:
        logits.masked_fill_(~valid.unsqueeze(1), float("-inf"))
    probs = logits.softmax(dim=-1)
    out = probs @ values.float()  # [Hkv, G, D]
    return out.reshape(Hq, 1, D).to(q.dtype), probs
