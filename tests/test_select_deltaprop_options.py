"""`deltaprop`'s options from the newest methods: qcfuse as its base (the probe over anchors), per-layer token choice
(``fusion="union"``) and limiting what the recomputed tokens attend to (``attend_top``)."""

from dataclasses import dataclass
from types import SimpleNamespace
from typing import ClassVar

import pytest
import torch

from kvstitch.core.attention import ForwardPlan, kvstitch_attention, scope_mask
from kvstitch.core.errors import BadMethodOption
from kvstitch.engine.batch import plain_plan
from kvstitch.engine.budget import AutoBudget
from kvstitch.engine.prefill import recompute_step
from kvstitch.select import DeltaProp, SelectionContext, Selector, make_selector
from kvstitch.select.deltaprop import DeltaCache, union_scores
from kvstitch.select.qcfuse import QCFuse

from .conftest import SAMPLE_CHUNKS, SAMPLE_QUESTION, make_tiny_engine


def _ctx(eng, budget, layout=None):
    layout = layout or eng.layout(SAMPLE_QUESTION, SAMPLE_CHUNKS)
    return SelectionContext(eng, eng.stitch(layout, eng.chunk_kvs(layout)), layout, budget)


# ---- base=qcfuse -----------------------------------------------------------------------------------------------
def test_deltaprop_over_qcfuse_selects_what_qcfuse_selects_and_corrects(smollm_tokenizer):
    eng = make_tiny_engine("llama", smollm_tokenizer)
    sel = make_selector("deltaprop(base=qcfuse, probe_stride=0)")
    assert sel.chunk_anchors() == QCFuse().chunk_anchors()  # the engine's precompute runs the anchor pass
    ctx = _ctx(eng, 20)
    idx, _ = sel.select(ctx)
    ref_ctx = _ctx(eng, 20)
    ref, _ = QCFuse().select(ref_ctx)
    assert torch.equal(idx, ref) and isinstance(ctx.cache, DeltaCache)
    assert ctx.stats["qcfuse_critical_layers"] == ref_ctx.stats["qcfuse_critical_layers"]
    # end to end: the correction moves the answer's logits away from a plain qcfuse recompute of the same tokens
    layout = eng.layout(SAMPLE_QUESTION, SAMPLE_CHUNKS)
    d = eng.prefill(layout, sel, 0.3)
    q = eng.prefill(layout, "qcfuse", 0.3)
    assert torch.equal(d.indices, q.indices) and "qcfuse_anchors" in d.stats
    assert not torch.allclose(d.logits[-1], q.logits[-1])


@pytest.mark.parametrize("base", ["prophet", "infoflow", "infoflow(weight=value)", "qcfuse"])
def test_layer_scores_fuse_to_the_base_score(base, smollm_tokenizer):
    eng = make_tiny_engine("llama", smollm_tokenizer)
    sel = make_selector(base)
    per_layer = sel.layer_scores(_ctx(eng, 10))
    assert len(per_layer) >= 1 and all(s.shape == (_ctx(eng, 10).n_context,) for s in per_layer.values())
    assert torch.allclose(torch.stack(list(per_layer.values())).mean(0), sel.score(_ctx(eng, 10)), atol=1e-7)


# ---- fusion="union" --------------------------------------------------------------------------------------------
@dataclass
class TwoLayers(Selector):
    """Two layers: layer 0 peaks hard on tokens 0..5, layer 1 softly on the last six tokens."""

    name: ClassVar[str] = "two_layers"

    def layer_scores(self, ctx):
        n = ctx.n_context
        a, b = torch.zeros(n), torch.zeros(n)
        a[:6] = torch.linspace(10.0, 5.0, 6)
        b[-6:] = torch.linspace(0.1, 0.2, 6)
        return {0: a, 1: b}

    def score(self, ctx):
        return torch.stack(list(self.layer_scores(ctx).values())).mean(0)


def test_union_takes_every_layers_top_tokens_where_the_mean_takes_one_layers(smollm_tokenizer):
    eng = make_tiny_engine("llama", smollm_tokenizer)
    picks = {}
    for fusion in ("mean", "union"):
        idx, _ = DeltaProp(base=TwoLayers(), probe_stride=0, fusion=fusion).select(_ctx(eng, 6))
        picks[fusion] = idx.tolist()
    n = _ctx(eng, 6).n_context
    assert picks["mean"] == [0, 1, 2, 3, 4, 5]  # the peaked layer decides the mean's top 6
    assert picks["union"] == [0, 1, 2, n - 3, n - 2, n - 1]  # each layer's top 3


