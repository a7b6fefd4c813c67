"""`deltaprop` (kvstitch's own method): the correction measured on the recomputed tokens, spread to the stale ones."""

import pytest
import torch

from kvstitch.core.errors import BadMethodOption
from kvstitch.core.rope import rerotate, rope_table
from kvstitch.engine.budget import AutoBudget
from kvstitch.select import SelectionContext, make_selector
from kvstitch.select.deltaprop import DeltaCache

from .conftest import SAMPLE_CHUNKS, SAMPLE_QUESTION, make_tiny_engine


def _rope(eng, layout):
    """What `SelectionContext.context_rope` gives: cos / sin of the context positions under each layer's RoPE."""
    return lambda layer: rope_table(eng.inv_freq[layer], torch.arange(layout.context_start, layout.context_end))


def _setup(eng, **opts):
    layout = eng.layout(SAMPLE_QUESTION, SAMPLE_CHUNKS)
    cache = eng.stitch(layout, eng.chunk_kvs(layout))
    return layout, cache


def test_a_common_shift_of_a_chunk_is_carried_to_its_stale_tokens_exactly(smollm_tokenizer):
    """The mechanism: when every token of a chunk moved by the same vector (values; keys before RoPE), the
    shift measured on the recomputed tokens is what the stale ones get, keys rotated to their own positions."""
    eng = make_tiny_engine("llama", smollm_tokenizer)
    layout, cache = _setup(eng)
    dc = DeltaCache(cache, layout, _rope(eng, layout), alpha_v=1.0, alpha_k=1.0, tau=0.0, skip_first=0)
    c0, c1 = layout.context_start, layout.context_end
    chunk = layout.chunk_index()
    torch.manual_seed(1)
    H, d = cache.layers[0].keys.shape[1], cache.layers[0].keys.shape[3]
    shift_v = torch.randn(len(layout.chunk_ids), H, d)
    shift_k = torch.randn(len(layout.chunk_ids), H, d)
    slots = torch.arange(c0, c1)
    stitched_k, stitched_v = (x.clone() for x in dc.stitched[0])
    # the "fresh" K/V every context token would get: stitched + its chunk's shift (keys: in pre-RoPE space)
    want_v = stitched_v + shift_v[chunk].permute(1, 0, 2)
    want_k = stitched_k + rerotate(shift_k[chunk].permute(1, 0, 2).contiguous(), slots.double(), eng.inv_freq[0])
    sel = torch.tensor([i for i in range(c1 - c0) if i % 3 == 0])  # every chunk has recomputed tokens
    with dc.mode(slots=sel + c0):
        dc.update(want_k[None][:, :, sel], want_v[None][:, :, sel], 0)
    layer = cache.layers[0]  # the buffers are shared with the cache DeltaCache wraps
    assert torch.allclose(layer.values[0, :, c0:c1], want_v, atol=1e-5)
    assert torch.allclose(layer.keys[0, :, c0:c1], want_k, atol=1e-4)
    # and without the correction (alpha 0) the stale tokens keep their stitched K/V
    layout, cache = _setup(eng)
    dc = DeltaCache(cache, layout, _rope(eng, layout), alpha_v=0.0, alpha_k=0.0, tau=0.0, skip_first=0)
    with dc.mode(slots=sel + c0):
        dc.update(want_k[None][:, :, sel], want_v[None][:, :, sel], 0)
    stale = torch.tensor([i for i in range(c1 - c0) if i % 3])
    assert torch.equal(cache.layers[0].values[0, :, c0 + stale], stitched_v[:, stale])


