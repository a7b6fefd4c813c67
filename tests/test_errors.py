"""Typed input errors: one validation of method names, and `code`/`param` carried by the error's type, so
callers (the server) dispatch on the type, never on the message text."""

from __future__ import annotations

import pytest

import kvstitch
from kvstitch.core.errors import (BadDecodeOption, BadMethodOption, BadRatio, InputError, PromptTooLong,
                                  UnknownDecodePolicy, UnknownMethod)
from kvstitch.select import ALIASES, check_method, check_methods, make_selector

from .conftest import SAMPLE_CHUNKS, SAMPLE_QUESTION

TYPED = {UnknownMethod: ("invalid_method", "method"), BadMethodOption: ("invalid_method", "method"),
         BadRatio: ("invalid_request", "ratio"), PromptTooLong: ("context_length_exceeded", "messages"),
         UnknownDecodePolicy: ("invalid_decode", "decode"), BadDecodeOption: ("invalid_decode", "decode")}


def test_typed_errors_carry_code_and_param():
    for cls, (code, param) in TYPED.items():
        e = cls("whatever the text says")
        assert isinstance(e, InputError) and isinstance(e, ValueError)
        assert (e.code, e.param) == (code, param)
    plain = InputError("unknown method 'x'")  # a message alone classifies nothing
    assert (plain.code, plain.param) == ("invalid_request", None)
    custom = InputError("bad field", param="top_k", code="invalid_top_k")
    assert (custom.code, custom.param) == ("invalid_top_k", "top_k")
    assert (InputError("x").code, InputError("x").param) == ("invalid_request", None)  # the override stays local


def test_check_method_is_the_one_validation():
    assert check_method("random") == "random"
    with pytest.raises(UnknownMethod, match="unknown method 'nope'; known methods: .*random"):
        check_method("nope")
    with pytest.raises(UnknownMethod, match=r"unknown method \['a'\]"):
        check_method(["a"])  # not a string: still a clear error, not a TypeError
    with pytest.raises(UnknownMethod) as e:
        check_method("x" * 500)
    known = len(", ".join(kvstitch.methods())) + len("; aliases: " + ", ".join(ALIASES))  # the valid names
    assert len(str(e.value)) < 60 + 40 + known  # a huge name is cut, not echoed
    assert check_methods(["random", "full"]) == ["random", "full"]
    with pytest.raises(UnknownMethod, match="unknown method 'zz'; known"):
        check_methods(["random", "zz"])
    with pytest.raises(UnknownMethod, match="unknown methods 'a', 'b'; known"):
        check_methods(["a", "random", "b"])
    with pytest.raises(UnknownMethod):
        make_selector("nope")
    with pytest.raises(BadMethodOption, match="bad option for method 'random'"):
        make_selector("random", no_such_field=1)


@pytest.mark.parametrize("tiny_engine", ["llama"], indirect=True)
@pytest.mark.parametrize("kwargs,cls", [
    (dict(method="bogus"), UnknownMethod),
    (dict(method="random(bogus=1)"), BadMethodOption),
    (dict(recompute_ratio=1.5), BadRatio),
    (dict(chunks=["word " * 5000]), PromptTooLong),
    (dict(decode="zzz"), UnknownDecodePolicy),
    (dict(decode="prkv", decode_options={"bogus": 1}), BadDecodeOption),
])
def test_engine_raises_typed_errors(tiny_engine, kwargs, cls):
    args = dict(question=SAMPLE_QUESTION, chunks=SAMPLE_CHUNKS, method="random", recompute_ratio=0.2,
                max_new_tokens=2)
    args.update(kwargs)
    with pytest.raises(cls):
        tiny_engine.generate(**args)


def test_server_maps_errors_by_type_not_message():
    from kvstitch.serve.jobs import input_error

    for cls, (code, param) in TYPED.items():
        api = input_error(cls("a message without any keyword"))
        assert (api.status, api.code, api.param) == (400, code, param)
    # a plain InputError whose text looks like another kind is not re-classified by its words
    api = input_error(InputError("unknown method 'x'; prompt exceeds the limit of 4096 positions"))
    assert (api.code, api.param) == ("invalid_request", None)
    api = input_error(InputError("bad top_k", param="top_k"))
    assert api.body()["error"]["param"] == "top_k"
