"""Every malformed chat body the suite sends (and the variants of each check), posted to the server over the
tiny model: each gets the status, error type, ``code`` and ``param`` it has always got, as JSON and when
streaming (an error is never a half-open stream)."""

from __future__ import annotations

import json
import os

import httpx
import pytest

from .conftest import SAMPLE_CHUNKS
from .test_server import LONG_DOC, chat_body

USER = [{"role": "user", "content": "q?"}]
NAN_BODY = json.dumps({"messages": USER, "documents": ["d"]})[:-1].encode() + b', "temperature": NaN}'
_INV, _UNS = "invalid_request", "unsupported_parameter"

# (name, a raw body or the change to a good body, (status, code, param)); a None value drops the field
BODIES = [
    # the body itself
    ("malformed-json", b'{"messages": [', (400, "invalid_json", None)),
    ("truncated-json", b"{", (400, "invalid_json", None)),
    ("not-an-object", b"[1, 2]", (400, _INV, None)),
    ("a-string", b'"hi"', (400, _INV, None)),
    ("null", b"null", (400, _INV, None)),
    ("nan-temperature", NAN_BODY, (400, _INV, "temperature")),
    # messages
    ("no-messages", dict(messages=[]), (400, _INV, "messages")),
    ("messages-missing", dict(messages=None), (400, _INV, "messages")),
    ("messages-string", dict(messages="hi"), (400, _INV, "messages")),
    ("messages-of-strings", dict(messages=["hi"]), (400, _INV, "messages")),
    ("no-user", dict(messages=[{"role": "system", "content": "x"}]), (400, _INV, "messages")),
    ("bad-role", dict(messages=[{"role": "robot", "content": "x"}]), (400, _INV, "messages")),
    ("blank-user", dict(messages=[{"role": "user", "content": "  "}]), (400, _INV, "messages")),
    ("number-content", dict(messages=[{"role": "user", "content": 5}]), (400, _INV, "messages")),
    ("nul-content", dict(messages=[{"role": "user", "content": "a\x00b"}]), (400, _INV, "messages")),
    # unknown parameters, unsupported values
    ("unknown-param", dict(best_of=3), (400, _UNS, "best_of")),
    ("unknown-param-2", dict(foo=1), (400, _UNS, "foo")),
    ("n-2", dict(n=2), (400, _UNS, "n")),
    ("n-3", dict(n=3), (400, _UNS, "n")),
    ("presence-penalty", dict(presence_penalty=0.5), (400, _UNS, "presence_penalty")),
    ("presence-penalty-2", dict(presence_penalty=0.6), (400, _UNS, "presence_penalty")),
    ("frequency-penalty", dict(frequency_penalty=-1), (400, _UNS, "frequency_penalty")),
    ("frequency-penalty-2", dict(frequency_penalty=1.0), (400, _UNS, "frequency_penalty")),
    ("frequency-penalty-3", dict(frequency_penalty=0.5), (400, _UNS, "frequency_penalty")),
    ("logit-bias", dict(logit_bias={"42": 5}), (400, _UNS, "logit_bias")),
    ("logit-bias-2", dict(logit_bias={"1": 3}), (400, _UNS, "logit_bias")),
    ("logit-bias-3", dict(logit_bias={"42": 10}), (400, _UNS, "logit_bias")),
    ("json-mode", dict(response_format={"type": "json_object"}), (400, _UNS, "response_format")),
    ("logprobs", dict(logprobs=True), (400, _UNS, "logprobs")),
    ("top-logprobs", dict(top_logprobs=2), (400, _UNS, "top_logprobs")),
    ("tools", dict(tools=[{"type": "function"}]), (400, _UNS, "tools")),
    ("functions", dict(functions=[{}]), (400, _UNS, "functions")),
    ("tool-choice", dict(tool_choice="auto"), (400, _UNS, "tool_choice")),
    ("function-call", dict(function_call="auto"), (400, _UNS, "function_call")),
    ("store", dict(store=True), (400, _UNS, "store")),
    ("parallel-tool-calls", dict(parallel_tool_calls="yes"), (400, _UNS, "parallel_tool_calls")),
    ("user-number", dict(user=5), (400, _INV, "user")),
    ("metadata-string", dict(metadata="x"), (400, _INV, "metadata")),
    # stop
    ("stop-5", dict(stop=["a", "b", "c", "d", "e"]), (400, _INV, "stop")),
    ("stop-empty", dict(stop=""), (400, _INV, "stop")),
    ("stop-list-empty-string", dict(stop=[""]), (400, _INV, "stop")),
    ("stop-number", dict(stop=5), (400, _INV, "stop")),
    ("stop-mixed", dict(stop=["a", 3]), (400, _INV, "stop")),
    # the passages
    ("empty-document", dict(documents=["ok", "  "]), (400, _INV, "documents")),
    ("no-documents", dict(documents=[]), (400, _INV, "documents")),
    ("documents-string", dict(documents="x"), (400, _INV, "documents")),
    ("documents-numbers", dict(documents=[1]), (400, _INV, "documents")),
    ("both-sources", dict(collection="facts"), (400, _INV, "collection")),
    ("unknown-collection", dict(documents=None, collection="nope"), (404, "collection_not_found", "collection")),
    ("path-collection", dict(documents=None, collection="../etc"), (400, "invalid_collection", "collection")),
    ("empty-collection-name", dict(documents=None, collection=""), (400, _INV, "collection")),
    ("collection-number", dict(documents=None, collection=5), (400, _INV, "collection")),
    ("ids-and-documents", dict(document_ids=["x"]), (400, _INV, "document_ids")),
    ("top-k-0", dict(documents=None, collection="facts", top_k=0), (400, _INV, "top_k")),
    ("top-k-65", dict(documents=None, collection="facts", top_k=65), (400, _INV, "top_k")),
    ("top-k-string", dict(documents=None, collection="facts", top_k="3"), (400, _INV, "top_k")),
    ("top-k-fraction", dict(documents=None, collection="facts", top_k=2.5), (400, _INV, "top_k")),
    ("top-k-bool", dict(documents=None, collection="facts", top_k=True), (400, _INV, "top_k")),
    # the method
    ("unknown-method", dict(method="nope"), (400, "invalid_method", "method")),
    ("method-number", dict(method=5), (400, _INV, "method")),
    ("method-bad-option", dict(method="random(sed=3)"), (400, "invalid_method", "method")),
    ("method-options-string", dict(method="random", method_options="x"), (400, _INV, "method_options")),
    ("method-options-unknown", dict(method="random", method_options={"bogus": 1}),
     (400, "invalid_method", "method")),
    ("a3-evicts-with-sparse-decode", dict(method="a3(evict_capacity=8)", decode="prkv"),
     (400, _INV, None)),
    # the ratio, auto and guard
    ("ratio-range", dict(ratio=1.5), (400, _INV, "ratio")),
    ("ratio-negative", dict(ratio=-0.1), (400, _INV, "ratio")),
    ("ratio-word", dict(ratio="automatic"), (400, _INV, "ratio")),
    ("ratio-bool", dict(ratio=True), (400, _INV, "ratio")),
    ("ratio-list", dict(ratio=[0.2]), (400, _INV, "ratio")),
    ("ratio-object", dict(ratio={"auto": 1}), (400, _INV, "ratio")),
    ("ratio-auto-bad-option", dict(ratio="auto(bogus=1)"), (400, _INV, "ratio")),
    ("ratio-and-recompute-ratio", dict(ratio=0.2, recompute_ratio=0.3), (400, _INV, "ratio")),
    ("recompute-ratio-range", dict(recompute_ratio=2), (400, _INV, "recompute_ratio")),
    ("auto-bad-tol", dict(auto={"tol": -1}), (400, _INV, "auto")),
    ("auto-string", dict(auto="x"), (400, _INV, "auto")),
    ("two-auto-budgets", dict(ratio="auto(tol=0.05)", auto={"tol": 0.1}), (400, _INV, "ratio")),
    ("guard-always", dict(guard="always"), (400, _INV, "guard")),
    ("guard-bool", dict(guard=True), (400, _INV, "guard")),
    # the decode policy
    ("bad-decode", dict(decode="zzz"), (400, "invalid_decode", "decode")),
    ("decode-number", dict(decode=5), (400, "invalid_decode", "decode")),
    ("decode-bad-option", dict(decode="prkv(bogus=1)"), (400, "invalid_decode", "decode")),
    ("two-kv-budgets", dict(decode="prkv:kv_budget=64", kv_budget=32), (400, "invalid_decode", "kv_budget")),
    ("kv-budget-0", dict(kv_budget=0), (400, _INV, "kv_budget")),
    ("kv-budget-string", dict(kv_budget="x"), (400, _INV, "kv_budget")),
    # sampling and lengths
    ("too-long", dict(documents=[LONG_DOC]), (400, "context_length_exceeded", "messages")),
    ("negative-max-tokens", dict(max_tokens=-5), (400, _INV, "max_tokens")),
    ("bool-max-tokens", dict(max_tokens=True), (400, _INV, "max_tokens")),
    ("fraction-max-tokens", dict(max_tokens=1.5), (400, _INV, "max_tokens")),
    ("string-max-tokens", dict(max_tokens="8"), (400, _INV, "max_tokens")),
    ("zero-max-completion", dict(max_tokens=None, max_completion_tokens=0), (400, _INV, "max_completion_tokens")),
    ("max-tokens-disagree", dict(max_tokens=4, max_completion_tokens=5), (400, _INV, "max_tokens")),
    ("min-tokens-over-max", dict(max_tokens=4, min_tokens=5), (400, _INV, "min_tokens")),
    ("min-tokens-negative", dict(min_tokens=-1), (400, _INV, "min_tokens")),
    ("temperature-high", dict(temperature=3), (400, _INV, "temperature")),
    ("temperature-negative", dict(temperature=-0.1), (400, _INV, "temperature")),
    ("temperature-string", dict(temperature="hot"), (400, _INV, "temperature")),
    ("temperature-bool", dict(temperature=True), (400, _INV, "temperature")),
    ("top-p-0", dict(top_p=0), (400, _INV, "top_p")),
    ("top-p-high", dict(top_p=1.5), (400, _INV, "top_p")),
    ("seed-string", dict(seed="x"), (400, _INV, "seed")),
    ("seed-fraction", dict(seed=1.5), (400, _INV, "seed")),
    ("stream-string", dict(stream="yes"), (400, _INV, "stream")),
    ("stream-options-string", dict(stream_options="x"), (400, _INV, "stream_options")),
]

