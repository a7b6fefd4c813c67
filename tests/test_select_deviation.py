"""CacheBlend (||dV||_2 at layer 1) and KVShare (attention received x ||dV||_1) against direct computations."""

import pytest
import torch

from kvstitch.core.attention import ForwardPlan
from kvstitch.select import SelectionContext, make_selector
from kvstitch.select import deviation

from .conftest import SAMPLE_CHUNKS, SAMPLE_QUESTION, make_tiny_engine

ARCHS = ["llama", "gemma3"]  # gemma3: layer 1 is a sliding-window layer (window 24 < context)


def _ctx(eng, ratio=0.25):
    layout = eng.layout(SAMPLE_QUESTION, SAMPLE_CHUNKS)
    cache = eng.stitch(layout, eng.chunk_kvs(layout))
    return SelectionContext(eng, cache, layout, round(ratio * layout.n_context))


def _reference_layer1_values(eng, layout):
    """Layer-1 V of a plain full forward, from the model's own modules: the decoder's hidden state after
    layer 0 -> layer 1's input norm -> v_proj (transformers' own SDPA attention, not kvstitch's)."""
    model = eng.model
    impl = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    try:
        with torch.no_grad():
            out = model(input_ids=layout.ids[None], output_hidden_states=True, use_cache=False)
    finally:
        model.set_attn_implementation(impl)
    layer = model.model.layers[1]
    h = layer.input_layernorm(out.hidden_states[1])  # hidden_states[1] = output of layer 0
    v = layer.self_attn.v_proj(h).view(1, h.shape[1], eng.adapter.num_kv_heads, eng.adapter.head_dim)
    return v[0].transpose(0, 1).float()  # [Hkv, n_total, d]


@pytest.mark.parametrize("arch", ARCHS)
def test_cacheblend_deviation_equals_direct_layer1_difference(arch, smollm_tokenizer):
    eng = make_tiny_engine(arch, smollm_tokenizer)
    ctx = _ctx(eng)
    lay = ctx.layout
    c0, c1 = lay.context_start, lay.context_end
    v_ref = _reference_layer1_values(eng, lay)[:, c0:c1]
    stitched = ctx.cache.layers[1].values[0, :, c0:c1].float()
    expected = (v_ref - stitched).pow(2).sum((0, 2)).sqrt()
    scores = make_selector("cacheblend").score(ctx)
    assert scores.shape == (lay.n_context,)
    torch.testing.assert_close(scores, expected, rtol=1e-4, atol=1e-4)
    # the mechanism: chunk 0 was precomputed right after the same prefix, so its V is already exact
    n0 = lay.chunk_ids[0].numel()
    assert scores[:n0].max() < 1e-3 * scores[n0:].max()
    assert scores[n0:].max() > 1e-2


@pytest.mark.parametrize("arch", ARCHS)
def test_kvshare_is_attention_received_times_l1_deviation(arch, smollm_tokenizer, monkeypatch):
    eng = make_tiny_engine(arch, smollm_tokenizer)
    ctx = _ctx(eng)
    lay = ctx.layout
    c0, c1 = lay.context_start, lay.context_end
    # direct: a full prefill with the layer-1 attention probabilities of every query
    probs = {}
    plan = ForwardPlan(attn_hook=lambda layer, p, v: probs.setdefault(layer, p.clone()), hook_layers={1})
    full, _ = eng.full_prefill(lay, plan=plan)
    phi = probs[1][:, :, c0:c1].sum(1).mean(0)  # sum over all input tokens n, mean over query heads
    dv = full.layers[1].values[0, :, c0:c1].float() - ctx.cache.layers[1].values[0, :, c0:c1].float()
    expected = phi * dv.abs().sum((0, 2))
    monkeypatch.setattr(deviation, "_BLOCK_BYTES", 20_000)  # blocks of a few queries + a ragged last one
    scores = make_selector("kvshare").score(ctx)
    torch.testing.assert_close(scores, expected, rtol=1e-4, atol=1e-5)
    # and the attention factor alone: column sums of the fresh layer-1 attention
    lp = deviation.low_layer_pass(ctx, include_suffix=True, with_queries=True)  # via SelectionContext.fresh_pass
    torch.testing.assert_close(deviation.attention_received(ctx, lp), phi, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("method", ["cacheblend", "kvshare"])
def test_scoring_pass_leaves_the_stitched_cache_bit_identical(method, smollm_tokenizer):
    eng = make_tiny_engine("gemma3", smollm_tokenizer)
    ctx = _ctx(eng)
    before = [(layer.keys.clone(), layer.values.clone(), layer.length) for layer in ctx.cache.layers]
    idx, _ = make_selector(method).select(ctx)
    assert idx.numel() == ctx.budget
    for (k, v, n), layer in zip(before, ctx.cache.layers):
        assert torch.equal(k, layer.keys) and torch.equal(v, layer.values) and n == layer.length
    assert ctx.cache.capture == set() and ctx.cache.captured == {}
    assert ctx.cache.slots is None and ctx.cache.write is True


def test_cacheblend_recompute_matches_generate(smollm_tokenizer):
    """The engine path (select on the stitched cache, then recompute) gives the same first logits."""
    eng = make_tiny_engine("llama", smollm_tokenizer)
    res = eng.generate(SAMPLE_QUESTION, SAMPLE_CHUNKS, method="cacheblend", recompute_ratio=0.3, max_new_tokens=1)
    ctx = _ctx(eng, 0.3)
    idx, _ = make_selector("cacheblend").select(ctx)
    assert res.recomputed == idx.tolist()
    logits = eng.recompute(ctx.cache, ctx.layout, idx)
    torch.testing.assert_close(logits[-1].cpu(), res.first_logits, rtol=1e-4, atol=1e-4)
