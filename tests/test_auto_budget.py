"""recompute_ratio="auto": rounds of growing budget, convergence, the full-prefill fallback, the guard."""

from dataclasses import replace

import pytest
import torch

from kvstitch import InputError
from kvstitch.engine.budget import AutoBudget, parse_ratio

from .conftest import SAMPLE_CHUNKS, SAMPLE_QUESTION, TINY, make_tiny_engine

CHUNKS = SAMPLE_CHUNKS * 2


def _gen(eng, method="prophet", ratio="auto", **kw):
    if isinstance(ratio, str) and ratio == "auto":
        ratio = AutoBudget(min_context=0)  # the test prompts are short: make the rounds run
    return eng.generate(SAMPLE_QUESTION, CHUNKS, method=method, recompute_ratio=ratio,
                        max_new_tokens=kw.pop("max_new_tokens", 8), **kw)


@pytest.mark.parametrize("tiny_engine", TINY, indirect=True)
def test_tolerance_zero_is_full_prefill_exactly(tiny_engine):
    full = _gen(tiny_engine, "full", 0.0)
    auto = _gen(tiny_engine, ratio=AutoBudget(min_context=0, tol=0.0))
    assert auto.token_ids == full.token_ids
    assert torch.equal(auto.first_logits, full.first_logits)  # the fallback IS a full prefill
    st = auto.stats
    assert st["converged"] is False and st["ratio_used"] == 1.0 and st["rounds"] == len(AutoBudget().rounds())
    assert len(auto.recomputed) == st["context_tokens"]
    assert all(r["agreed"] is not True for r in st["round_log"])


@pytest.mark.parametrize("method", ["prophet", "infoflow", "a3", "cacheblend", "random"])
def test_rounds_never_recompute_a_context_token_twice(smollm_tokenizer, method, monkeypatch):
    eng = make_tiny_engine("llama", smollm_tokenizer)
    seen: list[torch.Tensor] = []
    real = eng.forward

    def spy(cache, ids, slots, plan=None, **kw):
        out = real(cache, ids, slots, plan, **kw)
        if out is not None and kw.get("write", True):  # a pass through all layers that writes K/V
            seen.append(slots.clone())
        return out

    monkeypatch.setattr(eng, "forward", spy)
    layout = eng.layout(SAMPLE_QUESTION, CHUNKS)
    res = eng.generate(SAMPLE_QUESTION, CHUNKS, method=method, max_new_tokens=4,
                       recompute_ratio=AutoBudget(min_context=0, tol=0.0, max_ratio=0.5, mode="incremental",
                                                  schedule=(0.05, 0.1, 0.2, 0.4)))
    # never converges: every round runs
    c0, c1 = layout.context_start, layout.context_end
    ctx_slots = [s[(s >= c0) & (s < c1)] for s in seen if s.numel() > 1 or (c0 <= int(s[0]) < c1)]
    # scoring passes run the suffix only; the recompute rounds carry the context tokens
    rounds = [s for s in ctx_slots if s.numel()]
    flat = torch.cat(rounds)
    assert flat.unique().numel() == flat.numel(), "a context token was recomputed twice"
    st = res.stats
    assert st["rounds"] == len(st["round_log"]) == 5  # 0.05, 0.1, 0.2, 0.4 and the ceiling 0.5
    assert st["ratio_used"] == pytest.approx(len(res.recomputed) / layout.n_context)
    assert st["ratio_used"] == pytest.approx(flat.numel() / layout.n_context)
    assert st["round_log"][-1]["ratio"] == pytest.approx(st["ratio_used"])
    assert st["converged"] is False


@pytest.mark.parametrize("name", TINY)
def test_ratio_used_is_the_real_fraction_and_rounds_stop_at_the_first_agreement(smollm_tokenizer, name):
    eng = make_tiny_engine(name, smollm_tokenizer)
    # KL never blocks: a reproduced probe converges
    res = _gen(eng, ratio=AutoBudget(min_context=0, tol=1e9, probe_tokens=4))
    st = res.stats
    agreed = [r["agreed"] for r in st["round_log"]]
    assert agreed[0] is None  # the first round has nothing to compare with
    if True in agreed:
        assert st["converged"] is True and st["rounds"] == agreed.index(True) + 1 == len(agreed)
        assert st["ratio_used"] == pytest.approx(len(res.recomputed) / st["context_tokens"])
        assert st["ratio_used"] == pytest.approx(st["round_log"][-1]["ratio"], abs=1e-6) and st["ratio_used"] < 1.0
    else:
        assert st["converged"] is False and st["ratio_used"] == 1.0


