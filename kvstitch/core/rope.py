"""Position recovery: re-rotate cached (post-RoPE) keys by a position delta.

RoPE rotates each frequency pair of a key by ``angle = position * inv_freq``. For every static RoPE
type (default, linear, llama3, yarn) the angle is linear in position, so ``R(p + d) = R(d) R(p)``: a key
computed at position ``p`` is moved to ``p + d`` by one extra rotation of ``d * inv_freq``. YaRN's
attention factor multiplies cos and sin alike, so it is already inside the cached key and the delta
rotation uses plain cos/sin. Angles are computed in float64 (large deltas lose precision in float32);
the multiply is done in float32 and cast back to the key dtype.

We use the rotate-half convention of Hugging Face models (GGUF weights are permuted to it on load);
`self_check` proves that on the real model, not just on this module's arithmetic.
"""

from __future__ import annotations

import torch

from .errors import PositionRecoveryError
from kvstitch.models import cache_kwargs

# Relative tolerance of the self-check: max|err| / max|k|. Float32 angle rounding at 8K-32K
# positions gives ~1e-4..1e-3; a wrong base, convention or RoPE type gives O(1).
SELF_CHECK_RTOL = 1e-2


def self_check_rtol(dtype: torch.dtype) -> float:
    """The self-check's tolerance for a model running in ``dtype``: `SELF_CHECK_RTOL`, or 8 units of
    the dtype's rounding when that is coarser (bfloat16: 0.0625). A bfloat16 model rounds its own RoPE
    cos/sin and keys to 8 bits of mantissa, so its two probe runs differ by ~0.03 at 8K positions
    (measured on SmolLM2) with an exact re-rotation; a wrong base or RoPE type still gives O(1)."""
    return max(SELF_CHECK_RTOL, 8 * torch.finfo(dtype).eps) if dtype.is_floating_point else SELF_CHECK_RTOL


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rerotate(keys: torch.Tensor, delta: int | torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate ``keys[..., n, head_dim]`` by ``delta`` positions (an int, or one delta per token [n]).

    ``inv_freq``: ``[head_dim/2]`` for one layer, or ``[L, head_dim/2]`` when ``keys`` is ``[L, H, n, d]``
    (models whose layers use different RoPE bases, e.g. Gemma 3).
    """
    if isinstance(delta, int) and delta == 0:
        return keys
    inv = inv_freq.to(device=keys.device, dtype=torch.float64)
    d = torch.as_tensor(delta, device=keys.device, dtype=torch.float64)
    if inv.dim() == 1:
        angle = d[..., None] * inv if d.dim() else d * inv  # [n, d/2] or [d/2]
    else:  # per layer: [L, 1, (n,) d/2] broadcasts over heads
        angle = (d[..., None] * inv[:, None, :] if d.dim() else d * inv)[:, None]
    angle = torch.cat((angle, angle), dim=-1)
    cos, sin = angle.cos().to(torch.float32), angle.sin().to(torch.float32)
    if inv.dim() == 2 and d.dim() == 0:
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]  # [L, 1, 1, d]
    k = keys.to(torch.float32)
    return (k * cos + rotate_half(k) * sin).to(keys.dtype)


def rope_table(inv_freq: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin ``[m, head_dim]`` (float32) of ``positions [m]`` under one layer's RoPE (``inv_freq [head_dim/2]``),
    angles in float64 as `rerotate` computes them: ``x * cos + rotate_half(x) * sin`` rotates ``x`` to them."""
    inv = inv_freq.to(torch.float64)
    angle = positions.to(inv.device, torch.float64)[:, None] * inv[None]
    angle = torch.cat((angle, angle), dim=-1)
    return angle.cos().to(torch.float32), angle.sin().to(torch.float32)


def inv_freq_table(adapter) -> torch.Tensor:
    """[L, head_dim/2] float64: the inverse frequencies of every layer."""
    return torch.stack([adapter.inv_freq(layer) for layer in range(adapter.num_layers)])


@torch.no_grad()
def self_check(model, adapter, probe_ids: torch.Tensor, delta: int | None = None) -> float:
    """Run a short probe at positions ``0..n-1`` and at ``delta..delta+n-1`` through the real model;
    re-rotate the first run's keys (every layer) by ``delta`` and compare with the second run's.

    RoPE attention is translation invariant, so the two must agree up to float rounding. Returns the
    max relative error; raises `PositionRecoveryError` above `self_check_rtol` of the model's dtype.
    """
    from .cache import StitchCache

    n = probe_ids.numel()
    if delta is None:
        delta = max(1, min(adapter.max_positions, 8192) - n - 1)
    dev = next(model.parameters()).device
    kv = []
    for start in (0, delta):
        cache = StitchCache.empty(adapter, capacity=n, device=dev, dtype=next(model.parameters()).dtype)
        pos = torch.arange(start, start + n, device=dev)
        with cache.mode(slots=torch.arange(n, device=dev)):
            model(input_ids=probe_ids.view(1, -1).to(dev), position_ids=pos.view(1, -1), **cache_kwargs(model, cache),
                  use_cache=True, logits_to_keep=1)
        kv.append(cache.stacked_keys())
    moved = rerotate(kv[0], delta, inv_freq_table(adapter))
    err = (moved.float() - kv[1].float()).abs().max().item() / kv[1].float().abs().max().clamp_min(1e-6).item()
    rtol = self_check_rtol(next(model.parameters()).dtype)
    if not err <= rtol:  # also catches NaN
        raise PositionRecoveryError(
            f"RoPE re-rotation self-check failed: relative error {err:.3g} > {rtol:g} at delta {delta} "
            f"({adapter.family}); refusing to stitch caches")
    return err