def test_union_scores_rank_by_best_layer_rank_then_the_fused_score():
    a = torch.tensor([9.0, 8.0, 7.0, 0.0, 0.0, 0.0])
    b = torch.tensor([0.0, 0.0, 0.0, 0.3, 0.1, 0.2])
    fused = (a + b) / 2
    s = union_scores([a, b], fused)
    assert sorted(s.tolist()) == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    order = torch.sort(s, descending=True).indices.tolist()
    # rank 0 of both layers (0, then 3: the fused score breaks the tie), rank 1 (1, 5), rank 2 (2, 4)
    assert order == [0, 3, 1, 5, 2, 4]


def test_union_on_a_model_holds_each_layers_top_share_and_differs_from_the_mean(smollm_tokenizer):
    eng = make_tiny_engine("llama", smollm_tokenizer)
    budget = 24
    ctx = _ctx(eng, budget)
    per_layer = make_selector("prophet").layer_scores(ctx)
    idx, _ = DeltaProp(probe_stride=0, fusion="union").select(_ctx(eng, budget))
    share = budget // len(per_layer)
    for s in per_layer.values():
        top = torch.sort(s, descending=True, stable=True).indices[:share]
        assert set(top.tolist()) <= set(idx.tolist())
    plain, _ = DeltaProp(probe_stride=0).select(_ctx(eng, budget))
    assert not torch.equal(idx, plain)


def test_per_layer_scores_are_a_declared_hook_that_wrappers_forward():
    assert make_selector("prophet").has_layer_scores() and TwoLayers().has_layer_scores()
    assert not make_selector("random").has_layer_scores() and make_selector("random").layer_scores(None) is None
    assert make_selector("grouped(base=prophet)").has_layer_scores()
    assert make_selector("grouped(base=qcfuse)").has_layer_scores()
    assert not make_selector("grouped(base=random)").has_layer_scores()


def test_union_over_grouped_prophet_groups_the_union_of_prophets_layers(smollm_tokenizer):
    """``deltaprop(base=grouped(base=prophet), fusion=union)``: grouped's scores are prophet's per layer, so the
    union is built from them, and grouped's windows then pick from it; the request runs end to end."""
    from kvstitch.select.grouping import grouped_top_k

    eng = make_tiny_engine("llama", smollm_tokenizer)
    sel = make_selector("deltaprop(base=grouped(base=prophet,group_min=2),fusion=union,probe_stride=0)")
    budget = 24
    ctx = _ctx(eng, budget)
    idx, _ = sel.select(ctx)
    per_layer = make_selector("prophet").layer_scores(_ctx(eng, budget))
    fused = torch.stack(list(per_layer.values())).mean(0)
    want = grouped_top_k(union_scores(list(per_layer.values()), fused), budget, 8, 2)
    assert torch.equal(idx, want) and "grouping_dropped" in ctx.stats
    res = eng.generate(SAMPLE_QUESTION, SAMPLE_CHUNKS, method=sel, recompute_ratio=0.3, max_new_tokens=3)
    assert len(res.token_ids) == 3 and res.method == sel.label and res.stats["grouping_dropped"] >= 0


def test_union_over_a_wrapper_of_a_base_without_layer_scores_is_refused():
    with pytest.raises(BadMethodOption, match=r"needs a base with per-layer scores .*grouped\(base=random\)"):
        make_selector("deltaprop(base=grouped(base=random),fusion=union)")


# ---- attend_top ------------------------------------------------------------------------------------------------
def test_scope_mask_and_attention_follow_the_segments():
    """A query sees a key only where ``sees`` allows and causally; slots past the segment vector are free."""
    torch.manual_seed(0)
    segment = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3, 0, 0])  # prefix, three passages, suffix
    sees = torch.eye(4, dtype=torch.bool)
    sees[0, :] = sees[:, 0] = True
    sees[:, 3] = True  # passage 3 (segment 3) is a top passage... seen by the passages after it only (causal)
    sees[3, 1] = True
    q_slots = torch.tensor([2, 5, 6, 7, 9, 11])
    m = scope_mask((segment, sees), q_slots, 0, 12)
    assert m[0, :4].tolist() == [True, True, True, True] and not m[1, 2:4].any()  # 5 (segment 2) skips segment 1
    assert m[2, 2:4].all() and not m[2, 4:6].any()  # 6 (segment 3) sees segment 1, not 2
    assert m[4].all() and m[5].all() and m[:, 10:].all()  # the suffix and decoded slots are free
    hq, hkv, d, n = 4, 2, 8, 12
    q = torch.randn(1, hq, q_slots.numel(), d)
    k, v = torch.randn(1, hkv, n, d), torch.randn(1, hkv, n, d)
    plan = ForwardPlan(q_slots=q_slots, scope=(segment, sees), group_queries=2)
    out, _ = kvstitch_attention(SimpleNamespace(layer_idx=0), q, k, v, scaling=d ** -0.5, kvstitch_plan=plan)
    causal = torch.arange(n)[None, :] <= q_slots[:, None]
    kk, vv = k[0].repeat_interleave(2, 0), v[0].repeat_interleave(2, 0)
    s = (q[0] @ kk.transpose(1, 2) * d ** -0.5).masked_fill(~(causal & m), float("-inf"))
    want = (torch.softmax(s, -1) @ vv).transpose(0, 1)
    assert torch.allclose(out[0], want, atol=1e-5)
    assert not plain_plan(plan)  # a scoped pass is never packed with others