def test_converged_answer_equals_greedy_decode_of_the_same_cache(smollm_tokenizer):
    """The answer read off the rounds (probe K/V reused) equals decoding the final round's cache step by step."""
    eng = make_tiny_engine("llama", smollm_tokenizer)
    res = _gen(eng, ratio=AutoBudget(min_context=0, tol=1e9, probe_tokens=3), max_new_tokens=8)
    layout = eng.layout(SAMPLE_QUESTION, CHUNKS)
    # same final set, recomputed in one pass: the probe tokens must be that cache's greedy answer
    pre = eng.prefill(layout, "prophet", AutoBudget(min_context=0, tol=1e9, probe_tokens=3), 8)
    tokens = list(eng.decode_tokens(pre, 8))
    assert tokens == res.token_ids
    assert len(res.token_ids) > 3 or eng.finished(res.token_ids)


def test_ceiling_below_one_keeps_the_last_round_and_reports_not_converged(smollm_tokenizer):
    eng = make_tiny_engine("llama", smollm_tokenizer)
    res = _gen(eng, ratio=AutoBudget(min_context=0, tol=0.0, max_ratio=0.3, schedule=(0.05, 0.1, 0.2)))
    st = res.stats
    assert st["converged"] is False and st["ratio_used"] < 0.31 and "fallback_s" not in st
    assert [r["ratio"] for r in st["round_log"]] == sorted(r["ratio"] for r in st["round_log"])


def test_bad_auto_values_are_input_errors(smollm_tokenizer):
    eng = make_tiny_engine("llama", smollm_tokenizer)
    for bad in ("fast", "1.5", -0.1, float("nan"), True, [0.2]):
        with pytest.raises(InputError):
            _gen(eng, ratio=bad)
    for spec in ("auto(tol=-1)", "auto(schedule=[0.4,0.2])", "auto(max_ratio=0)", "auto(probe_tokens=0)",
                 "auto(bogus=1)"):
        with pytest.raises(InputError):
            _gen(eng, ratio=spec)
    with pytest.raises(InputError, match="does not rank"):
        _gen(eng, method="naive")
    assert parse_ratio("AUTO") == "auto" and parse_ratio("0.25") == 0.25
    assert AutoBudget(max_ratio=0.3, schedule=(0.05, 0.1, 0.2, 0.4)).rounds() == [0.05, 0.1, 0.2, 0.3]


def test_guard_full_returns_full_prefill_answer(smollm_tokenizer):
    eng = make_tiny_engine("llama", smollm_tokenizer)
    full = _gen(eng, "full", 0.0)
    naive_guarded = _gen(eng, "random", 0.0, guard="full")
    assert naive_guarded.token_ids == full.token_ids
    g = naive_guarded.stats["guard"]
    naive = _gen(eng, "random", 0.0)
    assert g["agreed"] == (naive.token_ids == full.token_ids)
    assert (g["first_divergence"] is None) == g["agreed"]
    with pytest.raises(InputError):
        _gen(eng, "random", 0.2, guard="sometimes")


@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_refresh_rounds_equal_a_fixed_ratio_prefill_at_their_budget(smollm_tokenizer, name):
    eng = make_tiny_engine(name, smollm_tokenizer)
    layout = eng.layout(SAMPLE_QUESTION, CHUNKS)
    pre = eng.prefill(layout, "prophet", AutoBudget(min_context=0, tol=0.0, max_ratio=0.3, mode="refresh"), 8)
    last = pre.stats["round_log"][-1]
    fixed = eng.prefill(layout, "prophet", 0.3, 8)
    assert torch.equal(pre.indices, fixed.indices)
    assert (pre.logits[-1] - fixed.logits[-1]).abs().max() < 1e-4
    assert last["new_tokens"] == fixed.indices.numel()  # the whole set, recomputed in one pass
    assert pre.stats["recompute_cost"] > pre.stats["ratio_used"]  # earlier rounds' tokens were paid again


