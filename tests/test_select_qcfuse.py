"""QCFuse: the anchor pass against an independent joint encoding (eager attention of the passage with the
repeat prompt appended), the probe attending only to prefix + anchors, the selection as the global top-k of the
critical-layer attention, anchors stored with the chunk (and added to a store written without them, its K/V
untouched), critical layers (explicit / profiled / depth-scaled) and their profiling."""

import math

import pytest
import torch

from kvstitch.core.attention import ATTN_IMPL
from kvstitch.core.errors import BadMethodOption, CorruptEntryError
from kvstitch.core.anchors import REPEAT_PROMPT, AnchorSpec
from kvstitch.models import loader
from kvstitch.select import SelectionContext, make_selector, top_k_indices
from kvstitch.select.critical import layer_recalls, profile_critical_layers
from kvstitch.select.qcfuse import QCFuse, anchor_indices, anchor_probe, depth_scaled_layers, probe_queries
from kvstitch.store import DiskStore, MemoryStore
from kvstitch.store import codec

from .conftest import SAMPLE_CHUNKS, SAMPLE_QUESTION, make_tiny_engine
from .test_store import key_of, make_kv


def _ctx(eng, sel, ratio=0.3):
    layout = eng.layout(SAMPLE_QUESTION, SAMPLE_CHUNKS)
    kvs = eng.chunk_kvs(layout, anchors=sel.chunk_anchors())
    return SelectionContext(eng, eng.stitch(layout, kvs), layout, round(ratio * layout.n_context), chunks=kvs), kvs


def _eager(eng, ids):
    """Independent reference: Hugging Face's eager attention over ``ids`` from position 0 -> per layer
    [Hq, T, T] probabilities."""
    model = eng.model
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            out = model(input_ids=ids[None], output_attentions=True)
    finally:
        model.set_attn_implementation(ATTN_IMPL)
    return [a[0].float() for a in out.attentions]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_anchors_are_the_tokens_the_repeat_prompt_attends_to_most(arch, smollm_tokenizer):
    eng = make_tiny_engine(arch, smollm_tokenizer)
    sel = QCFuse()
    layout = eng.layout(SAMPLE_QUESTION, SAMPLE_CHUNKS)
    kvs = eng.chunk_kvs(layout, anchors=sel.chunk_anchors())
    prompt = torch.tensor(smollm_tokenizer.encode(REPEAT_PROMPT, add_special_tokens=False))
    p = layout.n_prefix
    for chunk, kv in zip(layout.chunk_ids, kvs):
        n, m = chunk.numel(), prompt.numel()
        # the passage encoded after the prefix with the prompt appended, in one causal pass
        att = _eager(eng, torch.cat([layout.prefix_ids, chunk, prompt]))
        cols = torch.cat([torch.arange(4), torch.arange(p, p + n + m)])  # 4 prefix sinks, passage, prompt
        for layer, a in enumerate(att):
            rows = a[:, p + n:, cols]
            rows = rows / rows.sum(-1, keepdim=True)
            ref = rows[:, :, 4:4 + n].amax(dim=(0, 1))  # max over heads and prompt tokens
            err = (kv.anchor_scores[layer] - ref).abs().max()
            assert torch.allclose(kv.anchor_scores[layer], ref, atol=1e-5), (layer, err)
            got = anchor_indices(kv.anchor_scores[layer], sel.anchor_ratio, 4)
            want = anchor_indices(ref, sel.anchor_ratio, 4)
            k = math.ceil(n * sel.anchor_ratio)
            assert got.numel() == k and torch.equal(got[:min(4, k)], torch.arange(min(4, k)))
            assert len(set(got.tolist()) ^ set(want.tolist())) <= 2  # ties at float noise only


def test_anchor_ranking_keeps_the_sinks_then_the_best_within_the_share():
    s = torch.tensor([0.0, 0, 0, 0, 5, 1, 9, 2, 3, 4, 8, 7, 6] + [0.0] * 26 + [10.0])  # 40 tokens
    assert anchor_indices(s, 0.15, 4).tolist() == [0, 1, 2, 3, 6, 39]  # ceil(6): 4 sinks + the 2 best
    assert anchor_indices(s, 0.1, 4).tolist() == [0, 1, 2, 3]  # the sinks fill the share
    assert anchor_indices(s[:5], 0.1, 4).tolist() == [0]  # a short passage: ceil(0.5) = 1
    assert anchor_indices(s, 1.0, 0).numel() == 40


