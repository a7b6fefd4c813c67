"""ProphetKV: Stage-I scores against an independent eager-attention reference, Stage-I cost, no corruption of
Stage II, and a behavioural multi-key needle on SmolLM2 where naive reuse fails and prophet@20% does not."""

import pytest
import torch

from kvstitch.core.attention import ATTN_IMPL
from kvstitch.models import cache_kwargs
from kvstitch.select import SelectionContext, make_selector, top_k_indices
from kvstitch.select.attention_scores import group_mean, head_mean

from .conftest import SAMPLE_CHUNKS, SAMPLE_QUESTION, make_tiny_engine


# ---- shared helpers (imported by the other test_select_* modules) ---------------------------------------
def make_ctx(eng, ratio=0.3, question=SAMPLE_QUESTION, chunks=SAMPLE_CHUNKS):
    layout = eng.layout(question, chunks)
    cache = eng.stitch(layout, eng.chunk_kvs(layout))
    return SelectionContext(eng, cache, layout, round(ratio * layout.n_context))


def eager_suffix_attention(eng, layout, kv, positions=None):
    """Independent reference: Hugging Face's *eager* attention (output_attentions) for the suffix tokens over
    the per-layer K/V ``kv`` ([(k [1,H,n,d], v)] per layer, index == cache slot) in a DynamicCache.
    ``positions``: RoPE positions of the suffix (default: its global positions). -> per layer [Hq, |Q|, n+|Q|]."""
    from transformers import DynamicCache

    dc = DynamicCache()
    for i, (k, v) in enumerate(kv):
        dc.update(k.clone(), v.clone(), i)
    n = kv[0][0].shape[2]
    pos = torch.arange(layout.context_end, layout.n_total) if positions is None else positions
    model = eng.model
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            out = model(input_ids=layout.suffix_ids[None], position_ids=pos[None],
                        cache_position=torch.arange(n, n + layout.n_suffix), **cache_kwargs(model, dc),
                        use_cache=True, output_attentions=True)
    finally:
        model.set_attn_implementation(ATTN_IMPL)
    return [a[0].float() for a in out.attentions]


def stitched_kv(ctx):
    c1 = ctx.layout.context_end
    return [(layer.keys[:, :, :c1], layer.values[:, :, :c1]) for layer in ctx.cache.layers]


def reference_scores(att, layout, layers):
    """Mean over suffix tokens, then over query heads (equal KV groups), then over the given layers."""
    c0, c1 = layout.context_start, layout.context_end
    return torch.stack([att[i][:, :, c0:c1].mean(1).mean(0) for i in layers]).mean(0)


# ---- tests ----------------------------------------------------------------------------------------------
def test_group_mean_averages_per_kv_group():
    x = torch.arange(12.0).view(4, 3)  # 4 query heads, 2 KV heads: q heads 0,1 -> kv 0; 2,3 -> kv 1
    assert torch.equal(group_mean(x, 2), torch.stack([(x[0] + x[1]) / 2, (x[2] + x[3]) / 2]))
    assert torch.allclose(head_mean(x, 2), x.mean(0))


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_prophet_scores_equal_eager_stage1_attention(arch, smollm_tokenizer):
    eng = make_tiny_engine(arch, smollm_tokenizer)
    ctx = make_ctx(eng)
    ref_att = eager_suffix_attention(eng, ctx.layout, stitched_kv(ctx))
    ref = reference_scores(ref_att, ctx.layout, range(eng.adapter.num_layers))  # Eq. 7: uniform over ALL layers
    got = make_selector("prophet").score(make_ctx(eng))
    assert got.shape == (ctx.n_context,)
    assert torch.allclose(got, ref, atol=1e-6, rtol=1e-4), (got - ref).abs().max()
    # and not a single layer's attention (the fusion really spans the layers)
    assert not torch.allclose(got, reference_scores(ref_att, ctx.layout, [0]), atol=1e-6)
    idx, _ = make_selector("prophet").select(make_ctx(eng))
    assert torch.equal(idx, top_k_indices(ref, ctx.budget)) or len(set(idx.tolist()) ^ set(
        top_k_indices(ref, ctx.budget).tolist())) <= 2  # ties at float noise only


