"""Conversations: the chat template over every message with the passages after the system prompt,
token-exact; the system prompt cached as a stitched segment; exactness at 100% recompute; the server's
conversation handling (usage, plain chat, stop sequences, refused parameters)."""

from __future__ import annotations

import uuid

import httpx
import pytest
import torch

from kvstitch.engine import STOP
from kvstitch.core.errors import InputError
from kvstitch.core.prompt import DOCS_HEADER, PromptBuilder
from kvstitch.serve.defaults import ChatDefaults, decode_policies
from kvstitch.serve.schema import parse_chat_body
from kvstitch.serve.stops import TextStream

from .conftest import SAMPLE_CHUNKS, TINY
from .test_server import read_sse

ATOL = 1e-3
SYSTEM = "You are a terse assistant. Answer in a few words."
HISTORY = [{"role": "system", "content": SYSTEM},
           {"role": "user", "content": "Who lives in Rome?"},
           {"role": "assistant", "content": "Bob."},
           {"role": "user", "content": "What is the special magic number for Carol?"}]


def template_ids(tok, messages) -> list[int]:
    out = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def with_passages(system: str | None, docs: list[str]) -> dict:
    """The system message with the passages inserted, written out by hand (the documented layout)."""
    head = f"{system}\n\n{DOCS_HEADER}" if system else DOCS_HEADER
    return {"role": "system", "content": head + "".join(f"\n\n{d}" for d in docs)}


@pytest.fixture(scope="module")
def builder(smollm_tokenizer):
    b = PromptBuilder(smollm_tokenizer)
    assert b.separator == ("lead", "\n\n")  # the layout `with_passages` writes out
    return b


# ---- the prompt ---------------------------------------------------------------------------------------
def test_multi_turn_prompt_is_the_chat_template_token_exact(builder, smollm_tokenizer):
    tool = [{"role": "assistant", "content": None,
             "tool_calls": [{"type": "function", "function": {"name": "lookup", "arguments": "{\"q\": \"x\"}"}}]},
            {"role": "tool", "content": "lookup says 42"}, {"role": "user", "content": "And then?"}]
    cases = [
        (HISTORY, SAMPLE_CHUNKS, [with_passages(SYSTEM, SAMPLE_CHUNKS)] + HISTORY[1:]),
        (HISTORY[1:], SAMPLE_CHUNKS, [with_passages(None, SAMPLE_CHUNKS)] + HISTORY[1:]),  # system added
        ([{"role": "developer", "content": SYSTEM}] + HISTORY[1:], SAMPLE_CHUNKS[:1],
         [with_passages(SYSTEM, SAMPLE_CHUNKS[:1])] + HISTORY[1:]),
        (HISTORY + tool, SAMPLE_CHUNKS[:2],
         [with_passages(SYSTEM, SAMPLE_CHUNKS[:2])] + HISTORY[1:] +
         [{"role": "assistant", "content": "\n[tool call] lookup({\"q\": \"x\"})"}, tool[1], tool[2]]),
        (HISTORY, None, HISTORY),  # plain chat with a system prompt
        (HISTORY[1:], None, HISTORY[1:]),  # plain chat: the template's own default system prompt
    ]
    for messages, docs, expected in cases:
        layout = builder.build_messages(messages, docs)
        assert layout.ids.tolist() == template_ids(smollm_tokenizer, expected), (messages, docs)
        assert layout.ids.tolist() == template_ids(smollm_tokenizer, builder.conversation_messages(messages, docs))