def test_probe_attends_only_to_the_prefix_the_anchors_and_itself(smollm_tokenizer):
    eng = make_tiny_engine("llama", smollm_tokenizer)
    sel = QCFuse(critical_layers=(2, 1))
    ctx, kvs = _ctx(eng, sel)
    keep = sel.anchor_keep(ctx, kvs)
    lay = ctx.layout
    for layer in range(ctx.num_layers):  # the prefix, ceil(10%) per passage (sinks first), the suffix
        ctx_keep = keep[layer, 0, lay.context_start:lay.context_end]
        assert int(ctx_keep.sum()) == sum(math.ceil(c.numel() * 0.1) for c in lay.chunk_ids)
        assert keep[layer, :, :lay.context_start].all() and keep[layer, :, lay.context_end:].all()
        for start, c in zip(lay.chunk_starts, lay.chunk_ids):
            assert keep[layer, 0, start]  # each passage's first token is a sink
    seen = {}
    from kvstitch.core.attention import ForwardPlan

    def hook(layer, probs, values):
        seen[layer] = probs
    plan = ForwardPlan(attn_hook=hook, stop_after_layer=2, key_keep=keep)
    eng.forward(ctx.cache, lay.suffix_ids, torch.arange(lay.context_end, lay.n_total), plan, write=False)
    for layer, probs in seen.items():  # no attention outside prefix + that layer's anchors + suffix
        assert float(probs[:, :, :lay.n_total][:, :, ~keep[layer, 0]].abs().max()) == 0.0
    # the compacted probe (anchors gathered) is the same attention as the masked one over the full cache
    compact = anchor_probe(ctx, keep, 2)
    ctx2, _ = _ctx(eng, sel)
    masked = probe_queries(ctx2, keep, 2)
    for layer in range(3):
        assert torch.allclose(compact[layer], masked[layer], atol=1e-4)
        c1, n = lay.context_end, lay.n_total
        assert torch.allclose(ctx.cache.layers[layer].keys[:, :, c1:n], ctx2.cache.layers[layer].keys[:, :, c1:n],
                              atol=1e-4)  # the suffix keys the selection reads
    # and it is not plain attention over the whole stitched cache
    full = probe_queries(_ctx(eng, sel)[0], None, 2)
    assert not torch.allclose(full[2], masked[2], atol=1e-4)


