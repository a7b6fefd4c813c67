"""CacheClip's grouping windows: sparse windows dropped, dense ones kept, exact budget afterwards."""

import pytest
import torch

from kvstitch.core.errors import InputError
from kvstitch.core.prompt import PromptLayout
from kvstitch.select import SelectionContext, make_selector, top_k_indices
from kvstitch.select.grouping import grouped_top_k, kept_windows, window_thresholds


def _mask(n, idx):
    m = torch.zeros(n, dtype=torch.bool)
    m[list(idx)] = True
    return m


def _window_counts(idx, n, size=8):
    return torch.bincount(idx // size, minlength=-(-n // size))


def test_window_with_four_selected_is_dropped_five_kept():
    sel = _mask(32, [0, 2, 3, 5, 7] + [8, 9, 12, 15] + [16, 17, 18, 19, 20, 21, 22, 23])
    assert kept_windows(sel).tolist() == [True, False, True, False]
    assert kept_windows(sel, group_size=8, group_min=4).tolist() == [True, True, True, False]


def test_trailing_short_window_threshold_scales():
    assert window_thresholds(20, 8, 5).tolist() == [5, 5, 3]  # ceil(5 * 4 / 8) for the last 4 tokens
    assert kept_windows(_mask(20, [16, 17])).tolist() == [False, False, False]
    assert kept_windows(_mask(20, [16, 17, 19])).tolist() == [False, False, True]


def test_grouped_top_k_drops_sparse_then_refills_exactly():
    n = 40
    scores = torch.zeros(n)
    scores[[0, 2, 4, 6, 7]] = 10.0  # window 0: 5 selected -> kept
    scores[[9, 10, 11, 12]] = 9.0  # window 1: 4 selected -> dropped
    scores[[33]] = 0.5  # window 4 is the best of the rest by mean score
    paper = grouped_top_k(scores, 9)  # the paper: the sparse window is dropped, nothing added
    assert paper.tolist() == [0, 2, 4, 6, 7]
    idx = grouped_top_k(scores, 9, refill=True)
    assert idx.numel() == 9
    # the kept window's 5 survive and the window is completed first (3 more), then the best-mean
    # window (window 1, mean 4.5) gets one token: its best (ties by position) -> 9
    assert idx.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 9]
    # plain top-k would have kept the sparse window's tokens
    assert top_k_indices(scores, 9).tolist() == [0, 2, 4, 6, 7, 9, 10, 11, 12]


def test_grouped_top_k_fills_whole_windows_when_everything_is_sparse():
    scores = torch.arange(64, dtype=torch.float32).flip(0)  # no structure: spread picks
    scores = scores[torch.randperm(64, generator=torch.Generator().manual_seed(1))]
    assert grouped_top_k(scores, 16, group_size=8, group_min=8).numel() <= 16
    idx = grouped_top_k(scores, 16, group_size=8, group_min=8, refill=True)  # only full windows survive
    counts = _window_counts(idx, 64)
    assert idx.numel() == 16
    assert sorted(counts.tolist())[-2:] == [8, 8] and int((counts > 0).sum()) == 2


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("budget", [1, 7, 13, 40, 99])
def test_grouped_exact_budget_and_at_most_one_sparse_window(seed, budget):
    n = 100
    scores = torch.rand(n, generator=torch.Generator().manual_seed(seed))
    paper = grouped_top_k(scores, budget)
    top = set(top_k_indices(scores, budget).tolist())
    assert set(paper.tolist()) <= top and paper.numel() <= budget
    counts = _window_counts(paper, n)
    assert bool((counts[counts > 0] >= window_thresholds(n, 8, 5)[counts > 0]).all())  # no sparse window left
    idx = grouped_top_k(scores, budget, refill=True)
    assert idx.numel() == budget and torch.equal(idx, idx.unique(sorted=True))
    assert int(idx.min()) >= 0 and int(idx.max()) < n
    counts = _window_counts(idx, n)
    thr = window_thresholds(n, 8, 5)
    sparse = (counts > 0) & (counts < thr)
    assert int(sparse.sum()) <= 1, "only the last refilled window may be partial"
    assert torch.equal(idx, grouped_top_k(scores, budget, refill=True))  # deterministic


def test_grouping_off_is_top_k():
    scores = torch.rand(50, generator=torch.Generator().manual_seed(0))
    assert torch.equal(grouped_top_k(scores, 12, group_min=1), top_k_indices(scores, 12))
    assert torch.equal(grouped_top_k(scores, 12, group_size=1), top_k_indices(scores, 12))
    assert grouped_top_k(scores, 0).numel() == 0
    assert torch.equal(grouped_top_k(scores, 50), torch.arange(50))


def test_grouped_wraps_any_scorer():
    layout = PromptLayout(torch.arange(3), [torch.arange(30), torch.arange(27)], torch.arange(2))
    ctx = SelectionContext(engine=None, cache=None, layout=layout, budget=20)
    idx, scores = make_selector("grouped", base="random", base_options={"seed": 3}).select(ctx)
    assert torch.equal(scores, make_selector("random", seed=3).score(ctx))
    assert torch.equal(idx, grouped_top_k(scores, 20))
    idx2, _ = make_selector("grouped", base="epic", group_size=4, group_min=3).select(ctx)
    assert idx2.numel() <= 20 and ctx.stats["grouping_dropped"] == 20 - idx2.numel()
    idx3, _ = make_selector("grouped", base="epic", group_size=4, group_min=3, refill=True).select(ctx)
    assert idx3.numel() == 20
    assert make_selector("grouped", base="naive").select(ctx)[0].numel() == 0
    for bad in ({"base": "grouped"}, {"base": "nope"}, {"base": "random", "base_options": {"bad": 1}}):
        with pytest.raises(InputError):
            make_selector("grouped", **bad)