def test_conversation_layout_segments(builder, smollm_tokenizer):
    tok = smollm_tokenizer
    a = builder.build_messages(HISTORY, SAMPLE_CHUNKS)
    b = builder.build_messages([{"role": "system", "content": "Another app, another prompt."}] + HISTORY[1:3] +
                               [{"role": "user", "content": "Where does Alice live?"}], SAMPLE_CHUNKS)
    # one canonical prefix for every conversation: chunk caches do not depend on the system prompt
    assert torch.equal(a.prefix_ids, b.prefix_ids) and torch.equal(a.prefix_ids, builder.chat_prefix_ids())
    assert tok.decode(a.prefix_ids) == "<|im_start|>system\n"
    assert a.pinned == 1 and len(a.chunk_ids) == 1 + len(SAMPLE_CHUNKS)
    assert tok.decode(a.chunk_ids[0]) == f"{SYSTEM}\n\n{DOCS_HEADER}"  # segment 0: the system prompt
    for i, text in enumerate(SAMPLE_CHUNKS):  # the passages: the same ids as in the question layout
        assert torch.equal(a.chunk_ids[1 + i], builder.encode_chunk(text))
        assert torch.equal(a.chunk_ids[1 + i], b.chunk_ids[1 + i])
    # the suffix is the conversation tail: every later turn + the assistant header (what selectors query)
    suffix = tok.decode(a.suffix_ids)
    assert suffix.startswith("<|im_end|>\n<|im_start|>user\nWho lives in Rome?")
    assert "Bob." in suffix and suffix.endswith("What is the special magic number for Carol?<|im_end|>\n"
                                                "<|im_start|>assistant\n")
    # a reordering selector cannot move the system segment
    with pytest.raises(ValueError, match="pinned"):
        a.reordered([1, 0, 2, 3, 4])
    assert a.reordered([0, 4, 3, 2, 1]).pinned == 1
    assert len(builder.canonical_prefixes()) == 2


@pytest.mark.parametrize("messages,chunks,message", [
    ([], None, "non-empty list"),
    ([{"role": "system", "content": "x"}], None, "no 'user' message"),
    ([{"role": "user", "content": "  "}], None, "last user message is empty"),
    ([{"role": "robot", "content": "x"}], None, "unknown role 'robot'"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], None, "only text content"),
    ([{"role": "user", "content": "a\x00b"}], None, "NUL"),
    ([{"role": "user", "content": "q?"}], ["ok", " "], "chunk 1 is empty"),
])
def test_bad_conversations_are_input_errors(builder, messages, chunks, message):
    with pytest.raises(InputError, match=message):
        builder.build_messages(messages, chunks)


# ---- the engine ---------------------------------------------------------------------------------------
def test_question_or_messages_exactly_one(engine):
    with pytest.raises(InputError, match="not both"):
        engine.generate("q?", SAMPLE_CHUNKS, messages=HISTORY)
    with pytest.raises(InputError, match="pass a question or messages"):
        engine.generate(chunks=SAMPLE_CHUNKS)


def test_system_prompt_is_a_cached_segment_and_chunks_are_shared_across_system_prompts(engine):
    tag = uuid.uuid4().hex
    docs = [f"{d} (Edition {tag}.)" for d in SAMPLE_CHUNKS]
    sys_a = [{"role": "system", "content": f"You are app A ({tag})."}]
    sys_b = [{"role": "system", "content": f"You are app B ({tag})."}]
    first = engine.generate(messages=sys_a + HISTORY[1:], chunks=docs, method="random", max_new_tokens=2)
    assert (first.stats["store_hits"], first.stats["store_misses"]) == (0, 1 + len(docs))
    layout = engine.layout(None, docs, sys_a + HISTORY[1:])
    assert engine.chunk_key(layout.prefix_ids, layout.chunk_ids[0]) in engine.store
    # the same system prompt in another conversation: a store hit the second time (chunks too)
    again = engine.generate(messages=sys_a + [{"role": "user", "content": "Who lives in Rome?"}], chunks=docs[:2],
                            method="random", max_new_tokens=2)
    assert (again.stats["store_hits"], again.stats["store_misses"]) == (3, 0)
    # another application's system prompt reuses every chunk cache: only its own segment is computed
    other = engine.generate(messages=sys_b + HISTORY[1:], chunks=docs, method="random", max_new_tokens=2)
    assert (other.stats["store_hits"], other.stats["store_misses"]) == (len(docs), 1)


@pytest.mark.parametrize("tiny_engine", TINY, indirect=True)
def test_multi_turn_full_recompute_equals_full_prefill(tiny_engine):
    kw = dict(messages=HISTORY, chunks=SAMPLE_CHUNKS, max_new_tokens=8)
    full = tiny_engine.generate(method="full", **kw)
    for method in ("random", "prophet"):
        stitched = tiny_engine.generate(method=method, recompute_ratio=1.0, **kw)
        diff = (full.first_logits - stitched.first_logits).abs().max().item()
        assert diff <= ATOL, (method, diff)
        assert stitched.token_ids == full.token_ids and stitched.text == full.text
        assert len(stitched.recomputed) == stitched.stats["context_tokens"]
    # the prompt full prefill ran over counts every message
    assert full.stats["prefix_tokens"] + full.stats["context_tokens"] + full.stats["suffix_tokens"] == \
        len(template_ids(tiny_engine.tokenizer, tiny_engine.builder.conversation_messages(HISTORY, SAMPLE_CHUNKS)))


