"""`ChunkKV`: one chunk's precomputed per-layer K/V, the unit the store keeps and the stitcher reuses."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ChunkKV:
    """Per-layer K/V of one chunk, computed with the shared prefix as context.

    keys/values: ``[num_layers, num_kv_heads, n_tokens, head_dim]``. Keys are *post-RoPE* at the
    precompute positions ``start .. start + n_tokens - 1`` (``start`` = shared-prefix length), which is
    what the position-recovery step re-rotates from.
    """

    keys: torch.Tensor
    values: torch.Tensor
    token_ids: torch.Tensor  # [n_tokens] int64
    start: int
    fingerprint: str

    def __post_init__(self) -> None:
        if self.keys.shape != self.values.shape or self.keys.dim() != 4:
            raise ValueError(f"ChunkKV keys/values must be [L, H, n, d] of one shape, got "
                             f"{tuple(self.keys.shape)} / {tuple(self.values.shape)}")
        if self.keys.shape[2] != self.token_ids.numel():
            raise ValueError(f"ChunkKV has {self.keys.shape[2]} K/V rows for {self.token_ids.numel()} tokens")

    @property
    def n_tokens(self) -> int:
        return int(self.token_ids.numel())

    @property
    def nbytes(self) -> int:
        return self.keys.numel() * self.keys.element_size() * 2 + self.token_ids.numel() * 8

    def to(self, device=None, dtype=None) -> "ChunkKV":
        return ChunkKV(self.keys.to(device=device, dtype=dtype), self.values.to(device=device, dtype=dtype),
                       self.token_ids, self.start, self.fingerprint)
