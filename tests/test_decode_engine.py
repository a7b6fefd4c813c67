"""Sparse decode wired into Engine.generate: a budget >= context reproduces dense decode exactly."""

import pytest

from kvstitch import InputError
from kvstitch.decode import DECODE_POLICIES, make_policy

from .conftest import SAMPLE_CHUNKS, SAMPLE_QUESTION


@pytest.mark.parametrize("tiny_engine", ["llama", "gemma3"], indirect=True)
@pytest.mark.parametrize("policy", sorted(DECODE_POLICIES))
def test_large_budget_equals_dense_decode(tiny_engine, policy):
    dense = tiny_engine.generate(SAMPLE_QUESTION, SAMPLE_CHUNKS, method="random", recompute_ratio=0.3,
                                 max_new_tokens=6)
    ad = tiny_engine.adapter  # shadowkv's keys are low-rank: exact only at full rank
    opts = {"rank": ad.num_kv_heads * ad.head_dim} if policy == "shadowkv" else {}
    sparse = tiny_engine.generate(SAMPLE_QUESTION, SAMPLE_CHUNKS, method="random", recompute_ratio=0.3,
                                  max_new_tokens=6, decode=make_policy(policy, **opts) if opts else policy,
                                  kv_budget=4096)
    assert sparse.token_ids == dense.token_ids
    assert sparse.stats["decode_policy"] == make_policy(policy, **opts).spec  # what ran, options in it


@pytest.mark.parametrize("tiny_engine", ["llama"], indirect=True)
def test_small_budget_runs_and_bad_policy_is_refused(tiny_engine):
    res = tiny_engine.generate(SAMPLE_QUESTION, SAMPLE_CHUNKS * 3, method="naive", max_new_tokens=4,
                               decode="prkv", kv_budget=128)
    assert len(res.token_ids) >= 1 and res.stats["kv_budget"] == 128
    with pytest.raises(InputError, match="unknown decode policy"):
        tiny_engine.generate(SAMPLE_QUESTION, SAMPLE_CHUNKS, method="naive", decode="bogus")
    with pytest.raises(InputError, match="kv_budget"):
        tiny_engine.generate(SAMPLE_QUESTION, SAMPLE_CHUNKS, method="naive", decode="prkv", kv_budget=0)


@pytest.mark.parametrize("tiny_engine", ["llama"], indirect=True)
def test_methods_that_change_decode_attention_refuse_sparse_decoders(tiny_engine):
    for method in ["ape", "a3(evict_capacity=8)"]:
        with pytest.raises(InputError, match="changes decode attention"):
            tiny_engine.generate(SAMPLE_QUESTION, SAMPLE_CHUNKS, method=method, decode="prkv", kv_budget=512)
    res = tiny_engine.generate(SAMPLE_QUESTION, SAMPLE_CHUNKS, method="a3", max_new_tokens=3, decode="prkv",
                               kv_budget=512)  # a3 without eviction leaves decode alone
    assert res.stats["decode_policy"] == "prkv"


@pytest.mark.parametrize("tiny_engine", ["llama"], indirect=True)
@pytest.mark.parametrize("policy", ["prkv", "quest"])
def test_cpu_direct_path_equals_the_transfer_path(tiny_engine, policy):
    """The CPU fast path (pages read in place from the host pool, decoder ops on one thread) picks the same
    tokens and recall as the device-pool + batched-transfer path of PRKV Sec. 4.2."""
    runs = {}
    for offload in ("pool", "direct"):
        res = tiny_engine.generate(SAMPLE_QUESTION, SAMPLE_CHUNKS * 3, method="full", max_new_tokens=6,
                                   decode=policy, kv_budget=64,
                                   decode_options={"diagnostic": True, "page_size": 8, "offload": offload})
        runs[offload] = res
    pool, direct = runs["pool"], runs["direct"]
    assert direct.token_ids == pool.token_ids
    assert direct.stats["decode_recall"]["recall"] == pytest.approx(pool.stats["decode_recall"]["recall"], abs=1e-6)
    assert direct.stats["decode_recall"]["recall"] < 1.0  # a real selection
    assert direct.stats["decoder"]["offload"] == "direct" and pool.stats["decoder"]["pages_copied"] > 0