def test_system_segment_cache_is_exact(engine):
    """Segment 0 sits right after the prefix it was precomputed against: naive stitching of the system
    prompt alone (no passages) equals full prefill."""
    msgs = [{"role": "system", "content": "You are a pirate. Speak like one."}, {"role": "user", "content": "Hi!"}]
    full = engine.generate(messages=msgs, method="full", max_new_tokens=4)
    naive = engine.generate(messages=msgs, method="naive", max_new_tokens=4)
    assert naive.stats["chunks"] == 1 and naive.stats["recomputed_tokens"] == 0
    assert (full.first_logits - naive.first_logits).abs().max().item() <= ATOL


def test_stream_stops_when_the_consumer_sends_stop(engine):
    ref = engine.generate(messages=HISTORY, chunks=SAMPLE_CHUNKS, method="naive", max_new_tokens=6)
    gen = engine.stream(messages=HISTORY, chunks=SAMPLE_CHUNKS, method="naive", max_new_tokens=6)
    a, b = next(gen), next(gen)
    res = gen.send(STOP)
    assert res.token_ids == [a, b] == ref.token_ids[:2] and res.stats["decode_tokens"] == 2
    gen = engine.stream(messages=HISTORY, chunks=SAMPLE_CHUNKS, method="naive", max_new_tokens=6)
    assert gen.send(None) == ref.token_ids[0] and gen.send(STOP).token_ids == ref.token_ids[:1]


def test_real_model_history_changes_the_answer_and_full_recompute_is_exact(smollm):
    """The issue's failure: "Who built it?" -> "Tomas Reyne." -> "When?" must see the history."""
    docs = ["The Reyne Tower in Alder Bay was designed and built by the engineer Tomas Reyne.",
            "Construction of the Reyne Tower finished in 1891, after six years of work.",
            "Alder Bay is a fishing town known for its winter market and its lighthouse."]
    system = {"role": "system", "content": "You are a helpful assistant. Answer briefly."}
    history = [system, {"role": "user", "content": "Who built the Reyne Tower?"},
               {"role": "assistant", "content": "Tomas Reyne."}, {"role": "user", "content": "When?"}]
    full = smollm.generate(messages=history, chunks=docs, method="full", max_new_tokens=16)
    alone = smollm.generate(messages=[system, history[-1]], chunks=docs, method="full", max_new_tokens=16)
    assert "1891" in full.text and "1891" not in alone.text and full.text != alone.text
    stitched = smollm.generate(messages=history, chunks=docs, method="prophet", recompute_ratio=1.0,
                               max_new_tokens=16)
    assert stitched.token_ids == full.token_ids
    assert (stitched.first_logits - full.first_logits).abs().max().item() <= ATOL


# ---- the server ---------------------------------------------------------------------------------------
def _body(**kw):
    body = {"model": "tiny-llama", "messages": HISTORY, "documents": SAMPLE_CHUNKS, "max_tokens": 8,
            "method": "random", "ratio": 0.5}
    body.update(kw)
    return {k: v for k, v in body.items() if v is not None}