def test_a_later_pass_leaves_tokens_an_earlier_pass_recomputed_as_they_were(smollm_tokenizer):
    """Auto's incremental rounds: tokens a finished pass recomputed stay fresh (never corrected again), the new
    pass's own tokens take their fresh K/V, and only the rest move, by the new pass's measured shift."""
    eng = make_tiny_engine("llama", smollm_tokenizer)
    layout, cache = _setup(eng)
    dc = DeltaCache(cache, layout, _rope(eng, layout), alpha_v=1.0, alpha_k=0.0, tau=0.0, skip_first=0)
    c0, c1 = layout.context_start, layout.context_end
    n, L = c1 - c0, len(cache.layers)
    stitched_v = dc.stitched[0][1].clone()

    def run_pass(sel, shift):  # every layer, as a recompute pass writes them, fresh values = stitched + shift
        with dc.mode(slots=sel + c0):
            for li in range(L):
                sk, sv = dc.stitched[li]
                dc.update(sk[None][:, :, sel], (sv[:, sel] + shift)[None], li)

    first = torch.arange(0, n, 4)
    run_pass(first, 1.0)
    after_first = cache.layers[0].values[0, :, c0:c1].clone()
    second = torch.arange(1, n, 4)
    run_pass(second, -2.0)
    values = cache.layers[0].values[0, :, c0:c1]
    rest = torch.ones(n, dtype=torch.bool)
    rest[first] = rest[second] = False
    assert torch.equal(values[:, first], after_first[:, first])  # the first pass's tokens: untouched
    assert torch.allclose(values[:, second], stitched_v[:, second] - 2.0, atol=1e-6)
    assert torch.allclose(values[:, rest], stitched_v[:, rest] - 2.0, atol=1e-5)  # corrected from stitched
    assert bool(dc.fresh[first].all() and dc.fresh[second].all()) and not bool(dc.fresh[rest].any())


def test_on_a_model_the_propagated_values_are_closer_to_full_prefill(smollm_tokenizer):
    """The property the method relies on, on a tiny model: the stale tokens' values after a deltaprop pass are
    closer to full prefill's than the stitched ones a plain recompute (prophet, same selection) leaves."""
    eng = make_tiny_engine("llama", smollm_tokenizer)
    layout = eng.layout(SAMPLE_QUESTION, SAMPLE_CHUNKS)
    full, _ = eng.full_prefill(layout)
    c0, c1 = layout.context_start, layout.context_end
    pre_d = eng.prefill(layout, "deltaprop(probe_stride=0)", 0.3)  # same selection
    pre_p = eng.prefill(layout, "prophet", 0.3)
    assert torch.equal(pre_d.indices, pre_p.indices)
    stale = torch.ones(c1 - c0, dtype=torch.bool)
    stale[pre_d.indices] = False
    stale[:layout.chunk_ids[0].numel()] = False  # the first chunk is exact (shared-prefix precompute)
    idx = stale.nonzero().flatten() + c0
    err_d = err_p = 0.0
    for li in range(1, eng.adapter.num_layers):  # layer 0's K/V depend on the token alone
        ref = full.layers[li].values[0, :, idx]
        err_d += float((pre_d.cache.layers[li].values[0, :, idx] - ref).pow(2).sum())
        err_p += float((pre_p.cache.layers[li].values[0, :, idx] - ref).pow(2).sum())
    assert err_d < 0.9 * err_p, (err_d, err_p)


@pytest.mark.parametrize("opts", [{"fit": "mean"}, {"fit": "linear"}, {"budget_unit": "work"}, {"probe_first": True},
                                  {"fusion": "union"}, {"base": "qcfuse"}, {"base": "qcfuse", "fusion": "union"}])
def test_full_ratio_is_full_prefill_and_zero_is_naive(smollm_tokenizer, opts):
    eng = make_tiny_engine("qwen2", smollm_tokenizer)
    layout = eng.layout(SAMPLE_QUESTION, SAMPLE_CHUNKS)
    _, full = eng.full_prefill(layout)
    method = make_selector("deltaprop", **opts)
    got = eng.prefill(layout, method, 1.0).logits[-1]
    assert torch.allclose(got, full[-1], atol=1e-3)
    naive = eng.prefill(layout, "naive", 0.0).logits[-1]
    assert torch.equal(eng.prefill(layout, method, 0.0).logits[-1], naive)
    # and at 20% the correction changes the answer's logits (it is not a no-op), the linear part and the work
    # budget's token set too
    at20 = eng.prefill(layout, method, 0.2).logits[-1]
    assert not torch.allclose(at20, eng.prefill(layout, "prophet", 0.2).logits[-1])
    if opts != {"fit": "mean"}:
        assert not torch.allclose(at20, eng.prefill(layout, "deltaprop", 0.2).logits[-1])


def test_auto_rounds_start_from_the_stitched_cache(smollm_tokenizer):
    """In ratio="auto" (refresh rounds) each round's cache is the fixed-ratio deltaprop cache at its budget."""
    eng = make_tiny_engine("llama", smollm_tokenizer)
    layout = eng.layout(SAMPLE_QUESTION, SAMPLE_CHUNKS)
    auto = AutoBudget(schedule=(0.1, 0.3), max_ratio=0.3, tol=0.0, min_context=0, probe_tokens=1)
    got = eng.prefill(layout, "deltaprop", auto, 1)
    fixed = eng.prefill(layout, "deltaprop", 0.3, 1)
    assert torch.equal(got.indices, fixed.indices)
    assert torch.allclose(got.logits[-1], fixed.logits[-1], atol=1e-4)


