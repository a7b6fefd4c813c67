"""EPIC/LegoLink: the head tokens of every chunk, the budget spread evenly (remainder to the earliest)."""

import pytest
import torch

from kvstitch.core.prompt import PromptLayout
from kvstitch.select import SelectionContext, make_selector


def _ctx(lengths, budget, prefix=3, suffix=2, precompute="isolated"):
    """Default: chunks precomputed in isolation (the paper's setting: every chunk gets its share)."""
    layout = PromptLayout(torch.arange(prefix), [torch.arange(n) + 100 for n in lengths], torch.arange(suffix))
    return SelectionContext(engine=None, cache=None, layout=layout, budget=budget, precompute=precompute)


def _per_chunk(idx, lengths):
    bounds = torch.tensor(lengths).cumsum(0)
    return torch.bincount(torch.bucketize(idx, bounds, right=True), minlength=len(lengths)).tolist()


@pytest.mark.parametrize("lengths, budget, expected", [
    # 7 over 3 chunks: 3 + 2 + 2, the remainder to the first chunk
    ([5, 3, 6], 7, [0, 1, 2, 5, 6, 8, 9]),
    # chunk 1 has only 2 tokens (< its share of 3): its unused share goes to the earliest chunk with room
    ([6, 2, 6], 9, [0, 1, 2, 3, 6, 7, 8, 9, 10]),
    # evenly: 2 per chunk
    ([4, 4, 4], 6, [0, 1, 4, 5, 8, 9]),
    # fewer tokens than chunks: one head token each for the earliest chunks
    ([4, 4, 4], 2, [0, 4]),
])
def test_epic_picks_chunk_heads(lengths, budget, expected):
    idx, scores = make_selector("epic").select(_ctx(lengths, budget))
    assert idx.tolist() == expected
    # the Table 3 value function: -(distance to the chunk start)
    assert scores[:lengths[0]].tolist() == [-float(i) for i in range(lengths[0])]


@pytest.mark.parametrize("budget", [1, 5, 10, 11, 23, 39])
def test_epic_budget_spread_evenly(budget):
    lengths = [10, 10, 10, 10]
    idx, _ = make_selector("epic").select(_ctx(lengths, budget))
    assert idx.numel() == budget and torch.equal(idx, idx.unique(sorted=True))
    counts = _per_chunk(idx, lengths)
    base, rem = divmod(budget, 4)
    assert counts == [base + (i < rem) for i in range(4)]
    # each chunk's selection is a prefix of the chunk
    start = 0
    for n, c in zip(lengths, counts):
        assert idx[(idx >= start) & (idx < start + n)].tolist() == list(range(start, start + c))
        start += n


def test_epic_short_chunks_redistribute():
    lengths = [2, 12, 1, 12]
    idx, _ = make_selector("epic").select(_ctx(lengths, 20))
    assert _per_chunk(idx, lengths) == [2, 9, 1, 8]  # 5 each, 4 + 3 unused move to chunks 1 and 3


def test_epic_skip_first_chunk():
    lengths = [5, 3, 6]
    idx, _ = make_selector("epic", skip_first_chunk=True).select(_ctx(lengths, 7))
    assert _per_chunk(idx, lengths) == [0, 3, 4]
    idx, _ = make_selector("epic", skip_first_chunk=True).select(_ctx(lengths, 11))
    assert _per_chunk(idx, lengths) == [2, 3, 6]  # later chunks exhausted: back to chunk 0's head


def test_epic_gives_the_first_chunk_nothing_under_a_shared_prefix():
    lengths = [10, 10, 10, 10]
    ctx = _ctx(lengths, 12, precompute="shared_prefix")
    idx, _ = make_selector("epic").select(ctx)
    assert _per_chunk(idx, lengths) == [0, 4, 4, 4]  # the whole budget on the chunks that need it
    assert ctx.stats["epic_skip_first_chunk"] is True and idx.numel() == 12
    iso = _ctx(lengths, 12, precompute="isolated")
    assert _per_chunk(make_selector("epic").select(iso)[0], lengths) == [3, 3, 3, 3]
    assert iso.stats["epic_skip_first_chunk"] is False
    forced = _ctx(lengths, 12, precompute="shared_prefix")
    assert _per_chunk(make_selector("epic", skip_first_chunk=False).select(forced)[0], lengths) == [3, 3, 3, 3]
    # the other chunks exhausted: the rest falls back to chunk 0 (the budget stays exact)
    idx, _ = make_selector("epic").select(_ctx([4, 3, 2], 7, precompute="shared_prefix"))
    assert _per_chunk(idx, [4, 3, 2]) == [2, 3, 2]
