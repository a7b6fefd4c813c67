"""ShadowKV decode policy: exact un-rotation + low-rank keys, landmarks / outliers, budget, recall."""

import pytest
import torch

from kvstitch.decode import DECODE_POLICIES, make_decoder
from kvstitch.core.errors import InputError
from kvstitch.core.rope import rerotate

HQ, HKV, D = 4, 2, 16
SCALE = D ** -0.5
INV = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float64) / D))


def roped(pre):
    """Post-RoPE keys of pre-RoPE keys ``[H, n, D]`` at positions 0..n-1."""
    return rerotate(pre, torch.arange(pre.shape[1]), INV)


def make(budget, n=400, pre_rank=None, layers=1, seed=0, **kw):
    g = torch.Generator().manual_seed(seed)
    dec = make_decoder("shadowkv", budget, num_layers=layers, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, **kw)
    kv = []
    for layer in range(layers):
        if pre_rank:  # pre-RoPE keys of exact low rank across all heads (post-RoPE keys are not)
            pre = (torch.randn(n, pre_rank, generator=g) @ torch.randn(pre_rank, HKV * D, generator=g))
            pre = pre.view(n, HKV, D).transpose(0, 1).contiguous()
        else:
            pre = torch.randn(HKV, n, D, generator=g)
        keys, values = roped(pre), torch.randn(HKV, n, D, generator=g)
        dec.load_prefill(layer, keys, values, inv_freq=INV)
        kv.append([keys, values])
    return dec, kv, g


def step(dec, kv, g, check=None):
    for layer, pair in enumerate(kv):
        n = pair[0].shape[1]
        k = rerotate(torch.randn(HKV, 1, D, generator=g), n, INV)
        v, q = torch.randn(HKV, 1, D, generator=g), torch.randn(HQ, 1, D, generator=g)
        pair[0], pair[1] = torch.cat([pair[0], k], 1), torch.cat([pair[1], v], 1)
        dec.append(layer, k, v)
        out = dec.attend(layer, q, SCALE)
        if check:
            check(layer, q, out, *pair)
    dec.end_step()


def dense(q, keys, values):
    G = HQ // HKV
    k, v = keys.repeat_interleave(G, 0), values.repeat_interleave(G, 0)
    return torch.softmax(q @ k.transpose(1, 2) * SCALE, dim=-1) @ v


def test_registered():
    assert "shadowkv" in DECODE_POLICIES


def test_full_rank_low_rank_keys_equal_the_real_keys():
    dec, kv, _ = make(128, rank=HKV * D)
    st = dec.layers[0]
    tokens = torch.arange(st.local_start).expand(HKV, -1)
    assert st.local_start == 400 - 64 and dec.rank == HKV * D
    assert torch.allclose(dec.reconstruct_keys(0, tokens), kv[0][0][:, : st.local_start], atol=1e-4)


def test_pre_rope_keys_of_rank_r_are_rebuilt_exactly_at_rank_r():
    """The factorisation is of the *pre-RoPE* keys: rank 3 pre-RoPE keys come back exactly with rank 3,
    although the post-RoPE keys (what the cache holds) are far from rank 3."""
    dec, kv, _ = make(128, pre_rank=3, rank=3)
    st = dec.layers[0]
    post = kv[0][0][:, : st.local_start]
    assert torch.linalg.matrix_rank(post.transpose(0, 1).reshape(st.local_start, -1)) > 3
    tokens = torch.arange(st.local_start).expand(HKV, -1)
    err = (dec.reconstruct_keys(0, tokens) - post).abs().max() / post.abs().max()
    assert err < 1e-4
    dec2, _, _ = make(128, pre_rank=8, rank=3)  # rank too small: a real approximation error
    assert (dec2.reconstruct_keys(0, tokens) - dec2.layers[0].keys_host[:, : st.local_start]).abs().max() > 1e-2


def test_full_budget_at_full_rank_is_dense_with_recall_one():
    dec, kv, g = make(1024, rank=HKV * D, layers=2)
    dec.diagnostic = True

    def check(layer, q, out, keys, values):
        assert torch.allclose(out, dense(q, keys, values), atol=1e-4)

    for _ in range(5):
        step(dec, kv, g, check)
    stats = dec.stats()
    assert stats["recall"] == pytest.approx(1.0, abs=1e-5) and stats["recall_min"] > 1 - 1e-5


def test_small_budget_selects_chunks_within_k_plus_window_and_keeps_outliers():
    dec, kv, g = make(160, n=600, seed=3)
    dec.diagnostic = True
    st = dec.layers[0]
    assert dec.outlier_chunks == round(48 * 160 / 2048) == 4 and dec.rank == round(160 / 1024 * HKV * D)
    outliers = st.outlier_tok.clone()
    for _ in range(12):
        step(dec, kv, g)
        assert st.selected.shape[1] == (160 + 64 - 32 - (st.n - st.local_start)) // 8
        assert not set(st.selected[0].tolist()) & set((outliers[0] // 8).tolist())  # outliers are static
    stats = dec.stats()
    assert stats["mean_selected_tokens"] <= 160 + 64
    assert 0 < stats["recall"] < 1 and stats["recall"] <= stats["oracle_recall"] + 1e-6
    assert stats["bytes_copied"] == stats["pages_copied"] * 8 * D * 4  # values only, float32
    assert stats["reconstructed_keys"] == stats["pages_copied"] * 8
    assert "outlier chunks" in stats["budget_counts"]


def test_outlier_chunk_is_the_one_whose_keys_disagree_with_their_landmark():
    g = torch.Generator().manual_seed(5)
    n = 320
    direction = torch.randn(HKV, 1, D, generator=g)
    keys = 5 * direction + 0.1 * torch.randn(HKV, n, D, generator=g)  # coherent chunks
    keys[:, 8 * 17 + 3] = -5 * direction[:, 0]  # chunk 17 holds one key pointing away
    dec = make_decoder("shadowkv", 128, num_layers=1, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D,
                       outlier_chunks=1)
    dec.load_prefill(0, keys, torch.randn(HKV, n, D, generator=g), inv_freq=INV)
    st = dec.layers[0]
    assert (st.outlier_tok // 8 == 17).all() and 17 not in st.landmark_chunk[0].tolist()


def test_errors():
    with pytest.raises(InputError, match="inv_freq"):
        make_decoder("shadowkv", 128, num_layers=1, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D).load_prefill(
            0, torch.randn(HKV, 100, D), torch.randn(HKV, 100, D))
    with pytest.raises(InputError, match="rank"):
        make_decoder("shadowkv", 128, num_layers=1, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, rank=HKV * D + 1)
    with pytest.raises(InputError, match="chunk_size"):
        make_decoder("shadowkv", 128, num_layers=1, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, chunk_size=0)
    with pytest.raises(InputError, match="do not fit"):
        make_decoder("shadowkv", 128, num_layers=1, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, outlier_chunks=40)
