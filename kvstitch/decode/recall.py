"""Attention recall rate (PRKV Sec. 3.1, Eq. 3): the share of the dense attention mass that the
selected tokens cover, R_i = Σ_{j ∈ I_i} W_ij, per layer and query head.

`SparseDecoder` records it in diagnostic mode (``dec.diagnostic = True``), where every `attend` also
runs dense attention; the accessors below are what benches and reports read.
"""

from __future__ import annotations

import math

import torch


def attention_recall(dense_probs: torch.Tensor, tokens: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Eq. 3 for one step: ``dense_probs [Hkv, G, n]`` (dense attention of each query head), the selected
    storage indices ``tokens [Hkv, T]`` of each KV head (distinct where ``valid``) -> recall ``[Hq]``."""
    Hkv, G, n = dense_probs.shape
    idx = tokens.clamp(0, n - 1).unsqueeze(1).expand(Hkv, G, -1)
    covered = dense_probs.gather(2, idx) * valid.unsqueeze(1)
    return covered.sum(dim=-1).reshape(Hkv * G)


def oracle_recall(dense_probs: torch.Tensor, k: int, shared: bool = False) -> torch.Tensor:
    """Recall of the ground-truth top-k (Sec. 3.1: the best any k-token selection can do) -> ``[Hq]``.

    ``shared``: the best any selection shared by the query heads of a KV group can do (what a per-KV-head
    page choice, GQA, is bounded by): the top-k tokens of the group's summed attention, which maximise the
    group's mean recall."""
    Hkv, G, n = dense_probs.shape
    if not shared:
        return dense_probs.topk(min(k, n), dim=-1).values.sum(dim=-1).reshape(Hkv * G)
    idx = dense_probs.sum(dim=1).topk(min(k, n), dim=-1).indices.unsqueeze(1).expand(Hkv, G, -1)
    return dense_probs.gather(2, idx).sum(dim=-1).reshape(Hkv * G)


class RecallMeter:
    """Per-layer history of per-head recall (and of the ground-truth top-k recall with the same number of
    tokens: per query head, ``oracle``, and shared by each KV group, ``oracle_kv``), plus the largest
    sparse-vs-dense output difference."""

    def __init__(self, num_layers: int) -> None:
        self.history: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]
        self.oracle: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]
        self.oracle_kv: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]
        self.max_abs_err = 0.0

    def record(self, layer: int, recall: torch.Tensor, oracle: torch.Tensor, out_err: float,
               oracle_kv: torch.Tensor | None = None) -> None:
        self.history[layer].append(recall.detach().float().cpu())
        self.oracle[layer].append(oracle.detach().float().cpu())
        if oracle_kv is not None:
            self.oracle_kv[layer].append(oracle_kv.detach().float().cpu())
        self.max_abs_err = max(self.max_abs_err, out_err)

    def histories(self) -> tuple[list[list[torch.Tensor]], ...]:
        """Every per-layer history (recall, oracle, shared oracle)."""
        return self.history, self.oracle, self.oracle_kv

    def steps(self) -> torch.Tensor:
        """``[steps, layers, Hq]`` over the steps every layer recorded (empty if none)."""
        n = min((len(h) for h in self.history), default=0)
        if n == 0:
            return torch.empty(0, len(self.history), 0)
        return torch.stack([torch.stack(h[:n]) for h in self.history], dim=1)

    def per_layer(self) -> list[float]:
        """Mean recall of each layer over steps and heads (nan where nothing was recorded)."""
        return [torch.stack(h).mean().item() if h else math.nan for h in self.history]

    def mean(self, oracle: bool | str = False) -> float:
        """Mean recall; ``oracle=True``: of the per-query-head top-k, ``"kv"``: of the shared top-k."""
        hist = self.oracle_kv if oracle == "kv" else self.oracle if oracle else self.history
        values = [torch.stack(h) for h in hist if h]
        return torch.cat(values).mean().item() if values else math.nan

    def summary(self) -> dict:
        per_step = self.steps()
        return {
            "recall": self.mean(),
            "oracle_recall": self.mean(oracle=True),
            "oracle_recall_kv": self.mean(oracle="kv"),
            "recall_min": per_step.min().item() if per_step.numel() else math.nan,
            "recall_per_layer": self.per_layer(),
            "max_abs_err_vs_dense": self.max_abs_err,
        }


def decode_step_attention_recall(dec) -> torch.Tensor:
    """Recall of every recorded decode step of a `SparseDecoder`: ``[steps, layers, Hq]``."""
    return dec.recall.steps()


def recall_summary(dec) -> dict:
    """Mean / min / per-layer recall and the largest sparse-vs-dense output difference of a decoder."""
    return dec.recall.summary()
