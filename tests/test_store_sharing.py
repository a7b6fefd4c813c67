"""Store keys fit for sharing: the key names weights, tokenizer, dtype and chunk ids; two engines with
different models on one Redis never read each other's entries; `store stats` groups entries by model."""

from __future__ import annotations

import copy

import pytest
import torch
from typer.testing import CliRunner

from kvstitch.core.identity import tokenizer_fingerprint
from kvstitch.store import MemoryStore, RedisStore, chunk_key

from .conftest import SAMPLE_CHUNKS, SAMPLE_QUESTION, make_tiny_engine


def test_chunk_key_names_the_tokenizer(smollm_tokenizer):
    base = chunk_key("fp", [1, 2], [3, 4], "float16")
    assert chunk_key("fp", [1, 2], [3, 4], "float16", tokenizer="") == base  # unnamed: the old key
    a = chunk_key("fp", [1, 2], [3, 4], "float16", tokenizer="tokA")
    b = chunk_key("fp", [1, 2], [3, 4], "float16", tokenizer="tokB")
    assert len({base, a, b}) == 3
    t1 = tokenizer_fingerprint(smollm_tokenizer)
    assert t1 == tokenizer_fingerprint(copy.deepcopy(smollm_tokenizer))  # deterministic
    other = copy.deepcopy(smollm_tokenizer)
    other.add_tokens(["<kvstitch-extra-token>"])
    assert tokenizer_fingerprint(other) != t1  # a vocabulary change is a different tokenizer


def test_memory_store_groups_by_model_and_names_models(smollm_tokenizer):
    eng = make_tiny_engine("qwen2", smollm_tokenizer)
    eng.store = MemoryStore(storage_dtype="float32")
    eng.store.register_model({"fingerprint": eng.fingerprint, "name": "tiny-qwen2"})
    eng.chunk_kvs(eng.layout("q?", SAMPLE_CHUNKS[:2]))
    s = eng.store.stats()
    assert s["by_model"] == {eng.fingerprint: {"name": "tiny-qwen2", "entries": 2, "bytes": s["by_model"][
        eng.fingerprint]["bytes"], "tokens": s["by_model"][eng.fingerprint]["tokens"]}}
    assert s["by_model"][eng.fingerprint]["tokens"] == sum(
        int(i.numel()) for i in eng.layout("q?", SAMPLE_CHUNKS[:2]).chunk_ids)


def _spy_gets(store):
    seen = []
    orig = store.get

    def get(key):
        seen.append(key)
        return orig(key)
    store.get = get
    return seen


@pytest.mark.slow
def test_two_models_share_one_redis_without_reading_each_other(redis_url, smollm, smollm_tokenizer):
    from kvstitch import Engine

    url = redis_url.rsplit("/", 1)[0] + "/3"
    RedisStore(url)._r.flushdb()
    big = Engine(smollm.model, smollm.tokenizer, smollm.weights_id, store=RedisStore(url, compute_dtype=torch.float32))
    tiny_src = make_tiny_engine("llama", smollm_tokenizer)
    tiny = Engine(tiny_src.model, smollm_tokenizer, "tiny-llama", store=RedisStore(url, compute_dtype=torch.float32))
    assert big.fingerprint != tiny.fingerprint and big.tokenizer_id == tiny.tokenizer_id
    seen_big, seen_tiny = _spy_gets(big.store), _spy_gets(tiny.store)
    chunks = SAMPLE_CHUNKS[:3]
    for eng in (big, tiny, big, tiny):  # second round: all hits
        res = eng.generate(SAMPLE_QUESTION, chunks, method="random", recompute_ratio=0.2, max_new_tokens=2)
    assert res.stats["store_hits"] == 3 and res.stats["store_misses"] == 0
    keys_big = {big.chunk_key(big.builder.prefix_ids, i) for i in big.layout("q", chunks).chunk_ids}
    keys_tiny = {tiny.chunk_key(tiny.builder.prefix_ids, i) for i in tiny.layout("q", chunks).chunk_ids}
    assert len(keys_big) == len(keys_tiny) == 3 and not keys_big & keys_tiny  # same text, different keys
    assert set(seen_big) == keys_big and set(seen_tiny) == keys_tiny  # never looked at the other's entries
    assert big.store.problems == [] and tiny.store.problems == []  # no foreign entry was even met
    assert set(RedisStore(url).keys()) == keys_big | keys_tiny
    by_model = RedisStore(url).stats()["by_model"]
    assert {fp: d["entries"] for fp, d in by_model.items()} == {big.fingerprint: 3, tiny.fingerprint: 3}
    assert by_model[big.fingerprint]["name"].lower().startswith("smollm2")
    from kvstitch.cli.main import app

    out = CliRunner().invoke(app, ["store", "stats", url])
    assert out.exit_code == 0, out.output
    assert "by model" in out.output and big.fingerprint[:16] in out.output and tiny.fingerprint[:16] in out.output


def test_redis_budget_evicts_unpinned_lru_and_keeps_pins(redis_url):
    import time

    from kvstitch.core.chunk import ChunkKV

    def kv(i):
        g = torch.Generator().manual_seed(i)
        return ChunkKV(torch.randn(2, 2, 32, 8, generator=g), torch.randn(2, 2, 32, 8, generator=g),
                       torch.arange(32), 4, "m")

    url = redis_url.rsplit("/", 1)[0] + "/7"
    RedisStore(url)._r.flushdb()
    keys = [chunk_key("m", [1], [i], "float16") for i in range(8)]
    probe = RedisStore(url)
    probe.put(keys[0], kv(0))
    one = probe._r.strlen(probe.prefix + keys[0])
    probe.pin(keys[0])
    s = RedisStore(url, max_bytes=4 * one)
    for i, k in enumerate(keys[1:], 1):
        s.put(k, kv(i))
        time.sleep(1.1 if i == 1 else 0)  # OBJECT IDLETIME has 1 s resolution: keys[1] is the oldest unpinned
    left = set(s.keys())
    assert keys[0] in left and keys[7] in left and keys[1] not in left  # pinned kept; LRU among the unpinned
    assert sum(s._r.strlen(s.prefix + k) for k in left) <= 4 * one