def test_short_contexts_go_straight_to_full_prefill(smollm_tokenizer):
    eng = make_tiny_engine("llama", smollm_tokenizer)
    full = _gen(eng, "full", 0.0)
    res = eng.generate(SAMPLE_QUESTION, CHUNKS, method="prophet", recompute_ratio="auto", max_new_tokens=8)
    assert res.stats["auto_skipped"] == "short_context" and res.stats["rounds"] == 0
    assert res.stats["ratio_used"] == 1.0 and res.token_ids == full.token_ids


def test_confidence_signal_accepts_one_round_iff_its_probe_is_sure(smollm_tokenizer):
    """``min_p``: a round converges on its own when every probe token has p >= min_p under that round's cache,
    whatever the KL test says (tol=0 never agrees); the answer is then that round's greedy answer, i.e. a
    fixed-ratio prefill at its budget decoded greedily. Just above the probe's own min p, it falls back."""
    eng = make_tiny_engine("llama", smollm_tokenizer)
    sure = _gen(eng, ratio=AutoBudget(min_context=0, tol=0.0, schedule=(0.2,), min_p=1e-12, probe_tokens=4))
    st = sure.stats
    assert st["converged"] is True and st["rounds"] == 1 and st["round_log"][0]["confident"] is True
    assert st["ratio_used"] == pytest.approx(st["round_log"][0]["ratio"], abs=1e-6) and st["ratio_used"] < 1.0
    layout = eng.layout(SAMPLE_QUESTION, CHUNKS)
    fixed = eng.prefill(layout, "prophet", st["round_log"][0]["ratio"], 8)
    assert sure.token_ids == list(eng.decode_tokens(fixed, 8))
    p = st["round_log"][0]["min_p"]
    unsure = _gen(eng, ratio=AutoBudget(min_context=0, tol=0.0, schedule=(0.2,), min_p=min(1.0, p * 1.01 + 1e-6),
                                        probe_tokens=4))
    assert unsure.stats["converged"] is False and unsure.stats["round_log"][0]["confident"] is False
    assert unsure.token_ids == _gen(eng, "full", 0.0).token_ids  # the fallback is full prefill
    for bad in (0.0, 1.5, -0.2, "high"):
        with pytest.raises(InputError, match="min_p"):
            AutoBudget(min_p=bad)
    assert AutoBudget.of({"min_p": 0.9}).min_p == 0.9


def test_verification_prompt_keeps_the_chunks_that_match_the_question(smollm_tokenizer):
    """The short prompt: the m chunks whose text best matches the question (BM25), pinned ones kept, in prompt
    order; its answer is a real full prefill of exactly that prompt."""
    from kvstitch.core.prompt import PromptLayout
    from kvstitch.engine.budget import reference_answer, verification_chunks

    eng = make_tiny_engine("llama", smollm_tokenizer)
    layout = eng.layout(SAMPLE_QUESTION, CHUNKS)  # Carol's chunk is 2 (and 6, its copy)
    assert verification_chunks(eng, layout, 1) == [2]
    assert verification_chunks(eng, layout, 2) == [2, 6]
    pinned = PromptLayout(layout.prefix_ids, layout.chunk_ids, layout.suffix_ids, pinned=1, question=layout.question)
    assert verification_chunks(eng, pinned, 1) == [0, 2]
    ref = reference_answer(eng, layout, 2, 4)
    short = eng.layout(SAMPLE_QUESTION, [CHUNKS[2], CHUNKS[6]])
    assert ref.chunks == [2, 6] and ref.n_context == short.n_context
    full_short = eng.generate(SAMPLE_QUESTION, [CHUNKS[2], CHUNKS[6]], method="full", max_new_tokens=4)
    assert ref.text == full_short.text


