"""Batched sparse decode: decode steps of several requests, each with its own sparse policy state, run in
one forward (`Engine.decode_batch`); every batched answer equals the same request decoded alone."""

import pytest

from kvstitch.decode import make_policy
from kvstitch.engine.batch import DecodeStep
from kvstitch.engine import GenerationRequest, GenerationResult

from .conftest import SAMPLE_CHUNKS, SAMPLE_QUESTION, make_tiny_engine

# small pages, window and budget so that a few hundred context tokens are really selected from
SMALL = {"page_size": 8, "window": 16}
POLICIES = {"prkv": SMALL, "quest": SMALL, "arkvale": SMALL, "snapkv": {**SMALL, "refresh_interval": 5},
            "shadowkv": {"window": 16, "chunk_size": 8}}
QUESTIONS = [SAMPLE_QUESTION, "Where does Bob live?", "What opened near the park?", "Who lives in Paris?"]


def _context(i: int) -> list[str]:
    """Ragged contexts of a few hundred tokens (every request its own length)."""
    return [SAMPLE_CHUNKS[(i + j) % len(SAMPLE_CHUNKS)] for j in range(6 + 3 * i)]


def _request(i: int, decode: str, max_new: int, **kw) -> GenerationRequest:
    """``decode``'s small options: the policy's in its object, the decoder's page size in decode_options."""
    opts = POLICIES.get(decode, {})
    fields = {k: v for k, v in opts.items() if k != "page_size"}
    pages = {k: v for k, v in opts.items() if k == "page_size"}
    return GenerationRequest(question=QUESTIONS[i % len(QUESTIONS)], chunks=_context(i), method="random",
                             recompute_ratio=0.3, max_new_tokens=max_new,
                             decode=make_policy(decode, **fields) if fields else decode, kv_budget=48,
                             decode_options=pages or None, **kw)


def drive(engine, requests: list[GenerationRequest], cancel: dict | None = None) -> list:
    """A miniature batching consumer: every request's pending decode steps run in one `decode_batch` per token
    (what the server's worker does). ``cancel`` {i: n}: close request i after n tokens -> its tokens so far."""
    cancel = cancel or {}
    gens = [engine.steps(r, batch_decode=True) for r in requests]
    tokens = [[] for _ in requests]
    results: list = [None] * len(requests)
    pending: dict[int, DecodeStep] = {}
    sizes = []

    def pump(i, value=None):
        ev = gens[i].send(value)
        while True:
            if isinstance(ev, DecodeStep):
                pending[i] = ev
                return
            if isinstance(ev, GenerationResult):
                results[i] = ev
                return
            tokens[i].append(ev)
            if i in cancel and len(tokens[i]) >= cancel[i]:
                gens[i].close()
                results[i] = "cancelled"
                return
            ev = next(gens[i])

    for i in range(len(requests)):
        pump(i)
    while pending:
        order = sorted(pending)
        steps = [pending.pop(i) for i in order]
        sizes.append(len(steps))
        for i, lg in zip(order, engine.decode_batch(steps)):
            pump(i, lg)
    return results, tokens, sizes


@pytest.fixture(scope="module")
def engine(smollm_tokenizer):
    return make_tiny_engine("llama", smollm_tokenizer)


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_batched_policy_equals_alone(engine, policy):
    """Four ragged requests of one policy, decoded together == each decoded alone (one finishes early)."""
    reqs = [_request(i, policy, 10 + 4 * i) for i in range(4)]
    alone = [engine.run(r) for r in reqs]
    results, tokens, sizes = drive(engine, reqs)
    for r, a, t in zip(results, alone, tokens):
        assert r.token_ids == a.token_ids == t and r.text == a.text
        fields = {k: v for k, v in POLICIES[policy].items() if k != "page_size"}  # page_size: the decoder's
        assert r.stats["batched_decode"] and make_policy(r.stats["decode_policy"]) == make_policy(policy, **fields)
    assert max(sizes) == 4 and sizes[-1] == 1  # shared passes, and the longest request ended alone
    sel, ctx = results[-1].stats["decoder"]["mean_selected_tokens"], results[-1].stats["context_tokens"]
    assert sel < 0.6 * ctx  # the policy really selected: fewer tokens than the context


def test_mixed_policies_dense_and_cancellation_in_one_batch(engine):
    """Every policy and dense decode in the same passes; one request cancelled mid-answer leaves the others
    untouched; a request that ends early leaves the batch."""
    names = ["dense", *sorted(POLICIES)]
    reqs = [_request(i, name, 6 + 3 * (i % 4)) for i, name in enumerate(names)]
    alone = [engine.run(r) for r in reqs]
    results, tokens, sizes = drive(engine, reqs, cancel={2: 3})
    assert results[2] == "cancelled" and tokens[2] == alone[2].token_ids[:3]
    for i, (r, a) in enumerate(zip(results, alone)):
        if i != 2:
            assert r.token_ids == a.token_ids, names[i]
    assert sizes[0] == len(reqs) and sizes[-1] < len(reqs)


def test_decode_batch_refuses_a_step_whose_cache_does_not_hand_its_kv_to_the_decoder(engine):
    from kvstitch.core.errors import InputError

    pre = engine.prefill(engine.layout(SAMPLE_QUESTION, _context(0)), "random", 0.3, 4)
    dec = engine.make_decoder(pre.cache, "quest", 48, prompt_ids=pre.layout.ids, **SMALL)
    with pytest.raises(InputError, match="decoder"):
        engine.decode_batch([DecodeStep(pre.cache, 1, dec)])  # cache.decoder is None


def test_released_cache_holds_no_kv_and_the_decoder_reserves_the_answer(engine):
    """With ``release`` the stitched cache gives its K/V up to the decoder (never held twice); the decoder's
    pools have room for ``reserve_tokens`` decoded tokens, so decoding never grows them."""
    pre = engine.prefill(engine.layout(SAMPLE_QUESTION, _context(1)), "random", 0.3, 40)
    n = pre.cache.length
    dec = engine.make_decoder(pre.cache, "prkv", 48, prompt_ids=pre.layout.ids, reserve_tokens=40, release=True,
                              **SMALL)
    assert all(layer.keys.numel() == 0 and layer.length == n for layer in pre.cache.layers)
    before = dec.kv_bytes()
    assert before["host"] >= 2 * engine.adapter.num_layers * (n + 40) * 2 * 16 * 4
    for st in dec.layers:
        assert st.host.capacity_pages * 8 >= n + 40
    pre.cache.decoder = dec
    tok = int(pre.logits[-1].argmax())
    for _ in range(40):
        tok = int(engine.decode_batch([DecodeStep(pre.cache, tok, dec)])[0][-1].argmax())
        dec.end_step()
    assert dec.kv_bytes() == before  # nothing grew
    sel, ctx = dec.selection_totals()
    assert 0 < sel < ctx
