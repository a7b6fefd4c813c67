"""Compatibility: the official `openai` Python client against `kvstitch serve` (the tiny llama engine of
tests/test_server.py on a loopback port): system prompt + history + documents, plain chat, streaming with
include_usage, stop sequences, a history that changes the answer, refused parameters."""

from __future__ import annotations

import openai
import pytest

from .conftest import SAMPLE_CHUNKS
from .test_chat import HISTORY, SYSTEM, template_ids, with_passages


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


DOCS = {"documents": SAMPLE_CHUNKS, "method": "random", "ratio": 0.5}


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list()] == ["tiny-llama"]


def test_system_prompt_history_and_documents(client, engine):
    r = client.chat.completions.create(model="tiny-llama", messages=HISTORY, max_tokens=8, extra_body=DOCS)
    ref = engine.generate(messages=HISTORY, chunks=SAMPLE_CHUNKS, method="random", recompute_ratio=0.5,
                          max_new_tokens=8)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref.text
    assert r.choices[0].finish_reason in ("stop", "length")
    expected = template_ids(engine.tokenizer, [with_passages(SYSTEM, SAMPLE_CHUNKS)] + HISTORY[1:])
    assert r.usage.prompt_tokens == len(expected)
    assert r.usage.completion_tokens == len(ref.token_ids)
    assert r.model_extra["kvstitch"]["method"] == "random"


def test_plain_chat(client, engine):
    r = client.chat.completions.create(model="tiny-llama", messages=HISTORY, max_tokens=6)
    assert r.choices[0].message.content == engine.generate(messages=HISTORY, method="full", max_new_tokens=6).text
    assert r.usage.prompt_tokens == len(template_ids(engine.tokenizer, HISTORY))
    assert r.model_extra["kvstitch"]["method"] == "full"


def test_streaming_with_include_usage(client):
    full = client.chat.completions.create(model="tiny-llama", messages=HISTORY, max_tokens=10, extra_body=DOCS)
    chunks = list(client.chat.completions.create(model="tiny-llama", messages=HISTORY, max_tokens=10,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body=DOCS))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert chunks[-1].usage.total_tokens == full.usage.total_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_stop_sequences(client, stream):
    free = client.chat.completions.create(model="tiny-llama", messages=HISTORY, max_tokens=16, extra_body=DOCS)
    text = free.choices[0].message.content
    stop = next(w for w in text.split() if text.find(w) > 0)[:3]
    kw = dict(model="tiny-llama", messages=HISTORY, max_tokens=16, stop=[stop, "\n\n\n"], extra_body=DOCS)
    if stream:
        parts = list(client.chat.completions.create(stream=True, **kw))
        got = "".join(c.choices[0].delta.content or "" for c in parts if c.choices)
        finish = [c.choices[0].finish_reason for c in parts if c.choices and c.choices[0].finish_reason]
    else:
        r = client.chat.completions.create(**kw)
        got, finish = r.choices[0].message.content, [r.choices[0].finish_reason]
        assert r.usage.completion_tokens < free.usage.completion_tokens
    assert got == text[:text.find(stop)] and finish == ["stop"]
    single = client.chat.completions.create(model="tiny-llama", messages=HISTORY, max_tokens=16, stop=stop,
                                            extra_body=DOCS)
    assert single.choices[0].message.content == text[:text.find(stop)]


def test_history_changes_the_answer(client):
    last = HISTORY[-1]
    other = [HISTORY[0], {"role": "user", "content": "Where does Alice live?"},
             {"role": "assistant", "content": "In Paris."}, last]
    answers = [client.chat.completions.create(model="tiny-llama", messages=m, max_tokens=8, extra_body=DOCS)
               .choices[0].message.content for m in (HISTORY, other, [HISTORY[0], last])]
    assert len(set(answers)) == 3, answers  # same last question, different histories -> different answers


def test_seed_is_honoured(client):
    kw = dict(model="tiny-llama", messages=HISTORY, max_tokens=8, temperature=1.0, extra_body=DOCS)
    a = client.chat.completions.create(seed=11, **kw).choices[0].message.content
    b = client.chat.completions.create(seed=11, **kw).choices[0].message.content
    others = {client.chat.completions.create(seed=s, **kw).choices[0].message.content for s in (12, 13, 14)}
    assert a == b and others != {a}


@pytest.mark.parametrize("kw,param", [(dict(presence_penalty=0.6), "presence_penalty"),
                                      (dict(frequency_penalty=0.5), "frequency_penalty"),
                                      (dict(logit_bias={"42": 10}), "logit_bias"),
                                      (dict(extra_body={"best_of": 2}), "best_of")])
def test_unsupported_parameters_are_400s_naming_them(client, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny-llama", messages=HISTORY, max_tokens=2, **kw)
    assert e.value.status_code == 400 and e.value.param == param and param in e.value.message
