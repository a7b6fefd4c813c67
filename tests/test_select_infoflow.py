"""InfoFlow: band-layer attention norms under GLOBAL geometry (vs an eager reference), the HL-TP local pass,
and chunk reordering (permutation, most important chunk last, reported order, exactness of the reordered
prompt)."""

import pytest
import torch

from kvstitch.select import make_selector
from kvstitch.select.attention_scores import band_layers

from .conftest import SAMPLE_CHUNKS, SAMPLE_QUESTION, make_tiny_engine
from .test_select_prophet import eager_suffix_attention, make_ctx, reference_scores, stitched_kv


def test_band_scales_with_depth():
    assert band_layers(40, (0.55, 0.65)) == [22, 23, 24, 25]  # the paper's layers 22-25 of 40
    assert band_layers(30, (0.55, 0.65)) == [16, 17, 18, 19]  # SmolLM2
    assert band_layers(4, (0.55, 0.65)) == [2]
    assert band_layers(6, (0.55, 0.65)) == [3]
    assert band_layers(4, (1.0, 1.0)) == [3]


def test_layer_choice_absolute_when_the_model_has_layers_22_to_25():
    sel = make_selector("infoflow")
    assert sel.layer_choice(30) == ([22, 23, 24, 25], "absolute")  # SmolLM2-135M: the paper's layers
    assert sel.layer_choice(26) == ([22, 23, 24, 25], "absolute")
    assert sel.layer_choice(25) == (band_layers(25, (0.55, 0.65)), "depth_scaled")
    assert sel.layer_choice(18) == ([9, 10, 11], "depth_scaled")  # Gemma 3 270M
    assert make_selector("infoflow", layers=(1, 2)).layer_choice(30) == ([1, 2], "explicit")
    assert make_selector("infoflow", absolute_layers=()).layer_choice(30) == ([16, 17, 18, 19], "depth_scaled")


def test_infoflow_reports_its_layers(smollm_tokenizer):
    eng = make_tiny_engine("llama", smollm_tokenizer)  # 4 layers: depth-scaled
    res = eng.generate(SAMPLE_QUESTION, SAMPLE_CHUNKS, method="infoflow", recompute_ratio=0.2, max_new_tokens=1)
    assert res.stats["infoflow_layers"] == [2] and res.stats["infoflow_layer_rule"] == "depth_scaled"


def test_chunk_importance_rules():
    from kvstitch.core.errors import InputError
    from kvstitch.select.infoflow import chunk_importance

    local = [torch.tensor([0.5, 0.5, 0.5, 0.4]), torch.tensor([0.9, 0.0, 0.0, 0.0]), torch.tensor([0.1, 0.2])]
    # top-3 pooled: 0.9 (chunk 1), 0.5, 0.5 (chunk 0) -> mass 1.0 vs 0.9
    assert chunk_importance(local, 3, "topk_mass").tolist() == pytest.approx([1.0, 0.9, 0.0])
    assert chunk_importance(local, 3, "max").tolist() == pytest.approx([0.5, 0.9, 0.2])
    with pytest.raises(InputError):
        chunk_importance(local, 3, "median")
    with pytest.raises(InputError):
        make_selector("infoflow_reorder", chunk_score="median")


def test_reorder_max_rule_orders_by_the_best_token(smollm_tokenizer):
    from kvstitch.select.infoflow import chunk_importance

    eng = make_tiny_engine("llama", smollm_tokenizer)
    ctx = make_ctx(eng, 0.2, chunks=REORDER_CHUNKS)
    sel = make_selector("infoflow_reorder_max")
    local = sel.local_scores(ctx, eng.chunk_kvs(ctx.layout))
    sel.select(ctx)
    imp = chunk_importance(local, ctx.budget, "max")
    assert ctx.stats["chunk_score"] == "max" and ctx.stats["chunk_importance"] == imp.tolist()
    assert ctx.stats["order"] == torch.sort(imp, stable=True).indices.tolist()


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_infoflow_scores_equal_eager_band_attention(arch, smollm_tokenizer):
    eng = make_tiny_engine(arch, smollm_tokenizer)
    ctx = make_ctx(eng)
    ref_att = eager_suffix_attention(eng, ctx.layout, stitched_kv(ctx))
    band = band_layers(eng.adapter.num_layers, (0.55, 0.65))
    got = make_selector("infoflow").score(make_ctx(eng))
    assert torch.allclose(got, reference_scores(ref_att, ctx.layout, band), atol=1e-6, rtol=1e-4)
    got = make_selector("infoflow", layers=(0, 3)).score(make_ctx(eng))
    assert torch.allclose(got, reference_scores(ref_att, ctx.layout, [0, 3]), atol=1e-6, rtol=1e-4)
    # weight="value": Σ_i A_ij ||v_j|| per KV head of each query head
    got = make_selector("infoflow", weight="value").score(make_ctx(eng))
    c0, c1 = ctx.layout.context_start, ctx.layout.context_end
    rep = eng.adapter.kv_groups
    ref = torch.stack([(ref_att[i][:, :, c0:c1].mean(1) * ctx.cache.layers[i].values[0, :, c0:c1].norm(dim=-1)
                        .repeat_interleave(rep, 0)).mean(0) for i in band]).mean(0)
    assert torch.allclose(got, ref, atol=1e-6, rtol=1e-4)


