"""A3: the score is the question's attention at exactly layer 1 with the ACTUAL layer-1 Q/K (the whole input
through block 0, Eq. 3-5); `a3_stitched` hooks layer 1 over the stitched keys; the SnapKV-style eviction
keeps the prefix and the question and exactly `evict_capacity` context tokens per layer and KV head, and the
masked keys are really gone for the decode steps."""

import pytest
import torch

from kvstitch.core.attention import ForwardPlan
from kvstitch.select import make_selector

from .conftest import SAMPLE_CHUNKS, SAMPLE_QUESTION, make_tiny_engine
from .test_select_prophet import eager_suffix_attention, make_ctx, reference_scores, stitched_kv


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_a3_stitched_scores_are_exactly_layer_1_over_stitched_keys(arch, smollm_tokenizer, monkeypatch):
    eng = make_tiny_engine(arch, smollm_tokenizer)
    ctx = make_ctx(eng)
    ref_att = eager_suffix_attention(eng, ctx.layout, stitched_kv(ctx))
    plans, results = [], []
    real = eng.forward

    def spy(cache, ids, slots, plan=None, **kw):
        plans.append((plan.hook_layers, plan.stop_after_layer))
        out = real(cache, ids, slots, plan, **kw)
        results.append(out)
        return out

    monkeypatch.setattr(eng, "forward", spy)
    got = make_selector("a3_stitched").score(ctx)
    assert plans == [({1}, 1)] and results == [None]  # hooked at layer 1 only, stopped right after it
    assert torch.allclose(got, reference_scores(ref_att, ctx.layout, [1]), atol=1e-6, rtol=1e-4)
    for other in (0, 2):
        assert not torch.allclose(got, reference_scores(ref_att, ctx.layout, [other]), atol=1e-6)
    monkeypatch.undo()
    got2 = make_selector("a3_stitched", layer=2).score(make_ctx(eng))
    assert torch.allclose(got2, reference_scores(ref_att, ctx.layout, [2]), atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_a3_scores_with_the_actual_layer1_keys_of_a_direct_block0_pass(arch, smollm_tokenizer, monkeypatch):
    """A3 Eq. 3: the keys A3 scores against equal the layer-1 keys of a direct full prefill (block 0 over the
    whole prompt), and its scores equal that prefill's layer-1 suffix-to-context attention."""
    eng = make_tiny_engine(arch, smollm_tokenizer)
    ctx = make_ctx(eng)
    lay = ctx.layout
    before = [(layer.keys.clone(), layer.values.clone()) for layer in ctx.cache.layers]
    sel = make_selector("a3")
    layer, q, keys = sel.actual_qk(ctx)
    probs = {}
    plan = ForwardPlan(attn_hook=lambda i, p, v: probs.setdefault(i, p.clone()), hook_layers={1})
    full, _ = eng.full_prefill(lay, plan=plan)
    assert layer == 1 and q.shape[1] == lay.n_suffix
    torch.testing.assert_close(keys, full.layers[1].keys[0, :, :lay.n_total], rtol=1e-4, atol=1e-5)
    # the stitched layer-1 keys of the later chunks differ (they miss block 0's cross-chunk attention)
    stitched = ctx.cache.layers[1].keys[0, :, lay.chunk_starts[1]:lay.context_end]
    assert not torch.allclose(stitched, keys[:, lay.chunk_starts[1]:lay.context_end], atol=1e-3)
    c0, c1 = lay.context_start, lay.context_end
    att = probs[1][:, c1:, c0:c1].mean(1)  # [Hq, n_context]
    nkv = eng.adapter.num_kv_heads
    expected = att.view(nkv, -1, att.shape[-1]).mean(1).mean(0)
    calls = []
    real = eng.forward
    monkeypatch.setattr(eng, "forward", lambda *a, **kw: calls.append(a[3]) or real(*a, **kw))
    got = sel.score(ctx)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6)
    assert len(calls) == 1 and calls[0].stop_at_attention_layer == 1  # one pass, layer-1 attention skipped
    assert ctx.stats["a3_block0_pass_s"] > 0
    for (k, v), layer_ in zip(before, ctx.cache.layers):  # out of place: the stitched cache is untouched
        assert torch.equal(k, layer_.keys) and torch.equal(v, layer_.values)
    assert not torch.allclose(got, make_selector("a3_stitched").score(make_ctx(eng)), atol=1e-6)


