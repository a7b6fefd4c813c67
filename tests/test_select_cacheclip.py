"""CacheClip: auxiliary-model attention (last layer, question -> chunk), character-offset alignment across
tokenizers, grouping windows."""

import pytest
import torch
from transformers import AutoTokenizer

from kvstitch.core.attention import ForwardPlan
from kvstitch.models.loader import resolve_model
from kvstitch.core.prompt import PromptLayout
from kvstitch.select import SelectionContext, make_selector
from kvstitch.select import context as select_context
from kvstitch.core.errors import InputError
from kvstitch.select.cacheclip import align_scores, decode_spans, encode_with_spans, spans_of_ids
from kvstitch.select.grouping import grouped_top_k

from .conftest import SAMPLE_CHUNKS, SAMPLE_QUESTION, make_tiny_engine

TEXT = "\n\nCafé №7: price $12.50 — 3,141 items (naïve façade) in 東京 😀, x=3;y=-4.5e-3 [ok]!"


@pytest.fixture(scope="module")
def gemma_tokenizer():
    path, _ = resolve_model("gemma3")
    return AutoTokenizer.from_pretrained(str(path))


def _ctx(eng, ratio=0.3):
    layout = eng.layout(SAMPLE_QUESTION, SAMPLE_CHUNKS)
    cache = eng.stitch(layout, eng.chunk_kvs(layout))
    return SelectionContext(eng, cache, layout, round(ratio * layout.n_context))


def _brute_force_align(p_spans, a_spans, a_scores):
    """Character by character: max score of the aux tokens sharing a character, else the nearest one."""
    out = []
    for a, b in p_spans.tolist():
        hit = [k for k, (c, d) in enumerate(a_spans.tolist()) if max(a, c) < min(b, d)]
        if not hit:
            gaps = [max(c - b, a - d, 0) for c, d in a_spans.tolist()]
            hit = [gaps.index(min(gaps))]
        out.append(max(float(a_scores[k]) for k in hit))
    return torch.tensor(out)


# ---- alignment ----------------------------------------------------------------------------------
def test_align_scores_synthetic():
    p = torch.tensor([[0, 3], [3, 5], [5, 5], [5, 9], [12, 14]])
    a = torch.tensor([[0, 2], [2, 4], [4, 9], [9, 10]])
    s = torch.tensor([1.0, 5.0, 2.0, 7.0])
    assert align_scores(p, a, s, "max").tolist() == [5.0, 5.0, 2.0, 2.0, 7.0]  # [5,5) and [12,14): nearest
    assert align_scores(p, a, s, "mean").tolist() == [3.0, 3.5, 2.0, 2.0, 7.0]
    with pytest.raises(ValueError):
        align_scores(p, a, s, "median")


@pytest.mark.parametrize("which", ["smollm", "gemma"])
def test_character_spans_of_real_tokenizers(which, smollm_tokenizer, gemma_tokenizer):
    tok = smollm_tokenizer if which == "smollm" else gemma_tokenizer
    ids, spans = encode_with_spans(tok, TEXT)
    text, spans2 = spans_of_ids(tok, ids)  # decode -> re-encode with offsets reproduces the ids
    assert text == TEXT and torch.equal(spans, spans2)
    assert spans[0, 0] == 0 and spans[-1, 1] == len(TEXT)
    assert (spans[1:, 0] >= spans[:-1, 0]).all() and (spans[:, 1] >= spans[:, 0]).all()
    # every character is covered by some token
    covered = torch.zeros(len(TEXT), dtype=torch.bool)
    for a, b in spans.tolist():
        covered[a:b] = True
    assert covered.all()
    # a token whose decoded text is complete spans exactly that text
    for i, (a, b) in zip(ids, spans.tolist()):
        piece = tok.decode([i], clean_up_tokenization_spaces=False)
        if "\ufffd" not in piece:
            assert TEXT[a:b] == piece, (piece, TEXT[a:b])
    # the incremental-decode fallback agrees on plain ASCII text
    ascii_ids, ascii_spans = encode_with_spans(tok, "\n\nBob's number is 42, and 7 is lucky! (x=3)")
    assert torch.equal(decode_spans(tok, ascii_ids), ascii_spans)


