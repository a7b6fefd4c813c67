"""The bytes-read bound of a decode step (`kvstitch.bench.bound`)."""

import pytest
import torch

from kvstitch.bench.bound import ModelBytes, bytes_bound, model_bytes

from .conftest import make_tiny_engine

# SmolLM2-135M in float32: 30 layers, 3 KV heads of 64 dims, ~0.54 GB of weights
SMOL = ModelBytes(weight_bytes=538_000_000, num_kv_heads=3, head_dim=64, element_bytes=4, windows=(None,) * 30)


def test_kv_bytes_per_token_and_cap():
    assert SMOL.layer_token_bytes == 2 * 3 * 64 * 4
    assert SMOL.kv_bytes(8192) == 8192 * 30 * 1536  # ~0.38 GB of K/V per 8K request
    assert SMOL.kv_bytes(8192, cap=1088) == 1088 * 30 * 1536
    assert SMOL.kv_bytes(500, cap=1088) == 500 * 30 * 1536  # a short cache is attended whole


def test_bound_of_a_batched_step():
    """8 rows of 8K: dense reads W + 8 x 8192 tokens, PRKV W + 8 x 1088 (k 1024 + window 64)."""
    b = bytes_bound(SMOL, 8192, 8, 1088)
    tb = 30 * 1536
    assert b["bound_dense_bytes"] == 538_000_000 + 8 * 8192 * tb
    assert b["bound_sparse_bytes"] == 538_000_000 + 8 * 1088 * tb
    assert b["bound"] == pytest.approx((538e6 + 8 * 8192 * tb) / (538e6 + 8 * 1088 * tb))
    assert 3.5 < b["bound"] < 4.0 and b["bound_tpot"] == pytest.approx(1 / b["bound"])
    assert b["bound_box_bytes"] == 8 * 256 * 30 * 3 * 128 * 4  # 256 pages x layers x heads x (kmax | -kmin)
    one = bytes_bound(SMOL, 8192, 1, 1088)
    assert 0.55 < one["bound_tpot"] < 0.7  # batch 1: the weights dominate, the floor is far from k / n
    assert bytes_bound(SMOL, 1000, 8, 1088)["bound"] == 1.0  # the budget covers the cache: nothing to gain


def test_sliding_window_layers_cost_their_window_either_way():
    m = ModelBytes(0, 1, 4, 4, windows=(None, 512))
    assert m.kv_bytes(4096) == (4096 + 512) * 32
    assert m.kv_bytes(4096, cap=256) == (256 + 256) * 32
    assert m.box_bytes(4096, 32) == 128 * 1 * 1 * 8 * 4  # only the full layer selects


def test_model_bytes_counts_each_weight_once(smollm_tokenizer):
    eng = make_tiny_engine("llama", smollm_tokenizer)
    unique = {p.data_ptr(): p.numel() * p.element_size() for p in eng.model.parameters()}
    m = model_bytes(eng)
    assert m.weight_bytes == sum(unique.values()) > 0
    assert (m.num_kv_heads, m.head_dim) == (eng.adapter.num_kv_heads, eng.adapter.head_dim)
    assert m.element_bytes == torch.finfo(eng.dtype).bits // 8 and len(m.windows) == eng.adapter.num_layers