def test_verification_accepts_a_round_iff_its_probe_says_what_the_short_prompt_says(smollm_tokenizer, monkeypatch):
    """``verify_chunks``: the round is accepted when (and only when) its probe agrees with the short prompt's
    answer, whatever the KL and confidence tests say; otherwise full prefill answers. The short prompt's
    prefill is counted in the work."""
    import kvstitch.engine.budget as budget

    eng = make_tiny_engine("llama", smollm_tokenizer)
    opts = AutoBudget(min_context=0, tol=0.0, schedule=(0.2,), probe_tokens=4, verify_chunks=1)
    plain = _gen(eng, ratio=replace(opts, verify_chunks=0))  # the round's own probe (tol 0: falls back)
    probe_text = eng.answer_text(plain.stats["round_log"][0]["probe"], strip=False)
    layout = eng.layout(SAMPLE_QUESTION, CHUNKS)
    for says, accepted in ((probe_text, True), (probe_text + " and more words", False)):
        monkeypatch.setattr(budget.ShortPrompt, "answer_given", lambda self, guess: says)
        res = _gen(eng, ratio=opts)
        st = res.stats
        assert st["round_log"][0]["verified"] is accepted and st["converged"] is accepted
        assert st["round_log"][0]["answer"] == probe_text  # what the round said, beside what the check said
        if accepted:  # the round's greedy answer, at its budget
            fixed = eng.prefill(layout, "prophet", st["round_log"][0]["ratio"], 8)
            assert res.token_ids == list(eng.decode_tokens(fixed, 8)) and st["ratio_used"] < 1.0
            short = eng.layout(SAMPLE_QUESTION, [CHUNKS[2]]).n_context
            assert st["recompute_cost"] == pytest.approx(st["round_log"][0]["new_tokens"] / layout.n_context
                                                         + short / layout.n_context)
        else:
            assert res.token_ids == _gen(eng, "full", 0.0).token_ids
    monkeypatch.undo()
    res = _gen(eng, ratio=opts)  # the real short prompt: its answer and chunks are reported
    assert res.stats["verify"]["chunks"] == [2] and isinstance(res.stats["verify"]["answer"], str)
    few = _gen(eng, ratio=replace(opts, verify_chunks=len(CHUNKS)))  # the short prompt would be the whole prompt
    assert few.stats["auto_skipped"] == "few_chunks" and few.token_ids == _gen(eng, "full", 0.0).token_ids
    for bad in (-1, True, 1.5, "2"):
        with pytest.raises(InputError, match="verify_chunks"):
            AutoBudget(verify_chunks=bad)
    assert AutoBudget.of({"verify_chunks": 2}).verify_chunks == 2


def test_short_prompt_reads_a_guess_teacher_forced_and_answers_its_own_greedy_answer(smollm_tokenizer):
    """`ShortPrompt.greedy_given(guess)` is the short prompt's greedy answer whatever the guess: its own answer,
    a guess that leaves it at the first, a middle or the last token, a longer or shorter one, or none (then it
    decodes step by step). Verification reads a round's probe this way."""
    from kvstitch.engine.budget import ShortPrompt

    eng = make_tiny_engine("llama", smollm_tokenizer)
    layout = eng.layout(SAMPLE_QUESTION, CHUNKS)
    short = ShortPrompt(eng, layout, 2, 6)
    own = short.greedy_given([])
    assert 1 <= len(own) <= 6
    other = next(t for t in range(5, 500) if t != own[0] and t not in eng.eos_ids)
    guesses = [own, own + [other], own[:1], own[:-1], [other] + own[1:]]
    guesses += [own[:k] + [other] + own[k + 1:] for k in range(1, len(own))]
    for guess in guesses:
        assert short.greedy_given(guess) == own, guess
    assert short.greedy_given([]) == own  # the cache is left reusable


def test_short_prompt_probability_of_a_guess_equals_a_full_prefill_of_prompt_and_guess(smollm_tokenizer):
    """`ShortPrompt.probs_given(guess)` (what the `verify_p` calibration replays) is each guess token's
    probability after a full prefill of the short prompt followed by the guess, and leaves the cache reusable."""
    from kvstitch.engine.budget import ShortPrompt

    eng = make_tiny_engine("llama", smollm_tokenizer)
    layout = eng.layout(SAMPLE_QUESTION, CHUNKS)
    short = ShortPrompt(eng, layout, 2, 6)
    own = short.greedy_given([])
    guess = [17, 93, 5, 250][:6]
    p = short.probs_given(guess)
    ids = torch.cat([short.layout.ids[:short.layout.n_total], torch.tensor(guess)])
    with torch.no_grad():
        logits = eng.model(ids.view(1, -1)).logits[0, short.layout.n_total - 1:-1].float()
    want = torch.softmax(logits, -1).gather(1, torch.tensor(guess).view(-1, 1)).flatten()
    assert p.shape == (len(guess),) and torch.allclose(p, want, rtol=1e-4, atol=1e-6)
    assert short.probs_given([]).numel() == 0
    assert short.greedy_given([]) == own  # the cache is left reusable