def test_alignment_gemma_to_smollm(smollm_tokenizer, gemma_tokenizer):
    g_ids, g_spans = encode_with_spans(gemma_tokenizer, TEXT)
    s_ids, s_spans = encode_with_spans(smollm_tokenizer, TEXT)
    s_scores = torch.arange(len(s_ids), dtype=torch.float32)  # score = aux token index
    got = align_scores(g_spans, s_spans, s_scores)
    assert torch.equal(got, _brute_force_align(g_spans, s_spans, s_scores))

    def aux_text_of(gemma_piece):  # the SmolLM2 tokens a Gemma token maps to, by character overlap
        j = [gemma_tokenizer.decode([i]) for i in g_ids].index(gemma_piece)
        a, b = g_spans[j].tolist()
        return [k for k, (c, d) in enumerate(s_spans.tolist()) if max(a, c) < min(b, d)], j

    ks, j = aux_text_of(" 東京")  # one Gemma token, 5 byte-level SmolLM2 tokens (' 東' = 3, '京' = 2)
    assert len(ks) == 5 and got[j] == max(ks)
    ks, j = aux_text_of("ï")  # Gemma splits "naïve" as na|ï|ve, SmolLM2 as na|ïve
    assert smollm_tokenizer.decode([s_ids[k] for k in ks]) == "ïve" and got[j] == ks[0]
    for digit in "125":  # both split numbers into digits: one to one
        ks, j = aux_text_of(digit)
        assert smollm_tokenizer.decode([s_ids[k] for k in ks]) == digit


def test_layout_carries_the_question(smollm_tokenizer):
    eng = make_tiny_engine("llama", smollm_tokenizer)
    layout = eng.layout("  Where is Bob's house, exactly?  ", SAMPLE_CHUNKS)
    assert layout.question == "Where is Bob's house, exactly?"
    assert layout.reordered([1, 0, 2, 3]).question == layout.question


def test_cacheclip_raises_without_the_question(smollm_tokenizer):
    eng = make_tiny_engine("llama", smollm_tokenizer)
    ctx = _ctx(eng)
    lay = ctx.layout
    ctx.layout = PromptLayout(lay.prefix_ids, lay.chunk_ids, lay.suffix_ids)  # no question text
    with pytest.raises(InputError, match="question"):
        make_selector("cacheclip", aux_model="self").select(ctx)


def test_cacheclip_uses_the_layout_question_not_the_suffix(smollm_tokenizer):
    """An eval suffix carries RULER's answer prefix after the template: the auxiliary model must still read
    exactly the question (the scores equal those of a layout whose suffix is the plain template)."""
    eng = make_tiny_engine("llama", smollm_tokenizer)
    aux = make_tiny_engine("qwen3", smollm_tokenizer)
    plain = _ctx(eng)
    lay = plain.layout
    extra = torch.tensor(eng.tokenizer.encode("Answer: The special magic number is", add_special_tokens=False))
    noisy = PromptLayout(lay.prefix_ids, lay.chunk_ids, torch.cat([lay.suffix_ids, extra]), question=lay.question)
    ctx2 = SelectionContext(eng, eng.stitch(noisy, eng.chunk_kvs(noisy)), noisy, plain.budget)
    sel = make_selector("cacheclip", aux_engine=aux)
    torch.testing.assert_close(sel.score(ctx2), sel.score(plain))
    assert ctx2.stats["cacheclip_self_guided"] is False
    self_ctx = _ctx(eng)
    make_selector("cacheclip", aux_model="self").score(self_ctx)
    assert self_ctx.stats["cacheclip_self_guided"] is True


# ---- end to end on tiny models -------------------------------------------------------------------
def _reference_scores(aux, question, chunks):
    """Directly: per chunk, a full prefill of [aux prefix][chunk][aux suffix] with the last layer's
    attention; rows = suffix tokens, columns = chunk tokens; mean over rows, then over query heads."""
    lay = aux.builder.build(question, chunks)
    last = aux.adapter.num_layers - 1
    out = []
    for ids in lay.chunk_ids:
        one = PromptLayout(lay.prefix_ids, [ids], lay.suffix_ids)
        probs = {}
        plan = ForwardPlan(attn_hook=lambda layer, p, v: probs.setdefault(layer, p.clone()), hook_layers={last})
        aux.full_prefill(one, plan=plan)
        c0, c1 = one.context_start, one.context_end
        out.append(probs[last][:, c1:, c0:c1].mean(1).mean(0))
    return torch.cat(out)


@pytest.mark.parametrize("aux_arch", ["qwen3", "gemma3", "self"])
def test_cacheclip_scores_are_aux_last_layer_question_attention(aux_arch, smollm_tokenizer):
    eng = make_tiny_engine("llama", smollm_tokenizer)
    aux = eng if aux_arch == "self" else make_tiny_engine(aux_arch, smollm_tokenizer)
    sel = make_selector("cacheclip", aux_model="self") if aux_arch == "self" else \
        make_selector("cacheclip", aux_engine=aux)
    ctx = _ctx(eng)
    scores = sel.score(ctx)
    # same tokenizer on both sides: the alignment is the identity
    expected = _reference_scores(aux, SAMPLE_QUESTION, SAMPLE_CHUNKS)
    torch.testing.assert_close(scores, expected, rtol=1e-4, atol=1e-6)
    idx, s2 = sel.select(ctx)
    assert torch.equal(idx, grouped_top_k(scores, ctx.budget, 8, 5)) and torch.equal(s2, scores)
    assert idx.numel() <= ctx.budget and ctx.stats["grouping_dropped"] == ctx.budget - idx.numel()


