"""One parametrised matrix over every registered selection method: adding a method needs no edit here."""

import pytest
import torch

import kvstitch
from kvstitch.select import SELECTORS, SelectionContext, make_selector

from .conftest import SAMPLE_CHUNKS, SAMPLE_QUESTION, TINY, make_tiny_engine

METHODS = kvstitch.methods()
# `full` prefills from scratch instead of selecting (the exactness tests cover it)
SELECTING = [m for m in METHODS if not SELECTORS[m].full_prefill]


def _ctx(eng, ratio):
    layout = eng.layout(SAMPLE_QUESTION, SAMPLE_CHUNKS)
    cache = eng.stitch(layout, eng.chunk_kvs(layout))
    return SelectionContext(eng, cache, layout, round(ratio * layout.n_context))


def _select(eng, name, ratio):
    sel = make_selector(name)
    ctx = _ctx(eng, ratio)
    idx, scores = sel.select(ctx)
    return sel, ctx, idx, scores


def test_registry_has_the_reference_methods():
    assert {"full", "naive", "random"} <= set(METHODS)


@pytest.mark.parametrize("name", SELECTING)
@pytest.mark.parametrize("ratio", [0.0, 0.1, 0.35, 1.0])
def test_budget_and_index_contract(name, ratio, smollm_tokenizer):
    eng = make_tiny_engine("llama", smollm_tokenizer)
    sel, ctx, idx, _ = _select(eng, name, ratio)
    n = ctx.n_context
    expected = 0 if name == "naive" or getattr(sel, "zero_budget", False) else ctx.budget
    assert idx.dtype == torch.long
    if getattr(sel, "exact_budget", True):
        assert idx.numel() == expected, f"{name} selected {idx.numel()} of budget {expected}"
    else:  # e.g. CacheClip's grouping drops sparse windows (the paper): at most the budget
        assert idx.numel() <= expected, f"{name} selected {idx.numel()} > budget {expected}"
    assert torch.equal(idx, idx.unique(sorted=True)), "indices must be sorted and unique"
    assert idx.numel() == 0 or (idx.min() >= 0 and idx.max() < n)
    if ratio == 1.0 and expected:
        assert torch.equal(idx, torch.arange(n))


@pytest.mark.parametrize("name", SELECTING)
def test_deterministic(name, smollm_tokenizer):
    eng = make_tiny_engine("llama", smollm_tokenizer)
    a = _select(eng, name, 0.3)[2]
    b = _select(eng, name, 0.3)[2]
    assert torch.equal(a, b)


@pytest.mark.parametrize("arch", TINY)
@pytest.mark.parametrize("name", METHODS)
def test_every_method_runs_on_every_architecture(name, arch, smollm_tokenizer):
    eng = make_tiny_engine(arch, smollm_tokenizer)
    res = eng.generate(SAMPLE_QUESTION, SAMPLE_CHUNKS, method=name, recompute_ratio=0.25, max_new_tokens=3)
    assert res.first_logits is not None and torch.isfinite(res.first_logits).all()
    assert res.ttft_s > 0 and len(res.token_ids) >= 1