def _recomputed_ctx(eng, ratio=0.25):
    ctx = make_ctx(eng, ratio)
    idx, _ = make_selector("a3").select(ctx)
    eng.recompute(ctx.cache, ctx.layout, idx)
    return ctx


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_eviction_keeps_prefix_question_and_capacity_per_layer_and_head(arch, smollm_tokenizer):
    eng = make_tiny_engine(arch, smollm_tokenizer)
    ctx = _recomputed_ctx(eng)
    lay, cap = ctx.layout, 12
    keep = make_selector("a3", evict_capacity=cap).eviction_mask(eng, ctx.cache, lay)
    ad = eng.adapter
    assert keep.shape == (ad.num_layers, ad.num_kv_heads, lay.n_total)
    assert keep[:, :, :lay.context_start].all()  # the system prompt / shared prefix
    assert keep[:, :, lay.context_end:].all()  # the question
    per_head = keep[:, :, lay.context_start:lay.context_end].sum(-1)
    assert (per_head == cap).all(), per_head
    # per layer and per head: the kept sets are not all the same
    ctx_keep = keep[:, :, lay.context_start:lay.context_end].reshape(-1, lay.n_context)
    assert len({tuple(r.nonzero().flatten().tolist()) for r in ctx_keep}) > 1
    # capacity >= context: nothing evicted
    assert make_selector("a3", evict_capacity=10**6).eviction_mask(eng, ctx.cache, lay).all()


def test_masked_keys_are_really_evicted_for_decode(smollm_tokenizer):
    eng = make_tiny_engine("llama", smollm_tokenizer)
    ctx = _recomputed_ctx(eng)
    lay = ctx.layout
    keep = make_selector("a3", evict_capacity=10).eviction_mask(eng, ctx.cache, lay)
    tok = torch.tensor([lay.suffix_ids[-1].item()])
    pos = torch.tensor([lay.n_total])

    def step(cache, plan):
        c = type(cache)([type(layer)(layer.keys.clone(), layer.values.clone(), layer.length)
                         for layer in cache.layers])
        return eng.forward(c, tok, pos, plan)[-1], c

    masked, _ = step(ctx.cache, ForwardPlan(key_keep=keep))
    dense, _ = step(ctx.cache, ForwardPlan())
    assert (masked - dense).abs().max() > 1e-4  # eviction changes the decode step
    # overwrite every evicted K/V with garbage: the masked decode step does not notice
    trashed = type(ctx.cache)([type(layer)(layer.keys.clone(), layer.values.clone(), layer.length)
                               for layer in ctx.cache.layers])
    g = torch.Generator().manual_seed(0)
    for i, layer in enumerate(trashed.layers):
        gone = ~keep[i, :, :lay.n_total]  # [Hkv, n]
        noise = torch.randn(layer.keys[0, :, :lay.n_total].shape, generator=g) * 50
        layer.keys[0, :, :lay.n_total][gone] = noise[gone]
        layer.values[0, :, :lay.n_total][gone] = noise[gone]
    masked2, _ = step(trashed, ForwardPlan(key_keep=keep))
    assert torch.allclose(masked, masked2, atol=1e-5)


def test_generate_with_eviction(smollm_tokenizer):
    eng = make_tiny_engine("llama", smollm_tokenizer)
    base = eng.generate(SAMPLE_QUESTION, SAMPLE_CHUNKS, method="a3", recompute_ratio=0.2, max_new_tokens=6)
    ev = eng.generate(SAMPLE_QUESTION, SAMPLE_CHUNKS, method="a3(evict_capacity=8)", recompute_ratio=0.2,
                      max_new_tokens=6)
    assert torch.equal(base.first_logits, ev.first_logits)  # eviction happens after the first token
    assert ev.stats["evict_capacity"] == 8
    assert ev.stats["kv_kept_per_head"] == ev.stats["prefix_tokens"] + ev.stats["suffix_tokens"] + 8
    assert ev.recomputed == base.recomputed