def test_cacheclip_recomputes_fewer_tokens_by_default_refill_is_an_option(smollm_tokenizer):
    eng = make_tiny_engine("llama", smollm_tokenizer)
    aux = make_tiny_engine("qwen3", smollm_tokenizer)
    ctx = _ctx(eng, 0.2)
    idx, scores = make_selector("cacheclip", aux_engine=aux).select(ctx)
    # the paper: the top-k, minus the tokens of sparse windows (< 5 of 8 selected); nothing else added
    top = scores.argsort(descending=True, stable=True)[:ctx.budget]
    assert set(idx.tolist()) <= set(top.tolist())
    counts = torch.bincount(idx // 8)
    assert bool((counts[counts > 0] >= 5).all() or idx.numel() == 0)
    assert idx.numel() < ctx.budget  # random tiny-model attention: some windows are sparse
    full, _ = make_selector("cacheclip", aux_engine=aux, refill=True).select(ctx)
    assert full.numel() == ctx.budget and set(idx.tolist()) <= set(full.tolist())
    named = make_selector("cacheclip_refill", aux_engine=aux)  # the registered variant (for the eval)
    assert named.exact_budget and not make_selector("cacheclip").exact_budget
    assert torch.equal(named.select(ctx)[0], full)
    res = eng.generate(SAMPLE_QUESTION, SAMPLE_CHUNKS, method=make_selector("cacheclip", aux_engine=aux),
                       recompute_ratio=0.2, max_new_tokens=1)
    assert res.stats["recomputed_tokens"] == len(res.recomputed) == idx.numel()


def test_cacheclip_grouping_options(smollm_tokenizer):
    eng = make_tiny_engine("llama", smollm_tokenizer)
    aux = make_tiny_engine("qwen3", smollm_tokenizer)
    ctx = _ctx(eng, 0.2)
    plain, scores = make_selector("cacheclip", aux_engine=aux, group_min=1).select(ctx)
    assert plain.numel() == ctx.budget  # grouping off: the plain top-k
    assert torch.equal(plain, scores.argsort(descending=True, stable=True)[:ctx.budget].sort().values)
    grouped, _ = make_selector("cacheclip", aux_engine=aux, group_size=4, group_min=3).select(ctx)
    assert torch.equal(grouped, grouped_top_k(scores, ctx.budget, 4, 3))
    refilled, _ = make_selector("cacheclip", aux_engine=aux, group_size=4, group_min=3, refill=True).select(ctx)
    assert torch.equal(refilled, grouped_top_k(scores, ctx.budget, 4, 3, refill=True))


# ---- the default pair: Gemma 3 270M primary, SmolLM2-135M auxiliary -------------------------------
@pytest.mark.slow
def test_cacheclip_default_pair(gemma, smollm):
    # the default auxiliary model is the embedded SmolLM2, loaded once per process: reuse the fixture's
    key = (None, "cpu", "torch.float32")
    select_context._AUXILIARY.setdefault(key, smollm)
    sel = make_selector("cacheclip")
    ctx = _ctx(gemma, 0.2)
    assert sel._aux(ctx) is select_context._AUXILIARY[key]
    sel.aux_engine = smollm
    recorded = []
    aux_token_scores = sel.aux_token_scores
    sel.aux_token_scores = lambda *a: recorded.append(aux_token_scores(*a)) or recorded[-1]
    before = [(layer.keys.clone(), layer.values.clone()) for layer in ctx.cache.layers]
    idx, scores = sel.select(ctx)
    lay = ctx.layout
    assert idx.numel() <= ctx.budget == round(0.2 * lay.n_context)
    assert torch.equal(idx, grouped_top_k(scores, ctx.budget)) and torch.isfinite(scores).all()
    assert ctx.stats["cacheclip_self_guided"] is False and ctx.stats["cacheclip_aux"] == smollm.adapter.family
    # the glue: every Gemma token's score is the max over the SmolLM2 tokens sharing a character
    expected = []
    for ids, (a_spans, a_scores) in zip(lay.chunk_ids, recorded[0]):
        text, p_spans = spans_of_ids(gemma.tokenizer, ids.tolist())
        lead = len(text) - len(text.lstrip())
        expected.append(_brute_force_align(p_spans - lead, a_spans, a_scores))
    torch.testing.assert_close(scores, torch.cat(expected))
    # the selection is windowed: no window is sparse (the paper: sparse windows are dropped)
    counts = torch.bincount(idx // 8)
    assert int(((counts > 0) & (counts < 5)).sum()) <= 1  # (only a short trailing window may hold fewer)
    # the auxiliary scoring does not touch the primary's stitched cache
    for (k, v), layer in zip(before, ctx.cache.layers):
        assert torch.equal(k, layer.keys) and torch.equal(v, layer.values)