def test_prophet_stage1_hooks_every_layer_with_only_query_rows(smollm_tokenizer, monkeypatch):
    eng = make_tiny_engine("llama", smollm_tokenizer)
    ctx = make_ctx(eng)
    calls, seen = [], []
    real = eng.forward

    def spy(cache, ids, slots, plan=None, **kw):
        calls.append(ids.numel())
        hook = plan.attn_hook

        def wrapped(layer, probs, values):
            seen.append((layer, tuple(probs.shape)))
            hook(layer, probs, values)
        plan.attn_hook = wrapped
        return real(cache, ids, slots, plan, **kw)

    monkeypatch.setattr(eng, "forward", spy)
    make_selector("prophet").score(ctx)
    q, n, hq = ctx.layout.n_suffix, ctx.layout.n_total, eng.adapter.num_q_heads
    assert calls == [q]  # one pass of the |Q| query tokens
    assert seen == [(i, (hq, q, n)) for i in range(eng.adapter.num_layers)]  # O(|Q| N) per layer


def test_stage1_does_not_corrupt_stage2(smollm_tokenizer):
    eng = make_tiny_engine("qwen2", smollm_tokenizer)
    res = eng.generate(SAMPLE_QUESTION, SAMPLE_CHUNKS, method="prophet", recompute_ratio=0.3, max_new_tokens=4)
    assert len(res.recomputed) == round(0.3 * res.stats["context_tokens"])
    # the same selection recomputed on a fresh stitched cache that never saw Stage I
    ctx = make_ctx(eng)
    logits = eng.recompute(ctx.cache, ctx.layout, torch.tensor(res.recomputed))
    assert torch.equal(logits[-1].cpu(), res.first_logits)
    # Stage I leaves every context slot of the stitched cache bit-identical
    ctx2 = make_ctx(eng)
    before = [layer.keys[0, :, :ctx2.layout.context_end].clone() for layer in ctx2.cache.layers]
    make_selector("prophet").score(ctx2)
    for b, layer in zip(before, ctx2.cache.layers):
        assert torch.equal(b, layer.keys[0, :, :ctx2.layout.context_end])


