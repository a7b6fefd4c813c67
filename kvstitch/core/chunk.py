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

    anchor_scores / anchor_tag: QCFuse's anchor pass (`kvstitch.core.anchors`), when it ran for this chunk:
    ``[L, n_tokens]`` float32, per layer the most any head and token of an appended prompt attended to each
    chunk token; ``anchor_tag`` names the pass (its prompt and sinks). None / "": the entry has no anchors.
    """

    keys: torch.Tensor
    values: torch.Tensor
    token_ids: torch.Tensor  # [n_tokens] int64
    start: int
    fingerprint: str
    anchor_scores: torch.Tensor | None = None
    anchor_tag: str = ""

    def __post_init__(self) -> None:
        if self.keys.shape != self.values.shape or self.keys.dim() != 4:
            raise ValueError(f"ChunkKV keys/values must be [L, H, n, d] of one shape, got "
                             f"{tuple(self.keys.shape)} / {tuple(self.values.shape)}")
        if self.keys.shape[2] != self.token_ids.numel():
            raise ValueError(f"ChunkKV has {self.keys.shape[2]} K/V rows for {self.token_ids.numel()} tokens")
        if self.anchor_scores is not None:
            want = (self.keys.shape[0], self.keys.shape[2])
            if tuple(self.anchor_scores.shape) != want or not self.anchor_tag:
                raise ValueError(f"ChunkKV anchor scores must be [L, n] = {list(want)} with a tag, got "
                                 f"{tuple(self.anchor_scores.shape)} tagged {self.anchor_tag!r}")

    def has_anchors(self, tag: str) -> bool:
        """True when the anchor pass named ``tag`` ran for this chunk."""
        return self.anchor_scores is not None and self.anchor_tag == tag

    def with_anchors(self, scores: torch.Tensor, tag: str) -> "ChunkKV":
        """The same K/V (shared, not copied) carrying anchor scores ``scores`` [L, n] of the pass ``tag``."""
        return ChunkKV(self.keys, self.values, self.token_ids, self.start, self.fingerprint,
                       scores.detach().float().cpu().contiguous(), tag)

    @property
    def n_tokens(self) -> int:
        return int(self.token_ids.numel())

    @property
    def nbytes(self) -> int:
        extra = 0 if self.anchor_scores is None else self.anchor_scores.numel() * 4
        return self.keys.numel() * self.keys.element_size() * 2 + self.token_ids.numel() * 8 + extra

    def to(self, device=None, dtype=None) -> "ChunkKV":
        return ChunkKV(self.keys.to(device=device, dtype=dtype), self.values.to(device=device, dtype=dtype),
                       self.token_ids, self.start, self.fingerprint, self.anchor_scores, self.anchor_tag)
