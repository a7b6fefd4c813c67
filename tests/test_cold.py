"""The cold path (`kvstitch.engine.cold`): a request on a cold store is answered by full prefill (never slower than
it), its chunks are precomputed off the request path, and the next request is warm and stitched."""

import pytest

from kvstitch import Engine
from kvstitch.bench.ttft import COLD, HALF, bench_ttft
from kvstitch.core.errors import InputError
from kvstitch.store import MemoryStore

from .conftest import SAMPLE_CHUNKS, SAMPLE_QUESTION, make_tiny_engine


def _engine(tok, **kw) -> Engine:
    base = make_tiny_engine("llama", tok)
    return Engine(base.model, base.tokenizer, weights_id="tiny-llama", store=MemoryStore(storage_dtype="float32"),
                  check_rope=False, **kw)


def _keys(eng, layout):
    return [eng.chunk_key(layout.prefix_ids, ids) for ids in layout.chunk_ids]


def test_cold_request_is_full_prefill_then_warm(smollm_tokenizer):
    eng = _engine(smollm_tokenizer)
    assert eng.cold_path == "auto" and eng.cold_threshold == 0.5
    full = eng.generate(SAMPLE_QUESTION, SAMPLE_CHUNKS, method="full", max_new_tokens=6)
    layout = eng.layout(SAMPLE_QUESTION, SAMPLE_CHUNKS)
    assert not any(k in eng.store for k in _keys(eng, layout))
    stream = eng.stream(SAMPLE_QUESTION, SAMPLE_CHUNKS, method="prophet", recompute_ratio=0.2, max_new_tokens=6)
    events = list(stream)
    cold = events[-1]
    assert cold.stats["cold_path"] == "full_prefill" and cold.stats["deferred_chunks"] == len(SAMPLE_CHUNKS)
    assert cold.stats["store_misses"] == len(SAMPLE_CHUNKS) and "chunk_load_s" not in cold.stats
    assert cold.token_ids == full.token_ids and cold.text == full.text
    assert (cold.first_logits - full.first_logits).abs().max() < 1e-4
    # the deferred chunks were computed after the result (the stream was read to its end), in the stored form
    assert len(eng.deferred) == 0 and all(k in eng.store for k in _keys(eng, layout))
    warm = eng.generate(SAMPLE_QUESTION, SAMPLE_CHUNKS, method="prophet", recompute_ratio=0.2, max_new_tokens=6)
    assert warm.stats["cold_path"] == "stitched" and warm.stats["store_misses"] == 0
    assert warm.stats["store_hits"] == len(SAMPLE_CHUNKS)
    # the warm stitched request equals the same request on an engine that precomputes on the request path
    ref = _engine(smollm_tokenizer, cold_path="stitched")
    again = ref.generate(SAMPLE_QUESTION, SAMPLE_CHUNKS, method="prophet", recompute_ratio=0.2, max_new_tokens=6)
    assert again.stats["store_misses"] == len(SAMPLE_CHUNKS) and again.token_ids == warm.token_ids
    # 100% recompute on the warm store is still full prefill (exactness gate)
    exact = eng.generate(SAMPLE_QUESTION, SAMPLE_CHUNKS, method="random", recompute_ratio=1.0, max_new_tokens=6)
    assert exact.stats["cold_path"] == "stitched" and exact.token_ids == full.token_ids


def test_threshold_partial_store_and_policies(smollm_tokenizer):
    eng = _engine(smollm_tokenizer)
    layout = eng.layout(SAMPLE_QUESTION, SAMPLE_CHUNKS)
    eng.generate(SAMPLE_QUESTION, SAMPLE_CHUNKS, method="random", max_new_tokens=1)  # cold, then filled
    keys = _keys(eng, layout)
    eng.store.delete(keys[0])  # a quarter of the context missing: below the threshold -> stitched
    res = eng.generate(SAMPLE_QUESTION, SAMPLE_CHUNKS, method="random", max_new_tokens=1)
    assert res.stats["cold_path"] == "stitched" and res.stats["store_misses"] == 1
    assert 0 < res.stats["store_missing_fraction"] <= 0.5
    eng.cold_path = "full_prefill"  # any miss -> full prefill
    eng.store.delete(keys[1])
    res = eng.generate(SAMPLE_QUESTION, SAMPLE_CHUNKS, method="random", max_new_tokens=1)
    assert res.stats["cold_path"] == "full_prefill" and res.stats["deferred_chunks"] == 1
    # a consumer that stops at the result leaves the chunks queued: precompute_deferred fills the store
    eng.store.delete(keys[2])
    gen = eng.stream(SAMPLE_QUESTION, SAMPLE_CHUNKS, method="random", max_new_tokens=1)
    for ev in gen:
        if not isinstance(ev, int):
            break
    gen.close()
    assert len(eng.deferred) == 1 and keys[2] not in eng.store
    assert eng.precompute_deferred() == 1 and keys[2] in eng.store and len(eng.deferred) == 0
    # Engine.prefill (eval harness, benches) always runs the method
    eng.store.delete(keys[3])
    pre = eng.prefill(layout, "random", 0.2, 1)
    assert pre.stats["store_misses"] == 1 and "cold_path" not in pre.stats
    with pytest.raises(InputError):
        _engine(smollm_tokenizer, cold_path="later")
    with pytest.raises(InputError):
        _engine(smollm_tokenizer, cold_threshold=1.5)


def test_bench_ttft_cold_half_rows(smollm_tokenizer):
    eng = _engine(smollm_tokenizer)
    rows = bench_ttft(eng, [300], ["random"], ratio=0.2, repeats=1, chunk_tokens=64, progress=False, cold=True)
    by = {r["method"]: r for r in rows}
    assert by["random" + COLD]["cold_path"] == "full_prefill" and by["random" + COLD]["store"] == "cold"
    assert by["random" + HALF]["cold_path"] == "stitched" and by["random" + HALF]["store"] == "half"
    assert by["random"]["cold_path"] == "stitched"
    assert by["random" + HALF]["chunk_load_s"] > by["random"]["chunk_load_s"]  # half computed on the path
