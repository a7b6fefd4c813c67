"""`ensure_chunks`: the one path by which chunk caches come to exist (requests, precompute, index)."""

from __future__ import annotations

import pytest
import torch

from kvstitch.engine.precompute import ensure_chunks, precompute_directory
from kvstitch.store import MemoryStore

from .conftest import SAMPLE_CHUNKS, make_tiny_engine


@pytest.fixture
def eng(smollm_tokenizer):
    e = make_tiny_engine("llama", smollm_tokenizer)
    e.store = MemoryStore(storage_dtype="float32")
    return e


def _puts(store):
    calls = []
    orig = store.put

    def put(key, kv):
        calls.append(key)
        orig(key, kv)
    store.put = put
    return calls


def test_ensure_chunks_dedupes_skips_stored_and_batches(eng):
    ids = [eng.builder.encode_chunk(t) for t in SAMPLE_CHUNKS]
    puts = _puts(eng.store)
    batches = []
    pre = eng.builder.prefix_ids
    res = ensure_chunks(eng, ids + ids[:2], prefix_ids=pre, batch_size=3,
                        on_batch=lambda d, n, t: batches.append((d, n, t)))
    assert res.computed == 4 and res.already_stored == 0 and res.misses == 6 and res.hits == 0
    assert len(puts) == 4 and len(set(puts)) == 4  # the repeated chunks were computed once
    assert [b[:2] for b in batches] == [(3, 4), (4, 4)]
    assert res.tokens == sum(int(i.numel()) for i in ids) == batches[-1][2]
    assert res.keys[4] == res.keys[0] and res.kvs is None
    again = ensure_chunks(eng, ids, prefix_ids=pre, batch_size=3)
    assert again.computed == 0 and again.already_stored == 4 and again.hits == 4 and len(puts) == 4
    # no prefix given (precompute ahead of requests): every canonical prefix, the question one already stored
    prefixes = eng.builder.canonical_prefixes()
    both = ensure_chunks(eng, ids, batch_size=3)
    assert both.computed == 4 * (len(prefixes) - 1) and both.already_stored == 4 * len(prefixes) - both.computed
    assert all(len(k) == len(prefixes) and k[0] == both.keys[i] for i, k in enumerate(both.all_keys))
    with pytest.raises(ValueError):
        ensure_chunks(eng, ids, load=True)


def test_ensure_chunks_load_matches_chunk_kvs_and_a_fresh_compute(eng):
    layout = eng.layout("q?", SAMPLE_CHUNKS[:3])
    cold = ensure_chunks(eng, layout.chunk_ids, prefix_ids=layout.prefix_ids, load=True)
    assert cold.computed == 3 and all(kv is not None for kv in cold.kvs)
    warm = eng.chunk_kvs(layout, stats := {})
    assert stats["store_hits"] == 3 and stats["store_misses"] == 0
    fresh = eng.compute_chunks(layout.prefix_ids, layout.chunk_ids)
    for a, b, c in zip(cold.kvs, warm, fresh):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
        assert torch.allclose(a.keys, c.keys, atol=1e-6)


def test_ensure_chunks_refuses_a_foreign_entry(eng):
    ids = [eng.builder.encode_chunk(SAMPLE_CHUNKS[0])]
    res = ensure_chunks(eng, ids, prefix_ids=eng.builder.prefix_ids)
    kv = eng.store.get(res.keys[0])
    kv.fingerprint = "someone-else"  # the memory store shares the object: the entry is now foreign
    eng.store.fingerprint = None
    again = ensure_chunks(eng, ids, prefix_ids=eng.builder.prefix_ids, load=True)
    assert again.misses == 1 and again.computed == 1 and again.kvs[0].fingerprint == eng.fingerprint


def test_precompute_directory_is_resumable(eng, tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    for i, t in enumerate(SAMPLE_CHUNKS):
        (docs / f"d{i}.txt").write_text(t)
    rep, chunks = precompute_directory(eng, docs, chunk_tokens=64, batch_size=2, progress=False)
    n = len(eng.builder.canonical_prefixes())  # one cache per chunk and canonical prefix
    assert rep.chunks == len(chunks) == 4 and rep.computed == 4 * n and rep.skipped == 0 and rep.tokens > 0
    rep2, _ = precompute_directory(eng, docs, chunk_tokens=64, batch_size=2, progress=False)
    assert rep2.computed == 0 and rep2.skipped == 4 * n


def test_engine_precompute_warms_the_store_for_the_first_question(eng):
    from kvstitch.core.errors import InputError

    rep = eng.precompute(SAMPLE_CHUNKS, progress=False)
    n_prefixes = len(eng.builder.canonical_prefixes())  # a question's layout and a conversation's
    assert (rep.chunks, rep.computed, rep.skipped) == (len(SAMPLE_CHUNKS), n_prefixes * len(SAMPLE_CHUNKS), 0)
    res = eng.generate("What is the special magic number for Carol?", SAMPLE_CHUNKS, method="random",
                       recompute_ratio=0.2, max_new_tokens=2)
    assert res.stats["store_hits"] == len(SAMPLE_CHUNKS) and res.stats["store_misses"] == 0
    again = eng.precompute(SAMPLE_CHUNKS, progress=False)
    assert again.computed == 0 and again.skipped == rep.computed
    # documents split into ~12-token chunks: more chunks than documents, each stored
    docs = eng.precompute([" ".join(SAMPLE_CHUNKS)], chunk_tokens=12, progress=False)
    assert docs.chunks > 3 and docs.computed == n_prefixes * docs.chunks
    with pytest.raises(InputError, match="chunk 1 is empty"):
        eng.precompute(["fine", "  "], progress=False)
    with pytest.raises(InputError, match="chunk_tokens"):
        eng.precompute(["fine"], chunk_tokens=0, progress=False)
