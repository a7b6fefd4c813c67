"""PRKV's evaluation settings (Sec. 5.1): page size 32, local = observation window of 64 tokens, the
budget counted as the paper counts k, and a decode long enough to refresh the static set (T = 128)."""

import pytest
import torch

from kvstitch.decode import make_decoder
from kvstitch.bench.decode import DEFAULT_NEW_TOKENS
from kvstitch.core.errors import InputError

HQ, HKV, D = 4, 2, 8


def _decoder(policy, budget, **kw):
    return make_decoder(policy, budget, num_layers=2, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, **kw)


def _run(dec, n, steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    for layer in range(2):
        dec.load_prefill(layer, torch.randn(HKV, n, D, generator=g), torch.randn(HKV, n, D, generator=g),
                         torch.randn(HQ, 80, D, generator=g))
    for _ in range(steps):
        for layer in range(2):
            dec.append(layer, torch.randn(HKV, 1, D, generator=g), torch.randn(HKV, 1, D, generator=g))
            dec.attend(layer, torch.randn(HQ, 1, D, generator=g), D ** -0.5)
        dec.end_step()
    return dec.stats()


@pytest.mark.parametrize("policy", ["prkv", "quest", "arkvale", "snapkv"])
def test_paper_defaults_page_32_window_64(policy):
    dec = _decoder(policy, 256)
    assert dec.page_size == 32 and dec.window == 64
    assert dec.cap == 256 + 64  # k plus the local window on top
    counts = dec.budget_counts()
    assert "sinks inside k" in counts and "64-token local window on top" in counts


def test_prkv_observation_window_is_the_local_window_and_refresh_happens_in_a_160_step_decode():
    assert DEFAULT_NEW_TOKENS >= 160
    dec = _decoder("prkv", 256)
    stats = _run(dec, 600, DEFAULT_NEW_TOKENS)
    assert stats["observation_window"] == 64  # 80 queries given, the last 64 (the local window) used
    assert [st.static_steps for st in dec.layers] == [[0, 128]] * 2  # T = 128
    assert stats["static_refreshes"] == 2 and stats["static_refresh_bytes"] > 0


@pytest.mark.parametrize("window_in_budget", [False, True])
def test_attended_tokens_follow_the_budget_accounting(window_in_budget):
    dec = _decoder("quest", 256, window_in_budget=window_in_budget)
    stats = _run(dec, 700, 20)
    cap = 256 if window_in_budget else 256 + 64
    assert cap - 32 < stats["mean_selected_tokens"] <= cap
    assert ("inside k" in stats["budget_counts"]) and (("on top" in stats["budget_counts"]) != window_in_budget)
    assert ("local window inside k" in stats["budget_counts"]) == window_in_budget


def test_budget_errors_name_the_window():
    with pytest.raises(InputError, match="local-window pages"):
        _decoder("quest", 32)  # 32 + 64 < one sink page + three window pages of 32
    with pytest.raises(InputError, match="window_in_budget"):
        _decoder("quest", 256, window_in_budget="yes")
