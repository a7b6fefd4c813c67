"""KIVI-style asymmetric 8-bit quantization of K/V (Liu et al., 2024, "KIVI").

Keys have outlier *channels* (a few head_dim lanes are large for every token), so they are quantized per
channel over the tokens; values have no channel structure but vary per token, so they are quantized per
token over the channels. Both use ``x ~= q * scale + zero`` with ``q`` in 0..255 (uint8) and a float32
scale/zero per group: the error of every element is at most ``scale / 2``.
"""

from __future__ import annotations

import torch


def quantize(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize `x` with one (scale, zero) per slice reduced over `dim` -> (q uint8, scale f32, zero f32)."""
    x = x.float()
    zero = x.amin(dim=dim, keepdim=True)
    scale = (x.amax(dim=dim, keepdim=True) - zero) / 255.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # a constant group: q = 0, exact
    q = (x - zero).div_(scale).round_().clamp_(0, 255).to(torch.uint8)
    return q, scale.contiguous(), zero.contiguous()


def dequantize(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of `quantize` (computed in float32, then cast to the compute `dtype`)."""
    x = torch.addcmul(zero, q.float(), scale)
    return x if dtype == torch.float32 else x.to(dtype)


def quantize_keys(k: torch.Tensor):
    """Per-channel: k is ``[L, H, n, d]``; scale/zero are ``[L, H, 1, d]`` (reduced over tokens)."""
    return quantize(k, dim=2)


def quantize_values(v: torch.Tensor):
    """Per-token: v is ``[L, H, n, d]``; scale/zero are ``[L, H, n, 1]`` (reduced over channels)."""
    return quantize(v, dim=3)
