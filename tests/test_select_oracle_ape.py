"""oracle (full-prefill reference scores, overlap ratio) and APE (temperature / scale, no recompute)."""

import math

import pytest
import torch

from kvstitch.core.attention import ATTN_IMPL, _ape_attention
from kvstitch.select import make_selector
from kvstitch.tasks.metrics import overlap_ratio  # the one definition (empty reference set: NaN)

from .conftest import SAMPLE_CHUNKS, SAMPLE_QUESTION, make_tiny_engine
from .test_select_prophet import eager_suffix_attention, make_ctx, stitched_kv


# ---- oracle -----------------------------------------------------------------------------------------
def _eager_full_prefill(eng, layout):
    model = eng.model
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            out = model(input_ids=layout.ids[None], output_attentions=True, use_cache=False)
    finally:
        model.set_attn_implementation(ATTN_IMPL)
    return [a[0].float() for a in out.attentions]


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_oracle_attention_is_full_prefill_query_attention(arch, smollm_tokenizer):
    eng = make_tiny_engine(arch, smollm_tokenizer)
    ctx = make_ctx(eng)
    lay = ctx.layout
    c0, c1 = lay.context_start, lay.context_end
    att = _eager_full_prefill(eng, lay)  # [Hq, N, N] per layer
    ref = torch.stack([a[:, c1:, c0:c1].mean(1).mean(0) for a in att]).mean(0)
    got = make_selector("oracle").score(ctx)
    assert torch.allclose(got, ref, atol=1e-6, rtol=1e-4)
    # and the reuse (Stage-I) scores differ from it: the oracle really looked at exact K/V
    assert not torch.allclose(make_selector("prophet").score(make_ctx(eng)), ref, atol=1e-6)
    # overlap of prophet's selection with G at the same budget is a fraction in [0, 1]
    k = ctx.budget
    g = torch.topk(ref, k).indices
    s, _ = make_selector("prophet").select(make_ctx(eng))
    r = overlap_ratio(s, g)
    assert 0.0 <= r <= 1.0 and r == len(set(s.tolist()) & set(g.tolist())) / k


def test_oracle_ideal_is_eq5_as_in_appendix_f(smollm_tokenizer):
    eng = make_tiny_engine("llama", smollm_tokenizer)
    ctx = make_ctx(eng)
    lay = ctx.layout
    c0, c1, L = lay.context_start, lay.context_end, eng.adapter.num_layers
    full_att = _eager_full_prefill(eng, lay)
    reuse_att = eager_suffix_attention(eng, lay, stitched_kv(ctx))
    full_cache, _ = eng.full_prefill(lay)
    phi = torch.stack([a[:, c1:, c0:c1].mean(1).mean(0) for a in full_att]).mean(0)
    phi_r = torch.stack([a[:, :, c0:c1].mean(1).mean(0) for a in reuse_att]).mean(0)

    def v(cache):
        return torch.stack([cache.layers[i].values[0, :, c0:c1].permute(1, 0, 2).reshape(lay.n_context, -1)
                            for i in range(L)]).mean(0)
    ref = (phi[:, None] * v(full_cache) - phi_r[:, None] * v(ctx.cache)).norm(dim=-1)
    got = make_selector("oracle", mode="ideal").score(ctx)
    assert torch.allclose(got, ref, atol=1e-5, rtol=1e-3)
    # the registered name runs the same Eq. 5 scorer (what `kvstitch eval --methods oracle_ideal` runs)
    assert torch.equal(make_selector("oracle_ideal").score(ctx), got)


@pytest.mark.parametrize("mode", ["attention", "ideal"])
def test_oracle_scores_over_the_full_prefill_its_context_is_given(mode, smollm_tokenizer, monkeypatch):
    """A caller's full prefill reaches the oracle through the request's context (`SelectionContext.exact_cache`),
    never through state on the method object: the same scores, and the context is not prefilled again."""
    eng = make_tiny_engine("llama", smollm_tokenizer)
    oracle = make_selector("oracle", mode=mode)
    own = oracle.score(make_ctx(eng))
    ctx = make_ctx(eng)
    ctx.exact_cache, _ = eng.full_prefill(ctx.layout)
    calls = []
    real = eng.forward
    monkeypatch.setattr(eng, "forward", lambda cache, ids, *a, **k: (calls.append(len(ids)), real(cache, ids, *a, **k))[1])
    torch.testing.assert_close(oracle.score(ctx), own, rtol=1e-5, atol=1e-6)
    assert ctx.layout.context_end not in calls  # no second prefill of prefix + context
    assert oracle == make_selector("oracle", mode=mode) and not hasattr(oracle, "exact_cache")