def test_server_prompt_ids_are_the_chat_template_and_usage_counts_every_message(server, engine):
    body = _body()
    req = parse_chat_body(body, ChatDefaults.of("random", 0.2, "full", policies=decode_policies()))
    assert req.question == HISTORY[-1]["content"] and req.stop == []
    ids = engine.layout(None, req.documents, req.messages).ids.tolist()  # what the worker hands the engine
    assert ids == template_ids(engine.tokenizer, [with_passages(SYSTEM, SAMPLE_CHUNKS)] + HISTORY[1:])
    with httpx.Client(base_url=server.url, timeout=120) as c:
        long = c.post("/v1/chat/completions", json=body).json()
        short = c.post("/v1/chat/completions", json=_body(messages=[HISTORY[0], HISTORY[-1]])).json()
    assert long["usage"]["prompt_tokens"] == len(ids)
    history_tokens = len(template_ids(engine.tokenizer, HISTORY)) - len(template_ids(engine.tokenizer,
                                                                                      [HISTORY[0], HISTORY[-1]]))
    assert long["usage"]["prompt_tokens"] - short["usage"]["prompt_tokens"] == history_tokens > 0
    assert long["choices"][0]["message"]["content"] == engine.generate(
        messages=HISTORY, chunks=SAMPLE_CHUNKS, method="random", recompute_ratio=0.5, max_new_tokens=8).text


def test_server_plain_chat_is_full_prefill(server, engine):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        r = c.post("/v1/chat/completions", json=_body(documents=None, method=None, ratio=None))
    assert r.status_code == 200, r.text
    out = r.json()
    ref = engine.generate(messages=HISTORY, method="full", max_new_tokens=8)
    assert out["choices"][0]["message"]["content"] == ref.text
    assert out["kvstitch"]["method"] == "full" and out["kvstitch"]["context_tokens"] == len(
        engine.layout(None, None, HISTORY).chunk_ids[0])  # the system prompt only
    assert out["usage"]["prompt_tokens"] == len(template_ids(engine.tokenizer, HISTORY))


def _stop_for(text: str) -> str:
    """A stop string that occurs in ``text`` after its start (the tiny model's greedy output)."""
    words = [w for w in text.split() if text.find(w) > 0]
    assert words, text
    return words[0][:3]


@pytest.mark.parametrize("stream", [False, True])
def test_server_stop_cuts_the_text_with_finish_reason_stop(server, stream):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        free = c.post("/v1/chat/completions", json=_body(max_tokens=16)).json()
        text = free["choices"][0]["message"]["content"]
        stop = _stop_for(text)
        expected = text[:text.find(stop)]
        body = _body(max_tokens=16, stop=["never-in-the-text", stop], stream=stream)
        if stream:
            body["stream_options"] = {"include_usage": True}
            with c.stream("POST", "/v1/chat/completions", json=body) as s:
                got, events = read_sse(s)
            finish = [e["choices"][0]["finish_reason"] for e in events if e["choices"]
                      and e["choices"][0]["finish_reason"]]
            usage = events[-1]["usage"]
        else:
            out = c.post("/v1/chat/completions", json=body).json()
            got, finish, usage = out["choices"][0]["message"]["content"], [out["choices"][0]["finish_reason"]], \
                out["usage"]
    assert got == expected and stop not in got
    assert finish == ["stop"]
    assert usage["completion_tokens"] < free["usage"]["completion_tokens"]  # generation really ended early


def test_text_stream_never_sends_text_past_a_stop_string(engine):
    tok = engine.tokenizer
    text = "The answer is 42.\nUser: and now something else"
    ids = tok.encode(text, add_special_tokens=False)
    for stop in (["\nUser:"], ["User"], ["42", "zzz"], ["else"], ["nothing-matches"]):
        ts = TextStream(tok, engine.eos_ids, stop)
        sent = ""
        for i in ids:
            sent += ts.push(i)
            idx = min((text.find(s) for s in stop if s in text), default=len(text))
            assert len(sent) <= idx, (stop, sent)  # never past the stop; partial matches held back
        final = text[:min((text.find(s) for s in stop if s in text), default=len(text))]
        assert sent + ts.finish(final) == final


@pytest.mark.parametrize("param,value", [("presence_penalty", 0.5), ("frequency_penalty", 1.0),
                                         ("best_of", 2), ("logit_bias", {"1": 3}), ("n", 3),
                                         ("response_format", {"type": "json_object"})])
def test_server_unsupported_parameter_is_a_400_naming_it(server, param, value):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        r = c.post("/v1/chat/completions", json=_body(**{param: value}))
        ok = c.post("/v1/chat/completions", json=_body(max_tokens=1, presence_penalty=0, frequency_penalty=0.0,
                                                        n=1, user="u1", stop=None))
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"] and err["code"] == "unsupported_parameter"
    assert ok.status_code == 200, ok.text  # neutral values are accepted
