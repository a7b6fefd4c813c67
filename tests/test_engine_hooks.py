"""The engine's seams (`EngineHooks`, set with `Engine.hooked`): every full prefill and the method's scoring go
through them, so a harness reuses work without replacing engine or selector methods."""

import pytest
import torch

from kvstitch.engine.budget import AutoBudget

from .conftest import SAMPLE_CHUNKS, SAMPLE_QUESTION, make_tiny_engine

ARGS = dict(question=SAMPLE_QUESTION, chunks=SAMPLE_CHUNKS, max_new_tokens=4)


def test_full_prefills_go_through_the_hook_and_it_is_unset_after(smollm_tokenizer):
    eng = make_tiny_engine("llama", smollm_tokenizer)
    plain = eng.generate(**ARGS, method="full")
    seen = []

    def hook(layout, extra, plan, logits_to_keep, compute):
        seen.append((layout.n_total, extra))
        return compute(layout, extra, plan, logits_to_keep)

    with eng.hooked(full_prefill=hook):
        full = eng.generate(**ARGS, method="full")
        guarded = eng.generate(**ARGS, method="random", recompute_ratio=0.2, guard="full")
    n = eng.layout(SAMPLE_QUESTION, SAMPLE_CHUNKS).n_total
    assert seen == [(n, 4), (n, 4)]  # method "full", then the guard's check
    assert full.token_ids == plain.token_ids and guarded.stats.guard is not None
    assert eng.hooks.full_prefill is None and eng.hooks.score is None
    with pytest.raises(TypeError, match="unknown engine hook"):
        with eng.hooked(recompute=hook):
            pass


@pytest.mark.parametrize("ratio", [0.25, "auto"])
def test_the_score_hook_decides_the_selection(smollm_tokenizer, ratio):
    """Scores from the hook (ascending with position) are what the method picks from: the last tokens."""
    eng = make_tiny_engine("llama", smollm_tokenizer)
    calls = []

    def hook(selector, ctx, compute):
        calls.append(selector.name)
        own = compute(ctx)  # the method's own scores, computed through the seam
        return torch.arange(own.numel(), dtype=torch.float32)

    if ratio == "auto":
        ratio = AutoBudget(min_context=0, schedule=(0.25,), tol=1.0, patience=1, max_ratio=0.5)
    with eng.hooked(score=hook):
        res = eng.generate(**ARGS, method="prophet", recompute_ratio=ratio)
    n, k = res.stats.context_tokens, len(res.recomputed)
    assert calls == ["prophet"] and 0 < k < n
    assert res.recomputed == list(range(n - k, n))
    without = eng.generate(**ARGS, method="prophet", recompute_ratio=ratio)
    assert without.recomputed != res.recomputed  # prophet's own ranking is not "the last tokens"