# ---- APE --------------------------------------------------------------------------------------------
def _ape_block_reference(q, k, v, c0, c1, T, S, scaling, slots):
    """APE as three blocks merged by their LogSumExps (the reference implementation's structure):
    prefix and query blocks plain; context block softmax(s/T) with LSE T * LSE(s/T) scaled by S."""
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[-1])
    for h in range(q.shape[0]):
        for i, p in enumerate(slots.tolist()):
            s = (q[h, i] @ k[h].T) * scaling
            blocks = [(0, c0, 1.0, 1.0), (c0, c1, T, S), (c1, p + 1, 1.0, 1.0)]
            lses, outs = [], []
            for a, b, t, sc in blocks:
                x = s[a:b] / t
                lses.append(torch.logsumexp(x, 0) * t * sc)
                outs.append(torch.softmax(x, 0) @ v[h, a:b])
            w = torch.softmax(torch.stack(lses), 0)
            out[h, i] = sum(wi * oi for wi, oi in zip(w, outs))
    return out


def test_ape_attention_matches_block_form():
    g = torch.Generator().manual_seed(0)
    hq, hkv, n, d, nq = 4, 2, 30, 8, 3
    q = torch.randn(1, hq, nq, d, generator=g) * 2
    k = torch.randn(1, hkv, n, d, generator=g) * 2
    v = torch.randn(1, hkv, n, d, generator=g)
    slots = torch.arange(n - nq, n)
    c0, c1, T, S = 5, 22, 0.9, 0.8
    got = _ape_attention(q, k, v, slots, d ** -0.5, None, (T, S, c0, c1))[0]
    kr, vr = k[0].repeat_interleave(2, 0), v[0].repeat_interleave(2, 0)
    ref = _ape_block_reference(q[0], kr, vr, c0, c1, T, S, d ** -0.5, slots)
    assert torch.allclose(got, ref, atol=1e-5)
    plain = _ape_block_reference(q[0], kr, vr, c0, c1, 1.0, 1.0, d ** -0.5, slots)
    assert torch.allclose(_ape_attention(q, k, v, slots, d ** -0.5, None, (1.0, 1.0, c0, c1))[0], plain, atol=1e-5)
    assert (got - plain).abs().max() > 1e-3
    assert not math.isnan(got.sum().item())


@pytest.mark.parametrize("arch", ["llama", "gemma3", "mistral-window"])
def test_ape_with_unit_temperature_and_scale_equals_naive(arch, smollm_tokenizer):
    eng = make_tiny_engine(arch, smollm_tokenizer)
    naive = eng.generate(SAMPLE_QUESTION, SAMPLE_CHUNKS, method="naive", max_new_tokens=6)
    ape1 = eng.generate(SAMPLE_QUESTION, SAMPLE_CHUNKS, method="ape(temperature=1.0,scale=1.0)", recompute_ratio=0.5,
                        max_new_tokens=6)
    assert ape1.recomputed == []
    assert (naive.first_logits - ape1.first_logits).abs().max().item() < 1e-4
    assert naive.token_ids == ape1.token_ids
    ape = eng.generate(SAMPLE_QUESTION, SAMPLE_CHUNKS, method="ape", recompute_ratio=0.5, max_new_tokens=6)
    assert ape.recomputed == [] and ape.stats["recomputed_tokens"] == 0
    assert (naive.first_logits - ape.first_logits).abs().max().item() > 1e-3  # T = S = 0.9 really acts


def test_ape_plans_cover_suffix_and_decode(smollm_tokenizer):
    eng = make_tiny_engine("llama", smollm_tokenizer)
    ctx = make_ctx(eng, 0.5)
    sel = make_selector("ape")
    assert sel.zero_budget and sel.select(ctx)[0].numel() == 0
    want = (0.9, 0.9, ctx.layout.context_start, ctx.layout.context_end)
    assert sel.recompute_plan(ctx).ape == want
    assert sel.decode_plan(eng, ctx.cache, ctx.layout, {}).ape == want