def _recomputed_kv(eng, sel, perturb=None, budget=30):
    """The cache after ``sel``'s selection and recompute pass; ``perturb``: a chunk whose stitched K/V are
    disturbed first (base random: the selection does not read them)."""
    ctx = _ctx(eng, budget)
    lay = ctx.layout
    if perturb is not None:
        a = lay.chunk_starts[perturb]
        b = a + lay.chunk_ids[perturb].numel()
        g = torch.Generator().manual_seed(5)
        for layer in ctx.cache.layers:
            layer.keys[:, :, a:b] += torch.randn(layer.keys[:, :, a:b].shape, generator=g)
            layer.values[:, :, a:b] += torch.randn(layer.values[:, :, a:b].shape, generator=g)
    idx, _ = sel.select(ctx)
    plan = sel.recompute_plan(ctx)
    step = recompute_step(ctx.cache, ctx.layout, idx, plan)
    eng.forward(step.cache, step.ids, step.slots, step.plan)
    return ctx, idx, plan


def test_a_recomputed_token_ignores_passages_outside_its_scope(smollm_tokenizer):
    """attend_top=1: the recomputed tokens of every passage but the perturbed one (not the top one) keep the K/V
    they get without the perturbation; a plain recompute (attend_top none) carries it to them."""
    eng = make_tiny_engine("llama", smollm_tokenizer)
    for attend_top in (1, None):
        sel = make_selector("deltaprop(base=random(seed=4), probe_stride=0)", attend_top=attend_top)
        clean, idx, plan = _recomputed_kv(eng, sel)
        lay = clean.layout
        if attend_top is not None:
            top = clean.stats["attend_top_chunks"]
            assert len(top) == 1 and plan.scope is not None
        else:
            top = [0]
            assert plan is None
        e = next(c for c in range(len(lay.chunk_ids)) if c not in top)
        dirty, idx2, _ = _recomputed_kv(eng, sel, perturb=e)
        assert torch.equal(idx, idx2)
        chunk = lay.chunk_index()
        later = idx[(chunk[idx] != e) & (chunk[idx] > e)] + lay.context_start  # recomputed after the perturbed one
        assert later.numel() > 0
        gap = max(float((a.keys[0, :, later] - b.keys[0, :, later]).abs().max())
                  for a, b in zip(clean.cache.layers[1:], dirty.cache.layers[1:]))
        if attend_top is not None:
            assert gap < 1e-5, gap
        else:
            assert gap > 1e-2, gap


def test_scope_of_the_recompute_pass(smollm_tokenizer):
    """The plan's mask: a recomputed context token sees the prefix, its passage and the top passages; the question
    sees every passage; ``attend_top=0`` is the own passage alone."""
    eng = make_tiny_engine("llama", smollm_tokenizer)
    for k in (0, 2):
        sel = make_selector("deltaprop", attend_top=k)
        ctx = _ctx(eng, 30)
        idx, _ = sel.select(ctx)
        plan = sel.recompute_plan(ctx)
        lay = ctx.layout
        top = ctx.stats["attend_top_chunks"]
        assert len(top) == k
        dc = ctx.cache
        want_top = torch.sort(dc.chunk_score, descending=True, stable=True).indices[:k].sort().values.tolist()
        assert top == want_top
        slots = torch.cat([idx + lay.context_start, torch.arange(lay.context_end, lay.n_total)])
        m = scope_mask(plan.scope, slots, 0, lay.n_total)
        chunk = lay.chunk_index()
        for row, i in zip(m[:idx.numel()], idx.tolist()):
            seen = row[lay.context_start:lay.context_end]
            assert row[:lay.context_start].all()
            assert torch.equal(seen, (chunk == chunk[i]) | torch.isin(chunk, torch.tensor(top, dtype=torch.long)))
        assert m[idx.numel():].all()