@pytest.mark.parametrize("opts", [{"base": "full"}, {"base": "ape"}, {"base": "nope"}, {"alpha_v": -1},
                                  {"tau": "x"}, {"skip_first": -2}, {"base": "deltaprop"},
                                  {"fit": "quadratic"}, {"ridge_v": -1.0}, {"ridge_k": "x"},
                                  {"budget_unit": "flops"}, {"probe_first": "yes"},
                                  {"probe_first": True, "probe_stride": 0}])
def test_bad_options_are_typed_errors(opts):
    with pytest.raises(BadMethodOption):
        make_selector("deltaprop", **opts)


def test_options_reach_the_base_and_the_cache(smollm_tokenizer):
    eng = make_tiny_engine("llama", smollm_tokenizer)
    layout, cache = _setup(eng)
    sel = make_selector("deltaprop", base="infoflow", tau=16.0, probe_stride=0)
    ctx = SelectionContext(eng, cache, layout, 10)
    idx, _ = sel.select(ctx)
    assert isinstance(ctx.cache, DeltaCache) and ctx.cache.tau == 16.0
    ref, _ = make_selector("infoflow").select(SelectionContext(eng, eng.stitch(layout, eng.chunk_kvs(layout)),
                                                               layout, 10))
    assert torch.equal(idx, ref)


def test_probes_are_recomputed_and_alone_measure_the_shift(smollm_tokenizer):
    """probe_stride: every k-th token of each chunk is in the selection (within the budget) and is the only
    source of the estimate; the rest of the budget is the base's ranking."""
    eng = make_tiny_engine("llama", smollm_tokenizer)
    layout, cache = _setup(eng)
    sel = make_selector("deltaprop", probe_stride=8)
    ctx = SelectionContext(eng, cache, layout, 20)
    idx, _ = sel.select(ctx)
    dc = ctx.cache
    probes = (dc.offset % 8 == 4).nonzero().flatten()
    assert idx.numel() == 20 and set(probes.tolist()) <= set(idx.tolist())
    assert torch.equal(dc.estimate_from.nonzero().flatten(), probes)


def test_probe_first_scores_over_the_corrected_cache(smollm_tokenizer):
    """probe_first: the probes are recomputed before the base scores, so the base (prophet: the question's
    attention) reads the probes' fresh K/V and the stale tokens' corrected ones; the budget still holds the probes
    and the base's top tokens over those scores."""
    eng = make_tiny_engine("llama", smollm_tokenizer)
    layout, cache = _setup(eng)
    sel = make_selector("deltaprop", probe_stride=8, probe_first=True)
    ctx = SelectionContext(eng, cache, layout, 20)
    sel.prepare(ctx)
    dc = ctx.cache
    scores = sel.score(ctx)
    probes = (dc.offset % 8 == 4).nonzero().flatten()
    assert torch.equal(dc.fresh.nonzero().flatten(), probes)  # the probe pass ran through every layer
    c0, c1 = layout.context_start, layout.context_end
    li = eng.adapter.num_layers - 1
    stale = torch.ones(c1 - c0, dtype=torch.bool)
    stale[probes] = False
    stale[:layout.chunk_ids[0].numel()] = False  # the first chunk measures no shift
    moved = (dc.layers[li].values[0, :, c0:c1] - dc.stitched[li][1]).abs().amax(dim=(0, 2))
    assert bool((moved[stale] > 0).all())  # every stale token of a later chunk was corrected
    # the scores are prophet's over that cache (the question's attention), not over the stitched one
    want = make_selector("prophet").score(ctx)
    assert torch.allclose(scores, want)
    plain = make_selector("prophet").score(SelectionContext(eng, eng.stitch(layout, eng.chunk_kvs(layout)), layout, 20))
    assert not torch.allclose(scores, plain)
    idx = sel.pick(scores.float(), ctx)
    assert idx.numel() == 20 and set(probes.tolist()) <= set(idx.tolist())