# a raw body, or one whose `stream` is itself the error, runs once; the others as JSON and as a stream
CASES = [(n, c, e, s) for n, c, e in BODIES
         for s in ([False] if isinstance(c, bytes) or "stream" in c else [False, True])]


def _post(client: httpx.Client, change, stream: bool) -> httpx.Response:
    if isinstance(change, bytes):
        return client.post("/v1/chat/completions", content=change, headers={"content-type": "application/json"})
    body = {**chat_body(stream=stream), **change}
    return client.post("/v1/chat/completions", json={k: v for k, v in body.items() if v is not None})


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def test_the_good_body_is_answered(client):
    r = client.post("/v1/chat/completions", json=chat_body(documents=SAMPLE_CHUNKS[:1], max_tokens=2))
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("name,change,expected,stream", CASES, ids=[f"{c[0]}-{'sse' if c[3] else 'json'}"
                                                                     for c in CASES])
def test_malformed_body_gets_the_same_error(client, name, change, expected, stream):
    r = _post(client, change, stream)
    assert r.headers["content-type"].startswith("application/json"), r.text  # never a half-open stream
    err = r.json()["error"]
    got = (r.status_code, err["code"], err["param"])
    record = os.environ.get("KVSTITCH_RECORD_BODIES")
    if record:  # how the expectations were written down
        with open(record, "a") as f:
            f.write(json.dumps([name, stream, list(got), err["message"][:120]]) + "\n")
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert got == expected, err