@pytest.mark.parametrize("reduce", ["max", "mean"])
def test_selection_is_the_global_top_k_of_the_critical_layer_attention(reduce, smollm_tokenizer):
    eng = make_tiny_engine("qwen3", smollm_tokenizer)
    sel = QCFuse(critical_layers=(1, 3), reduce=reduce)
    ctx, kvs = _ctx(eng, sel)
    lay = ctx.layout
    queries = anchor_probe(*_ctx(eng, sel)[:1], sel.anchor_keep(ctx, kvs), 3)
    # reference: each critical layer's softmax of the probe's queries over the whole stitched cache + suffix
    ref_ctx, _ = _ctx(eng, sel)
    anchor_probe(ref_ctx, sel.anchor_keep(ref_ctx, kvs), 3)  # writes the suffix keys, as score() does
    per = []
    for layer in (1, 3):
        k = ref_ctx.cache.layers[layer].keys[0, :, :lay.n_total].float()
        q = queries[layer].float()
        k = k.repeat_interleave(q.shape[0] // k.shape[0], 0)
        s = (q @ k.transpose(-1, -2)) * ctx.attention_scaling(layer)
        qpos = torch.arange(lay.context_end, lay.n_total)
        s = s.masked_fill(torch.arange(lay.n_total)[None, :] > qpos[:, None], float("-inf"))
        pr = torch.softmax(s, -1)[:, :, lay.context_start:lay.context_end]
        per.append(pr.amax(dim=(0, 1)) if reduce == "max" else pr.mean(dim=(0, 1)))
    ref = torch.stack(per).mean(0)
    got = sel.score(ctx)
    assert torch.allclose(got, ref, atol=1e-5)
    assert ctx.stats["qcfuse_critical_layers"] == [1, 3] and ctx.stats["qcfuse_layer_rule"] == "explicit"
    idx, _ = QCFuse(critical_layers=(1, 3), reduce=reduce).select(_ctx(eng, sel)[0])
    want = top_k_indices(ref, ctx.budget)  # one top-k over all passages, not a share of each
    assert len(set(idx.tolist()) ^ set(want.tolist())) <= 2
    assert idx.numel() == ctx.budget


def test_critical_layers_explicit_profiled_and_depth_scaled(smollm_tokenizer, monkeypatch):
    eng = make_tiny_engine("llama", smollm_tokenizer)  # 4 layers, never profiled
    ctx, _ = _ctx(eng, QCFuse())
    assert QCFuse().layer_choice(ctx) == ([1, 2, 3], "depth_scaled")
    assert QCFuse(critical_layers=(3, 0)).layer_choice(ctx) == ([3, 0], "explicit")
    with pytest.raises(BadMethodOption, match="within 0..3"):
        QCFuse(critical_layers=(4,)).layer_choice(ctx)
    monkeypatch.setitem(loader._GGUF_SHA256, "tiny", "tiny-llama")
    monkeypatch.setitem(loader.CRITICAL_LAYERS, "tiny", (2, 0, 3, 1))
    assert QCFuse().layer_choice(ctx) == ([2, 0, 3], "profiled")
    assert QCFuse(n_critical=1).layer_choice(ctx) == ([2], "profiled")
    assert depth_scaled_layers(24, 3) == [12, 13, 14] and depth_scaled_layers(2, 3) == [0, 1]


def test_the_embedded_models_have_profiled_critical_layers():
    for name, sha in loader._GGUF_SHA256.items():
        layers = loader.critical_layers("gguf:" + sha)
        assert layers is not None and len(layers) >= 3 and len(set(layers)) == len(layers), name
    assert loader.critical_layers("gguf:" + "0" * 64) is None and loader.embedded_name("dir:abc") is None


@pytest.mark.parametrize("bad", [dict(reduce="sum"), dict(anchor_ratio=0.0), dict(anchor_ratio=1.5),
                                 dict(n_critical=0), dict(n_sink=-1), dict(prompt="  "), dict(critical_layers=())])
def test_bad_options_are_refused(bad):
    with pytest.raises(BadMethodOption):
        make_selector("qcfuse", **bad)


def test_profiling_ranks_layers_by_recall_of_full_prefills_selection(smollm_tokenizer):
    eng = make_tiny_engine("llama", smollm_tokenizer)
    layout = eng.layout(SAMPLE_QUESTION, SAMPLE_CHUNKS)
    rec = layer_recalls(eng, layout, 0.3)
    assert rec.shape == (eng.adapter.num_layers,) and bool(((rec >= 0) & (rec <= 1)).all())
    got = profile_critical_layers(eng, [layout, eng.layout("Where does Bob live?", SAMPLE_CHUNKS)], 0.3)
    assert sorted(got["ranking"]) == list(range(4)) and got["samples"] == 2
    assert [got["recall"][i] for i in got["ranking"]] == sorted(got["recall"], reverse=True)
    # 100% of the context: every layer recovers the whole reference set
    assert bool((layer_recalls(eng, layout, 1.0) == 1).all())


# ---- anchors in the store ------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "int8"])
def test_adding_anchors_to_a_stored_entry_leaves_its_kv_bit_identical(tmp_path, dtype):
    s = DiskStore(tmp_path / "s", storage_dtype=dtype)
    kv, key = make_kv(), key_of(0, dtype)
    s.put(key, kv)
    before = s.get(key)
    assert before.anchor_scores is None and before.anchor_tag == ""  # written without anchors: says so
    scores = torch.rand(3, 16)
    assert s.add_anchors(key, scores, "repeat-max:x:sinks4")
    after = DiskStore(tmp_path / "s", storage_dtype=dtype).get(key)
    assert torch.equal(after.keys, before.keys) and torch.equal(after.values, before.values)
    assert torch.equal(after.anchor_scores, scores) and after.has_anchors("repeat-max:x:sinks4")
    assert s.add_anchors(key, scores * 2, "other")  # replaced, not appended
    again = s.get(key)
    assert torch.equal(again.anchor_scores, scores * 2) and again.anchor_tag == "other"
    assert torch.equal(again.keys, before.keys)
    assert not s.add_anchors(key_of(9, dtype), scores, "t")  # no such entry
    mem = MemoryStore(storage_dtype=dtype)
    mem.put(key, kv)
    assert mem.add_anchors(key, scores, "t") and torch.equal(mem.get(key).anchor_scores, scores)


def test_entry_with_anchors_roundtrips_and_damage_is_caught(tmp_path):
    kv = make_kv().with_anchors(torch.rand(3, 16), "t")
    s = DiskStore(tmp_path / "s")
    s.put(key_of(1), kv)
    got = s.get(key_of(1))
    assert torch.equal(got.anchor_scores, kv.anchor_scores) and got.anchor_tag == "t"
    blob = bytearray(b"".join(codec.encode(key_of(1), kv)))
    blob[-3] ^= 0x40  # a bit of the anchor scores (the last tensor)
    with pytest.raises(CorruptEntryError, match="checksum"):
        codec.decode(blob, key_of(1))
    with pytest.raises(CorruptEntryError, match="do not fit"):
        codec.splice_anchors(bytearray(b"".join(codec.encode(key_of(1), kv))), key_of(1), torch.rand(2, 16), "t")
    with pytest.raises(ValueError, match="anchor scores"):
        make_kv().with_anchors(torch.rand(3, 15), "t")


def test_store_written_without_anchors_gets_them_on_demand_kv_untouched(tmp_path, smollm_tokenizer):
    eng = make_tiny_engine("llama", smollm_tokenizer)
    store = DiskStore(tmp_path / "s", storage_dtype="float32")
    saved, eng.store = eng.store, store
    try:
        layout = eng.layout(SAMPLE_QUESTION, SAMPLE_CHUNKS)
        plain = eng.chunk_kvs(layout)  # another method's precompute: no anchors
        key = eng.chunk_key(layout.prefix_ids, layout.chunk_ids[0])
        assert store.get(key).anchor_scores is None
        stats = {}
        res = eng.generate(SAMPLE_QUESTION, SAMPLE_CHUNKS, method="qcfuse", recompute_ratio=0.3, max_new_tokens=2)
        assert res.stats["anchors_added"] == len(SAMPLE_CHUNKS) and res.stats["qcfuse_layer_rule"] == "depth_scaled"
        stored = store.get(key)
        assert stored.anchor_scores is not None and torch.equal(stored.keys.cpu(), plain[0].keys.cpu())
        eng.chunk_kvs(layout, stats, anchors=QCFuse().chunk_anchors())
        assert stats["anchors_added"] == 0  # kept: not computed again
        # precompute ahead of the questions runs the anchor pass with the chunks
        eng.store = DiskStore(tmp_path / "t", storage_dtype="float32")
        eng.precompute(SAMPLE_CHUNKS, progress=False, anchors=True)
        assert eng.store.get(key).has_anchors(AnchorSpec().tag(smollm_tokenizer))
        assert torch.equal(eng.store.get(key).anchor_scores, stored.anchor_scores)
    finally:
        eng.store = saved


def test_a_conversations_system_segment_is_kept_whole_in_the_probe(smollm_tokenizer):
    eng = make_tiny_engine("llama", smollm_tokenizer)
    layout = eng.layout(None, SAMPLE_CHUNKS, messages=[{"role": "system", "content": "Answer briefly and well."},
                                                       {"role": "user", "content": SAMPLE_QUESTION}])
    assert layout.pinned == 1
    sel = QCFuse()
    kvs = eng.chunk_kvs(layout, anchors=sel.chunk_anchors())
    ctx = SelectionContext(eng, eng.stitch(layout, kvs), layout, 10, chunks=kvs)
    keep = sel.anchor_keep(ctx, kvs)
    s0, n0 = layout.chunk_starts[0], layout.chunk_ids[0].numel()
    assert keep[:, :, s0:s0 + n0].all()
    s1, n1 = layout.chunk_starts[1], layout.chunk_ids[1].numel()
    assert int(keep[0, 0, s1:s1 + n1].sum()) == math.ceil(0.1 * n1)
    assert sel.select(ctx)[0].numel() == 10


def test_sliding_window_layers_are_no_critical_candidates(smollm_tokenizer):
    eng = make_tiny_engine("gemma3", smollm_tokenizer)  # global layers 2 and 5 of 6, the rest windowed
    ctx, _ = _ctx(eng, QCFuse())
    assert QCFuse().layer_choice(ctx) == ([2, 5], "depth_scaled")
    rec = layer_recalls(eng, ctx.layout, 0.3)
    assert [i for i in range(6) if not math.isnan(rec[i])] == [2, 5]
    assert sorted(profile_critical_layers(eng, [ctx.layout], 0.3)["ranking"]) == [2, 5]