def test_local_pass_is_hl_tp_geometry(smollm_tokenizer):
    """First reorder round: each chunk alone at its precompute positions right after the prefix, the prompt
    at its GLOBAL positions (HL-TP) - reference: eager attention over [prefix, chunk] with RoPE positions of
    the suffix set to the global ones (no gap slots at all)."""
    eng = make_tiny_engine("llama", smollm_tokenizer)
    ctx = make_ctx(eng)
    sel = make_selector("infoflow_reorder")
    kvs = eng.chunk_kvs(ctx.layout)
    local = sel.local_scores(ctx, kvs)
    pk, pv = eng.prefix_kv(ctx.layout.prefix_ids)
    band = band_layers(eng.adapter.num_layers, sel.band)
    p = ctx.layout.n_prefix
    for kv, got in zip(kvs, local):
        assert kv.start == p and got.numel() == kv.n_tokens
        per_layer = [(torch.cat([pk[i], kv.keys[i]], 1)[None], torch.cat([pv[i], kv.values[i]], 1)[None])
                     for i in range(eng.adapter.num_layers)]
        att = eager_suffix_attention(eng, ctx.layout, per_layer)  # positions: global (tail prompt)
        ref = torch.stack([att[i][:, :, p:p + kv.n_tokens].mean(1).mean(0) for i in band]).mean(0)
        assert torch.allclose(got, ref, atol=1e-6, rtol=1e-4)
    # ...which is not the GLOBAL geometry
    glob = make_selector("infoflow").score(make_ctx(eng))
    assert not torch.allclose(torch.cat(local)[-kvs[-1].n_tokens:], glob[-kvs[-1].n_tokens:], atol=1e-6)


REORDER_CHUNKS = SAMPLE_CHUNKS + ["The river flooded twice in spring; the old mill lost its wheel.",
                                  "Carol's cat is called Pepper and it sleeps on the red sofa all day."]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_reorder_puts_most_important_chunk_last(arch, smollm_tokenizer):
    eng = make_tiny_engine(arch, smollm_tokenizer)
    ctx = make_ctx(eng, 0.2, chunks=REORDER_CHUNKS)
    original = ctx.layout
    sel = make_selector("infoflow_reorder")
    idx, _ = sel.select(ctx)
    order, imp = ctx.stats["order"], ctx.stats["chunk_importance"]
    assert sorted(order) == list(range(len(REORDER_CHUNKS)))  # a permutation
    assert order != list(range(len(REORDER_CHUNKS)))  # (this sample really gets reordered)
    assert imp[order[-1]] == max(imp)  # most important nearest the question
    assert [imp[i] for i in order] == sorted(imp)
    assert ctx.layout.order == order
    assert all(torch.equal(a, original.chunk_ids[i]) for a, i in zip(ctx.layout.chunk_ids, order))
    # the rebuilt cache is the stitched cache of the reordered prompt
    ref = eng.stitch(ctx.layout, eng.chunk_kvs(ctx.layout))
    for a, b in zip(ctx.cache.layers, ref.layers):
        assert torch.equal(a.keys[..., :ctx.layout.context_end, :], b.keys[..., :ctx.layout.context_end, :])
    # second round: GLOBAL geometry on the reordered prompt
    assert idx.numel() == ctx.budget
    ctx2 = make_ctx(eng, 0.2, chunks=[REORDER_CHUNKS[i] for i in order])
    assert torch.equal(idx, make_selector("infoflow").select(ctx2)[0])


def test_reorder_generate_reports_order_and_full_recompute_is_full_prefill_of_reordered(smollm_tokenizer):
    eng = make_tiny_engine("llama", smollm_tokenizer)
    res = eng.generate(SAMPLE_QUESTION, REORDER_CHUNKS, method="infoflow_reorder", recompute_ratio=1.0,
                       max_new_tokens=6)
    order = res.stats["order"]
    assert sorted(order) == list(range(len(REORDER_CHUNKS))) and order != sorted(order)
    full = eng.generate(SAMPLE_QUESTION, [REORDER_CHUNKS[i] for i in order], method="full", max_new_tokens=6)
    assert (full.first_logits - res.first_logits).abs().max().item() <= 1e-3
    assert full.token_ids == res.token_ids
    # ...and differs from full prefill of the original order (the reorder really changed the prompt)
    orig = eng.generate(SAMPLE_QUESTION, REORDER_CHUNKS, method="full", max_new_tokens=6)
    assert (orig.first_logits - res.first_logits).abs().max().item() > 1e-3
    part = eng.generate(SAMPLE_QUESTION, REORDER_CHUNKS, method="infoflow_reorder", recompute_ratio=0.2,
                        max_new_tokens=3)
    assert sorted(part.stats["order"]) == list(range(len(REORDER_CHUNKS)))  # (importance depends on the budget)