# ---- behaviour on the real model ------------------------------------------------------------------------
# A fixed RULER-style multi-key needle (3 keys in 3 different chunks, 8 chunks of ~110 tokens of varied
# filler, ~1040 context tokens), found by an offline seed search for a sample where SmolLM2 answers
# correctly after full prefill and confidently wrong (the distractor) after naive reuse. Only the text
# is fixed here; the test recomputes every outcome.
NEEDLE_QUESTION = 'What is the special magic number for frozen-orchard mentioned in the provided text?'
NEEDLE_ANSWER = '5994048'
NEEDLE_DISTRACTORS = ['8564063', '1043814']
NEEDLE_CHUNKS = [
    ('A night train hosts a festival in autumn. Some visitors came from far away. An island lighthouse '
     'became famous for its apples. The mayor gave a short speech. One of the special magic numbers for '
     'bitter-falcon is: 1043814. The river ferry was painted bright green. Nobody expected that. The '
     'mountain road hired three new workers. Children loved the event. The wool factory kept detailed '
     'records for decades. Locals still talk about it. An island lighthouse closed early on Sundays. A new'
     ' road made travel easier. The wool factory was featured in a travel guide. It rained for most of the'
     ' week. The old mill became famous for its apples. The weather stayed mild.'),
    ('The weekly market hired three new workers. The mayor gave a short speech. An island lighthouse '
     'celebrated its hundredth year. Locals still talk about it. The public garden attracts visitors every'
     ' spring. A new road made travel easier. The public garden moved to a larger building. Locals still '
     'talk about it. A night train needed new windows last year. Nobody expected that. The wool factory '
     'became famous for its apples. Children loved the event. The copper mine was painted bright green. '
     'Prices went up slightly. The school choir was rebuilt after the storm. The weather stayed mild.'),
    ('The weekly market hosts a festival in autumn. A new road made travel easier. One of the special '
     'magic numbers for frozen-orchard is: 5994048. The public garden celebrated its hundredth year. It '
     'rained for most of the week. The mountain road closed early on Sundays. Children loved the event. '
     'The weekly market kept detailed records for decades. Some visitors came from far away. The public '
     'garden sells fresh bread at dawn. Nobody expected that. A desert observatory celebrated its '
     'hundredth year. Prices went up slightly. The wool factory hired three new workers. The mayor gave a '
     'short speech. An island lighthouse was rebuilt after the storm. Some visitors came from far away.'),
    ('The weekly market moved to a larger building. Some visitors came from far away. A small orchard '
     'hired three new workers. A new road made travel easier. The city museum hosts a festival in autumn. '
     'Children loved the event. The river ferry celebrated its hundredth year. Prices went up slightly. '
     'Our village bakery moved to a larger building. Children loved the event. The school choir hosts a '
     'festival in autumn. Prices went up slightly. The city museum was featured in a travel guide. A new '
     'road made travel easier. The mountain road moved to a larger building. Children loved the event.'),
    ('The school choir kept detailed records for decades. The local newspaper covered the story. Our '
     'village bakery opened a small library. The mayor gave a short speech. The mountain road sells fresh '
     'bread at dawn. Nobody expected that. The city museum sells fresh bread at dawn. It rained for most '
     'of the week. The old mill hired three new workers. Tickets sold out quickly. A desert observatory '
     'attracts visitors every spring. A new road made travel easier. The river ferry was rebuilt after the'
     ' storm. The weather stayed mild. The mountain road was featured in a travel guide. A new road made '
     'travel easier.'),
    ('The school choir closed early on Sundays. Prices went up slightly. The city museum kept detailed '
     'records for decades. Locals still talk about it. Our village bakery moved to a larger building. '
     'Locals still talk about it. The weekly market sells fresh bread at dawn. Children loved the event. A'
     ' quiet harbor needed new windows last year. Tickets sold out quickly. The mountain road was painted '
     'bright green. The local newspaper covered the story. A desert observatory kept detailed records for '
     'decades. The mayor gave a short speech. The river ferry repaired its wooden bridge. It rained for '
     'most of the week.'),
    ('A desert observatory repaired its wooden bridge. Nobody expected that. One of the special magic '
     'numbers for golden-violin is: 8564063. The public garden was rebuilt after the storm. Prices went up'
     ' slightly. Our village bakery hired three new workers. Locals still talk about it. Our village '
     'bakery needed new windows last year. Children loved the event. The old mill closed early on Sundays.'
     ' The local newspaper covered the story. An island lighthouse closed early on Sundays. Locals still '
     'talk about it. The wool factory was painted bright green. Prices went up slightly. The old mill '
     'opened a small library. The local newspaper covered the story.'),
    ('An island lighthouse moved to a larger building. Some visitors came from far away. A quiet harbor '
     'became famous for its apples. Prices went up slightly. The weekly market sells fresh bread at dawn. '
     'The weather stayed mild. The weekly market sells fresh bread at dawn. Some visitors came from far '
     'away. The public garden attracts visitors every spring. Some visitors came from far away. The copper'
     ' mine kept detailed records for decades. Tickets sold out quickly. The river ferry was featured in a'
     ' travel guide. The weather stayed mild. A quiet harbor celebrated its hundredth year. Children loved'
     ' the event.'),
]


@pytest.mark.long  # ~25 s on 2 cores: run by .ci/run after the quick set
def test_prophet_recovers_multikey_needle_where_naive_fails(smollm):
    def ask(method, ratio=0.0):
        return smollm.generate(NEEDLE_QUESTION, NEEDLE_CHUNKS, method=method, recompute_ratio=ratio,
                               max_new_tokens=26).text

    full = ask("full")
    assert NEEDLE_ANSWER in full, full  # the model can answer it
    naive = ask("naive")
    assert NEEDLE_ANSWER not in naive, naive  # plain reuse loses it...
    assert any(d in naive for d in NEEDLE_DISTRACTORS), naive  # ...to a distractor key's number
    prophet = ask("prophet", 0.2)
    assert NEEDLE_ANSWER in prophet, prophet
