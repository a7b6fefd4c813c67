"""Fidelity metrics with hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from kvstitch.tasks.metrics import answer_nll, kl_full_vs_method, nll_gap_recovery, overlap_ratio


def test_kl_of_identical_logits_is_zero():
    x = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    assert kl_full_vs_method(x, x.clone()) == pytest.approx(0.0, abs=1e-12)
    assert kl_full_vs_method(x, x + 3.0) == pytest.approx(0.0, abs=1e-12)  # logits are shift-invariant


def test_kl_matches_hand_computation_and_is_directional():
    p, q = torch.tensor([0.5, 0.5], dtype=torch.float64), torch.tensor([0.9, 0.1], dtype=torch.float64)
    expected = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)  # 0.5108
    assert kl_full_vs_method(p.log(), q.log()) == pytest.approx(expected, rel=1e-9)
    reverse = 0.9 * math.log(0.9 / 0.5) + 0.1 * math.log(0.1 / 0.5)  # 0.3681
    assert kl_full_vs_method(q.log(), p.log()) == pytest.approx(reverse, rel=1e-9)
    # mean over positions: one identical row, one differing row
    full = torch.stack([p.log(), p.log()])
    method = torch.stack([p.log(), q.log()])
    assert kl_full_vs_method(full, method) == pytest.approx(expected / 2, rel=1e-9)


def test_kl_rejects_mismatched_shapes():
    with pytest.raises(ValueError):
        kl_full_vs_method(torch.zeros(3, 10), torch.zeros(3, 11))


def test_answer_nll_known_values():
    V = 8
    onehot = torch.full((3, V), -100.0)
    targets = torch.tensor([1, 5, 7])
    onehot[torch.arange(3), targets] = 100.0
    assert answer_nll(onehot, targets) == pytest.approx(0.0, abs=1e-9)
    assert answer_nll(onehot, torch.tensor([0, 0, 0])) == pytest.approx(200.0, rel=1e-6)
    assert answer_nll(torch.zeros(4, V), torch.tensor([0, 1, 2, 3])) == pytest.approx(math.log(V))
    mixed = torch.stack([onehot[0], torch.zeros(V)])  # nll 0 and log V -> mean log(V)/2
    assert answer_nll(mixed, torch.tensor([1, 2])) == pytest.approx(math.log(V) / 2)
    with pytest.raises(ValueError):
        answer_nll(torch.zeros(2, V), torch.tensor([1, 2, 3]))


def test_nll_gap_recovery():
    assert nll_gap_recovery(3.0, 2.0, 1.0) == pytest.approx(0.5)
    assert nll_gap_recovery(3.0, 1.0, 1.0) == pytest.approx(1.0)
    assert nll_gap_recovery(3.0, 3.0, 1.0) == pytest.approx(0.0)
    assert nll_gap_recovery(3.0, 3.5, 1.0) == pytest.approx(-0.25)  # worse than naive reuse
    assert math.isnan(nll_gap_recovery(2.0, 1.5, 2.0))
    assert math.isnan(nll_gap_recovery(2.0, 1.5, 2.0 + 1e-7))


def test_overlap_ratio():
    assert overlap_ratio([1, 2, 3], [2, 3, 4, 5]) == 0.5
    assert overlap_ratio(torch.tensor([5, 9, 2]), torch.tensor([[2, 9]])) == 1.0
    assert overlap_ratio([], [1, 2]) == 0.0
    assert overlap_ratio([1, 1, 1], [1, 2, 3, 4]) == 0.25  # duplicates do not inflate coverage
    assert math.isnan(overlap_ratio([1], []))