def test_linear_fit_recovers_a_shift_linear_in_the_stitched_vector(smollm_tokenizer):
    """fit="linear": when every token's shift is its chunk's common shift plus a linear function of its stitched
    vector (values; keys before RoPE), the stale tokens get exactly that shift. The chunk mean alone cannot."""
    eng = make_tiny_engine("llama", smollm_tokenizer)
    c0 = c1 = None
    got = {}
    for fit in ("mean", "linear"):
        layout, cache = _setup(eng)
        dc = DeltaCache(cache, layout, _rope(eng, layout), alpha_v=1.0, alpha_k=1.0, tau=0.0, skip_first=0, fit=fit,
                        ridge_v=0.0, ridge_k=0.0)
        c0, c1 = layout.context_start, layout.context_end
        chunk = layout.chunk_index()
        torch.manual_seed(2)
        H, d = cache.layers[0].keys.shape[1], cache.layers[0].keys.shape[3]
        common_v, common_k = torch.randn(len(layout.chunk_ids), H, d), torch.randn(len(layout.chunk_ids), H, d)
        W_v, W_k = 0.3 * torch.randn(H, d, d), 0.3 * torch.randn(H, d, d)
        slots = torch.arange(c0, c1)
        sk, sv = (x.clone() for x in dc.stitched[0])
        pre_k = rerotate(sk, -slots.double(), eng.inv_freq[0]).float()
        want_v = sv + common_v[chunk].permute(1, 0, 2) + sv @ W_v
        want_k = sk + rerotate((common_k[chunk].permute(1, 0, 2) + pre_k @ W_k).contiguous(), slots.double(),
                               eng.inv_freq[0])
        sel = torch.tensor([i for i in range(c1 - c0) if i % 2 == 0])  # more fitted tokens than head dims
        assert sel.numel() > d
        with dc.mode(slots=sel + c0):
            dc.update(want_k[None][:, :, sel], want_v[None][:, :, sel], 0)
        stale = torch.tensor([i for i in range(c1 - c0) if i % 2 and chunk[i] > 0])
        layer = cache.layers[0]
        got[fit] = ((layer.values[0, :, c0 + stale] - want_v[:, stale]).abs().max(),
                    (layer.keys[0, :, c0 + stale] - want_k[:, stale]).abs().max())
    assert got["linear"][0] < 1e-3 and got["linear"][1] < 1e-3
    assert got["mean"][0] > 0.1 and got["mean"][1] > 0.1


def test_spend_work_buys_cheaper_tokens_within_the_same_work():
    """budget_unit="work": the tokens of most score per unit of work, within the chosen set's total work."""
    from kvstitch.select.deltaprop import spend_work

    work = 100.0 + torch.arange(40, dtype=torch.float64)  # later tokens attend to more keys
    scores = torch.ones(40)
    scores[35] = 50.0  # a needle late in the context: worth its cost
    chosen = torch.tensor([30, 31, 32, 33, 35])  # what a top-k by score picked (ties went late)
    got = spend_work(scores, chosen, work)
    assert float(work[got].sum()) <= float(work[chosen].sum())
    assert 35 in got.tolist()  # the needle stays
    assert got.numel() > chosen.numel()  # the work of four late ties buys more early tokens
    assert got.tolist() == sorted(got.tolist()) and set(got.tolist()) - {35} == set(range(got.numel() - 1))
    scores[3] = float("inf")  # a probe: always first
    assert 3 in spend_work(scores, chosen, work).tolist()


def test_work_budget_on_a_model_spends_no_more_work_than_the_token_budget(smollm_tokenizer):
    eng = make_tiny_engine("llama", smollm_tokenizer)
    layout = eng.layout(SAMPLE_QUESTION, SAMPLE_CHUNKS)
    picks = {}
    for unit in ("tokens", "work"):
        sel = make_selector("deltaprop", budget_unit=unit)
        ctx = SelectionContext(engine=eng, cache=eng.stitch(layout, eng.chunk_kvs(layout)), layout=layout,
                               budget=int(0.2 * layout.n_context))
        picks[unit], _ = sel.select(ctx)
        assert sel.exact_budget == (unit == "tokens")
    work = ctx.token_work()
    assert work.shape == (layout.n_context,) and bool((work[1:] > work[:-1]).all())
    assert float(work[picks["work"]].sum()) <= float(work[picks["tokens"]].sum()) * (1 + 1e-9)
    assert picks["work"].numel() >= picks["tokens"].numel()