def test_a_conversations_system_segment_stays_in_every_scope(smollm_tokenizer):
    eng = make_tiny_engine("llama", smollm_tokenizer)
    layout = eng.builder.build_messages([{"role": "system", "content": "Answer briefly."},
                                         {"role": "user", "content": SAMPLE_QUESTION}], SAMPLE_CHUNKS)
    assert layout.pinned == 1
    sel = make_selector("deltaprop", attend_top=0)
    ctx = _ctx(eng, 20, layout)
    idx, _ = sel.select(ctx)
    plan = sel.recompute_plan(ctx)
    a, b = layout.chunk_starts[0], layout.chunk_starts[1]
    m = scope_mask(plan.scope, idx + layout.context_start, 0, layout.n_total)
    assert m[:, a:b].all()


@pytest.mark.parametrize("opts", [{"attend_top": 0}, {"attend_top": 1}])
def test_a_limited_scope_changes_attention_even_at_full_recompute(opts, smollm_tokenizer):
    """By design: at 100% the passages outside a token's scope are still hidden from it, so this is not full
    prefill; 0% recomputes the question alone, which sees everything: naive reuse."""
    eng = make_tiny_engine("qwen2", smollm_tokenizer)
    layout = eng.layout(SAMPLE_QUESTION, SAMPLE_CHUNKS)
    _, full = eng.full_prefill(layout)
    method = make_selector("deltaprop", **opts)
    at100 = eng.prefill(layout, method, 1.0)
    assert at100.indices.numel() == layout.n_context and len(at100.stats["attend_top_chunks"]) == opts["attend_top"]
    assert not torch.allclose(at100.logits[-1], full[-1], atol=1e-3)
    naive = eng.prefill(layout, "naive", 0.0).logits[-1]
    assert torch.equal(eng.prefill(layout, method, 0.0).logits[-1], naive)


def test_auto_rounds_keep_the_scope(smollm_tokenizer):
    eng = make_tiny_engine("llama", smollm_tokenizer)
    layout = eng.layout(SAMPLE_QUESTION, SAMPLE_CHUNKS)
    auto = AutoBudget(schedule=(0.1, 0.3), max_ratio=0.3, tol=0.0, min_context=0, probe_tokens=1)
    got = eng.prefill(layout, "deltaprop(attend_top=1)", auto, 1)
    fixed = eng.prefill(layout, "deltaprop(attend_top=1)", 0.3, 1)
    plain = eng.prefill(layout, "deltaprop", 0.3, 1)
    assert torch.equal(got.indices, fixed.indices)
    assert torch.allclose(got.logits[-1], fixed.logits[-1], atol=1e-4)
    assert not torch.allclose(fixed.logits[-1], plain.logits[-1], atol=1e-4)


# ---- validation ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("opts,says", [
    ({"fusion": "max"}, "fusion must be one of"),
    ({"fusion": "union", "base": "random"}, "needs a base with per-layer scores"),
    ({"fusion": "union", "base": "a3"}, "needs a base with per-layer scores"),
    ({"attend_top": -1}, "attend_top must be an integer >= 0"),
    ({"attend_top": "two"}, "attend_top must be"),
    ({"attend_top": 1.5}, "attend_top must be"),
])
def test_bad_options_are_typed_errors(opts, says):
    with pytest.raises(BadMethodOption, match=says):
        make_selector("deltaprop", **opts)


def test_the_options_parse_from_a_spec():
    sel = make_selector("deltaprop(base=qcfuse, fusion=union, attend_top=2)")
    assert sel == DeltaProp(base=QCFuse(), fusion="union", attend_top=2)
    assert make_selector(sel.spec) == sel


def test_a_scope_over_every_passage_is_no_scope(smollm_tokenizer):
    """attend_top >= the number of passages hides nothing: no scope is set, 100% recompute is full prefill and
    the pass is plain deltaprop's."""
    eng = make_tiny_engine("qwen2", smollm_tokenizer)
    layout = eng.layout(SAMPLE_QUESTION, SAMPLE_CHUNKS)
    _, full = eng.full_prefill(layout)
    method = make_selector("deltaprop", attend_top=len(SAMPLE_CHUNKS))
    assert torch.allclose(eng.prefill(layout, method, 1.0).logits[-1], full[-1], atol=1e-3)
    got = eng.prefill(layout, method, 0.3)
    assert "attend_top_chunks" not in got.stats
    assert torch.equal(got.logits[-1], eng.prefill(layout, "deltaprop", 0.3).logits[-1])
