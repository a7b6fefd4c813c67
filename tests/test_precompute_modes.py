"""Precompute context as an option: ``shared_prefix`` (every chunk after the shared prefix) vs ``isolated``
(each chunk from position 0 on its own, A3 / InfoFlow's setting), part of the chunk store key."""

import pytest
import torch

from kvstitch import Engine
from kvstitch.core.attention import ForwardPlan
from kvstitch.core.cache import StitchCache
from kvstitch.core.errors import InputError
from kvstitch.store import MemoryStore, chunk_key

from .conftest import SAMPLE_CHUNKS, SAMPLE_QUESTION, make_tiny_engine


def test_isolated_and_shared_prefix_chunks_get_different_keys():
    prefix, chunk = torch.arange(5), torch.arange(100, 120)
    shared = chunk_key("fp", prefix, chunk, "float16")
    assert chunk_key("fp", prefix, chunk, "float16", precompute="shared_prefix") == shared  # the old keys stay
    iso = chunk_key("fp", prefix, chunk, "float16", precompute="isolated")
    assert iso != shared and len(iso) == 64
    # an isolated chunk does not depend on the prefix; a shared-prefix one does
    assert chunk_key("fp", torch.arange(7), chunk, "float16", precompute="isolated") == iso
    assert chunk_key("fp", torch.arange(7), chunk, "float16") != shared
    with pytest.raises(InputError):
        chunk_key("fp", prefix, chunk, precompute="bogus")


def _isolated(name, tok):
    base = make_tiny_engine(name, tok)
    return Engine(base.model, base.tokenizer, weights_id=f"tiny-{name}", store=MemoryStore(storage_dtype="float32"),
                  precompute="isolated", cold_path="stitched")


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_isolated_kv_equal_a_standalone_forward_rerotated_at_stitch(arch, smollm_tokenizer):
    eng = _isolated(arch, smollm_tokenizer)
    shared = make_tiny_engine(arch, smollm_tokenizer)
    layout = eng.layout(SAMPLE_QUESTION, SAMPLE_CHUNKS)
    assert eng.chunk_key(layout.prefix_ids, layout.chunk_ids[1]) != shared.chunk_key(layout.prefix_ids,
                                                                                      layout.chunk_ids[1])
    kvs = eng.chunk_kvs(layout)
    stitched = eng.stitch(layout, kvs)
    for start, ids, kv in zip(layout.chunk_starts, layout.chunk_ids, kvs):
        n = ids.numel()
        assert kv.start == 0
        alone = StitchCache.empty(eng.adapter, n, eng.device, eng.dtype)
        eng.forward(alone, ids, torch.arange(n))  # the chunk by itself at positions 0..n-1
        torch.testing.assert_close(kv.keys, alone.stacked_keys(), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(kv.values, alone.stacked_values(), rtol=1e-4, atol=1e-5)
        # stitched: the same chunk alone at its global positions (RoPE re-rotation by `start`)
        there = StitchCache.empty(eng.adapter, start + n, eng.device, eng.dtype)
        keep = torch.zeros(start + n, dtype=torch.bool)
        keep[start:] = True  # nothing before the chunk (the empty slots are masked out)
        eng.forward(there, ids, torch.arange(start, start + n), ForwardPlan(key_keep=keep))
        for i, layer in enumerate(stitched.layers):
            torch.testing.assert_close(layer.keys[0, :, start:start + n], there.layers[i].keys[0, :, start:start + n],
                                       rtol=1e-3, atol=1e-4)
    # ...and the shared-prefix chunks are different K/V (they saw the prefix)
    other = shared.chunk_kvs(layout)[1]
    assert other.start == layout.n_prefix and not torch.allclose(other.values, kvs[1].values, atol=1e-3)


def test_isolated_engine_end_to_end(smollm_tokenizer):
    eng = _isolated("llama", smollm_tokenizer)
    full = eng.generate(SAMPLE_QUESTION, SAMPLE_CHUNKS, method="full", max_new_tokens=4)
    res = eng.generate(SAMPLE_QUESTION, SAMPLE_CHUNKS, method="random", recompute_ratio=1.0, max_new_tokens=4)
    assert res.stats["precompute"] == "isolated"
    assert (full.first_logits - res.first_logits).abs().max().item() <= 1e-3  # all recomputed = full prefill
    naive_iso = eng.generate(SAMPLE_QUESTION, SAMPLE_CHUNKS, method="naive", max_new_tokens=1)
    naive_sh = make_tiny_engine("llama", smollm_tokenizer).generate(SAMPLE_QUESTION, SAMPLE_CHUNKS, method="naive",
                                                                    max_new_tokens=1)
    assert (naive_iso.first_logits - naive_sh.first_logits).abs().max().item() > 1e-4
    epic = eng.generate(SAMPLE_QUESTION, SAMPLE_CHUNKS, method="epic", recompute_ratio=0.2, max_new_tokens=1)
    assert epic.stats["epic_skip_first_chunk"] is False  # chunk 0 is not exact without the prefix
    assert 0 in epic.recomputed
    for m in ("infoflow_reorder", "a3", "cacheblend", "prophet"):
        r = eng.generate(SAMPLE_QUESTION, SAMPLE_CHUNKS, method=m, recompute_ratio=0.2, max_new_tokens=1)
        assert torch.isfinite(r.first_logits).all()
    with pytest.raises(InputError):
        Engine(eng.model, eng.tokenizer, weights_id="x", precompute="nope")
