"""`force_greedy`, the one reader of a given answer (the guard, ``auto``'s rounds and short prompt, the eval, and
`Engine.teacher_force`): its logits are a full prefill's of prompt + answer, and its greedy answer is plain greedy
decoding's whatever the given answer (agreeing, leaving it anywhere, longer, shorter, none)."""

import pytest
import torch

from kvstitch.engine import forcing
from kvstitch.engine.forcing import force_greedy

from .conftest import SAMPLE_CHUNKS, SAMPLE_QUESTION, make_tiny_engine

N_NEW = 8


@pytest.fixture
def eng(smollm_tokenizer):
    return make_tiny_engine("llama", smollm_tokenizer)


def _prefill(eng):
    layout = eng.layout(SAMPLE_QUESTION, SAMPLE_CHUNKS)
    cache, logits = eng.full_prefill(layout, extra=N_NEW + 2)
    return layout, cache, logits[-1]


def _guesses(eng, own: list[int]) -> list[list[int]]:
    other = next(t for t in range(5, 500) if t not in own and t not in eng.eos_ids)
    return ([own, own + [other], own[:1], own[:-1], [other] + own[1:], []]
            + [own[:k] + [other] + own[k + 1:] for k in range(1, len(own))])


def test_the_greedy_answer_read_off_any_given_answer_is_greedy_decodings(eng):
    own = eng.generate(SAMPLE_QUESTION, SAMPLE_CHUNKS, method="full", max_new_tokens=N_NEW).token_ids
    layout, cache, first = _prefill(eng)
    n = layout.n_total
    for guess in _guesses(eng, own):
        out = force_greedy(eng, cache, n, guess, N_NEW, first=first)
        assert out.tokens == own, guess
        agreed = next((i for i, (a, b) in enumerate(zip(guess, own)) if a != b), min(len(guess), len(own)))
        assert out.agreed == agreed, guess
        assert out.logits.shape == (len(own), first.numel())
        assert torch.equal(out.logits.argmax(-1), torch.tensor(own))  # each row chose its token
        assert cache.length == n + len(own) - 1  # the answer's K/V but its last: decoding may go on from here
    capped = force_greedy(eng, cache, n, own, 3, first=first)
    assert capped.tokens == own[:3] and capped.agreed == len(own)


def test_forced_logits_are_a_full_prefill_of_prompt_and_answer(eng):
    own = eng.generate(SAMPLE_QUESTION, SAMPLE_CHUNKS, method="full", max_new_tokens=N_NEW).token_ids
    layout, cache, first = _prefill(eng)
    guess = own[:2] + [17, 93]
    out = force_greedy(eng, cache, layout.n_total, guess, first=first)
    assert out.tokens == [] and out.agreed == 2 and cache.length == layout.n_total + len(guess) - 1
    ids = torch.cat([layout.ids[:layout.n_total], torch.tensor(guess)])
    with torch.no_grad():
        want = eng.model(ids.view(1, -1)).logits[0, layout.n_total - 1:-1].float()
    torch.testing.assert_close(out.forced, want, rtol=1e-4, atol=1e-4)
    pre = eng.prefill(layout, "full", 0.0, N_NEW)
    assert torch.equal(eng.teacher_force(pre, torch.tensor(guess)), force_greedy(
        eng, pre.cache, layout.n_total, guess, first=pre.logits[-1]).forced)  # `Engine.teacher_force` reads it so


def test_rows_a_pass_already_forced_are_read_without_a_forward(eng, monkeypatch):
    own = eng.generate(SAMPLE_QUESTION, SAMPLE_CHUNKS, method="full", max_new_tokens=N_NEW).token_ids
    layout, cache, first = _prefill(eng)
    forced = force_greedy(eng, cache, layout.n_total, own, first=first).forced
    calls = []
    real = eng.forward
    monkeypatch.setattr(eng, "forward", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    out = force_greedy(eng, cache, layout.n_total, own, len(own), forced=forced)
    assert out.tokens == own and not calls and torch.equal(out.logits, forced)


def test_an_answer_ends_at_its_first_finished_prefix(eng, monkeypatch):
    """A base model's answer ends at its first line break (`kvstitch.engine.sampling.finished`), inside the given answer too."""
    own = eng.generate(SAMPLE_QUESTION, SAMPLE_CHUNKS, method="full", max_new_tokens=N_NEW).token_ids
    layout, cache, first = _prefill(eng)
    monkeypatch.setattr(forcing, "finished", lambda engine, tokens: len(tokens) >= 3)
    assert force_greedy(eng, cache, layout.n_total, own, N_NEW, first=first).tokens == own[:3]
    assert force_greedy(eng, cache, layout.n_total, own[:1], N_NEW, first=first).tokens == own[:3]