def test_verification_chunks_by_attention_and_by_order(smollm_tokenizer):
    """``verify_by="attention"``: the chunks holding most of the tokens the stitched pass selected (ties: the
    earlier one), in prompt order; ``"order"``: the first m (a retriever's best); pinned chunks always kept."""
    from kvstitch.core.prompt import PromptLayout
    from kvstitch.engine.budget import verification_chunks

    eng = make_tiny_engine("llama", smollm_tokenizer)
    layout = eng.layout(SAMPLE_QUESTION, CHUNKS)
    starts = torch.tensor([0] + [c.numel() for c in layout.chunk_ids]).cumsum(0)
    picked = torch.cat([starts[5] + torch.arange(3), starts[1] + torch.arange(2), starts[3] + torch.arange(1),
                        starts[6] - 1 + torch.arange(1)])  # 3 in chunk 5, 2 in 1, 1 in 3, 1 at chunk 5's end
    assert verification_chunks(eng, layout, 1, "attention", picked) == [5]
    assert verification_chunks(eng, layout, 2, "attention", picked) == [1, 5]
    assert verification_chunks(eng, layout, 2, "order") == [0, 1]
    pinned = PromptLayout(layout.prefix_ids, layout.chunk_ids, layout.suffix_ids, pinned=1, question=layout.question)
    assert verification_chunks(eng, pinned, 1, "order") == [0, 1]
    assert verification_chunks(eng, pinned, 1, "attention", picked) == [0, 5]
    with pytest.raises(InputError, match="verify_by"):
        AutoBudget(verify_by="bm26")
    with pytest.raises(InputError, match="accept"):
        AutoBudget(accept="maybe")


def test_attention_verification_prefills_the_chunks_the_first_round_selects(smollm_tokenizer, monkeypatch):
    import kvstitch.engine.budget as budget

    eng = make_tiny_engine("llama", smollm_tokenizer)
    seen = {}
    real = budget.verification_chunks

    def spy(engine, layout, m, by="bm25", selected=None):
        seen.update(by=by, selected=None if selected is None else selected.clone(), n=layout.n_context)
        return real(engine, layout, m, by, selected)

    monkeypatch.setattr(budget, "verification_chunks", spy)
    opts = AutoBudget(min_context=0, schedule=(0.2,), probe_tokens=4, verify_chunks=2, verify_by="attention")
    res = _gen(eng, ratio=opts)
    assert seen["by"] == "attention" and seen["selected"].numel() == round(0.2 * seen["n"])
    layout = eng.layout(SAMPLE_QUESTION, CHUNKS)
    fixed = eng.prefill(layout, "prophet", 0.2, 8)
    assert torch.equal(seen["selected"].sort().values, fixed.indices.cpu().sort().values)
    assert res.stats["verify"]["chunks"] == real(eng, layout, 2, "attention", seen["selected"])


def test_answer_level_acceptance_ignores_wording(smollm_tokenizer, monkeypatch):
    """``accept="answer"``: a round is verified when the SQuAD-normalised first lines agree ("The Reyne Tower."
    and "reyne tower"), which the 12-word test refuses when the wording after the first line differs."""
    import kvstitch.engine.budget as budget

    eng = make_tiny_engine("llama", smollm_tokenizer)
    opts = AutoBudget(min_context=0, tol=0.0, schedule=(0.2,), probe_tokens=4, verify_chunks=1)
    probe = _gen(eng, ratio=replace(opts, verify_chunks=0)).stats["round_log"][0]["probe"]
    probe_text = eng.answer_text(probe, strip=False)
    first = probe_text.strip().splitlines()[0] if probe_text.strip() else ""
    says = f"{first.upper()}!\nsomething else entirely, said at length"
    monkeypatch.setattr(budget.ShortPrompt, "answer_given", lambda self, guess: says)
    words = _gen(eng, ratio=opts).stats["round_log"][0]["verified"]
    answer = _gen(eng, ratio=replace(opts, accept="answer")).stats["round_log"][0]["verified"]
    from kvstitch.tasks.agreement import first_words_agree, same_answer
    assert answer is same_answer(probe_text, says) and words is first_words_agree(probe_text, says)
    assert same_answer("The Reyne Tower.", "reyne tower\nbuilt in 1887") and not same_answer("Reyne", "Tower")
