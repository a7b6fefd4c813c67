"""`GenerationResult.stats` is a `GenerationStats`: every key the engine writes is a typed field (only the
method's own keys land in ``extra``), `to_dict` is its JSON form, and reading it as a mapping still works."""

import json

import pytest

from kvstitch import AutoBudget, Engine, GenerationStats
from kvstitch.engine.stats import FIELDS
from kvstitch.store import MemoryStore

from .conftest import SAMPLE_CHUNKS, SAMPLE_QUESTION, make_tiny_engine

ARGS = dict(question=SAMPLE_QUESTION, chunks=SAMPLE_CHUNKS, max_new_tokens=5)
# every engine feature that reports something: stitched, adaptive (verified too), guard, sparse decoding with
# its recall diagnostic, full prefill
REQUESTS = [
    dict(method="random", recompute_ratio=0.3),
    dict(method="prophet", recompute_ratio=AutoBudget(min_context=0, schedule=(0.1, 0.3))),
    dict(method="prophet", recompute_ratio=AutoBudget(min_context=0, verify_chunks=1)),
    dict(method="prophet", recompute_ratio=AutoBudget(min_context=10_000)),
    dict(method="random", recompute_ratio=0.2, guard="full"),
    dict(method="random", recompute_ratio=0.2, decode="prkv", kv_budget=64, decode_options={"diagnostic": True}),
    dict(method="full"),
]


@pytest.mark.parametrize("req", REQUESTS, ids=lambda r: ",".join(f"{k}={v}" for k, v in r.items())[:60])
def test_every_key_the_engine_writes_is_a_field(smollm_tokenizer, req):
    eng = make_tiny_engine("llama", smollm_tokenizer)
    res = eng.generate(**ARGS, **req)
    st = res.stats
    assert isinstance(st, GenerationStats)
    assert st.extra == {}, f"engine keys without a field: {sorted(st.extra)}"
    assert st.ttft_s == res.ttft_s > 0 and st.method == res.method and st.decode_tokens == len(res.token_ids)
    assert st.context_tokens > 0 and st.recomputed_tokens == len(res.recomputed)
    d = st.to_dict()
    assert json.loads(json.dumps(d)) == d  # JSON as it is
    assert GenerationStats.from_dict(d) == st
    assert (st.converged is not None) == isinstance(req.get("recompute_ratio"), AutoBudget)
    assert (st.guard is not None) == ("guard" in req)
    if "decode_options" in req:
        assert st.decode_policy == "prkv" and st.kv_budget == 64 and st.decoder and st.decode_recall


def test_cold_path_keys_are_fields(smollm_tokenizer):
    base = make_tiny_engine("llama", smollm_tokenizer)
    eng = Engine(base.model, base.tokenizer, weights_id="tiny-llama", store=MemoryStore(storage_dtype="float32"),
                 check_rope=False, cold_path="full_prefill")
    st = eng.generate(**ARGS, method="prophet", recompute_ratio=0.2).stats
    assert st.extra == {} and st.cold_path == "full_prefill" and st.deferred_chunks == len(SAMPLE_CHUNKS)
    assert st.store_missing_fraction == 1.0 and st.ratio_used == 1.0


def test_method_keys_go_to_extra_and_read_as_keys(smollm_tokenizer):
    eng = make_tiny_engine("llama", smollm_tokenizer)
    st = eng.generate(**ARGS, method="infoflow", recompute_ratio=0.3).stats
    assert "infoflow_layers" in st.extra and not FIELDS.keys() & st.extra.keys()
    assert st["infoflow_layers"] == st.extra["infoflow_layers"] == st.to_dict()["infoflow_layers"]


def test_mapping_access_reads_the_fields(smollm_tokenizer):
    """The deprecated string reads: a field is its key, an unreported one a missing key."""
    eng = make_tiny_engine("llama", smollm_tokenizer)
    st = eng.generate(**ARGS, method="random", recompute_ratio=0.3).stats
    assert st["ratio_used"] == st.ratio_used and st.get("store_hits") == st.store_hits
    assert "converged" not in st and st.get("converged") is None and st.get("guard", {}) == {}
    with pytest.raises(KeyError):
        st["guard"]
    assert {**st} == dict(st) == st.to_dict() and len(st) == len(st.to_dict())
    st["retrieved"] = ["doc"]  # what callers add lands in extra
    st["converged"] = True  # a field, set by its key
    assert st.extra == {"retrieved": ["doc"]} and st.converged is True and "converged" in st
    del st["converged"]
    assert st.converged is None and "converged" not in st
