"""The one option system (`kvstitch.core.options`) of methods, decode policies and the adaptive budget: one
coercer and checker from the annotations (frozen dataclasses and option-typed options too), one canonical
formatter, one config-table reader; and one spelling of each request setting, the doubled keywords converted
(with a warning) where the request is built."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import ClassVar, Literal

import pytest

from kvstitch.core.errors import (BadAutoOption, BadDecodeOption, BadMethodOption, InputError,
                                   KVStitchDeprecationWarning)
from kvstitch.core.options import check_options, coerce, describe_type, format_options, read_table
from kvstitch.core.spec import Call
from kvstitch.decode import PRKV, make_policy
from kvstitch.engine.budget import AutoBudget
from kvstitch.engine.request import GenerationRequest
from kvstitch.select import DeltaProp, InfoFlow, from_mapping, make_selector
from kvstitch.serve.config import auto_setting


class Knob:
    """An option class with the coercer's hook (as `Selector` has): built from its name."""

    option_kind: ClassVar[str] = "a knob name"

    def __init__(self, name: str):
        self.name = name

    def __eq__(self, other):
        return isinstance(other, Knob) and other.name == self.name

    @classmethod
    def coerce_option(cls, value, where):
        return cls(value) if isinstance(value, str) and value.isalpha() else value if isinstance(value, cls) else None


@dataclass(frozen=True)
class Frozen:
    name: ClassVar[str] = "frozen"
    ratios: tuple[float, ...] = (0.5,)
    mode: Literal["a", "b"] = "a"
    limit: int | None = None
    knob: Knob = field(default_factory=lambda: Knob("x"))

    def __post_init__(self):
        check_options(self, BadAutoOption)


def test_one_checker_converts_and_names_what_an_option_takes():
    obj = Frozen(ratios=[1, 0.25], knob="y")  # a list of integers and numbers, a knob by its name
    assert obj.ratios == (1.0, 0.25) and type(obj.ratios[0]) is float and obj.knob == Knob("y")
    for kwargs, says in [({"mode": "c"}, "frozen: mode must be one of a, b, got 'c'"),
                         ({"limit": True}, "frozen: limit must be an integer or none, got True"),
                         ({"ratios": 0.5}, "frozen: ratios must be a list of numbers, got 0.5"),
                         ({"knob": "k9"}, "frozen: knob must be a knob name, got 'k9'")]:
        with pytest.raises(BadAutoOption) as e:
            Frozen(**kwargs)
        assert str(e.value) == says
    assert describe_type(float | Literal["auto"]) == "a number or one of auto"
    assert coerce(3, float, "x", InputError) == 3.0


def test_one_formatter_writes_the_canonical_spec_of_every_kind():
    assert format_options(Frozen()) == "frozen"
    assert format_options(Frozen(mode="b", ratios=(0.5, 1.0))) == "frozen(ratios=[0.5,1.0],mode=b)"
    obj = DeltaProp(base=InfoFlow(reorder="max"), alpha_k=0.5)
    assert format_options(obj) == obj.spec == "deltaprop(base=infoflow(reorder=max),alpha_k=0.5)"
    assert format_options(obj, full=True).startswith("deltaprop(base=infoflow(")
    assert format_options(PRKV(static_ratio=0.5)) == PRKV(static_ratio=0.5).spec == "prkv(static_ratio=0.5)"
    assert format_options(AutoBudget(tol=0.05)) == AutoBudget(tol=0.05).spec == "auto(tol=0.05)"


def test_one_table_reader_for_methods_policies_and_the_budget():
    table = {"name": "deltaprop", "alpha_k": 0.5, "base": {"name": "infoflow", "reorder": "max"}}
    assert read_table(table, "method", BadMethodOption) == \
        Call("deltaprop", {"alpha_k": 0.5, "base": Call("infoflow", {"reorder": "max"})})
    assert from_mapping(table) == make_selector("deltaprop(base=infoflow(reorder=max),alpha_k=0.5)")
    assert make_policy(read_table({"name": "prkv", "static_ratio": 0.5}, "decode", BadDecodeOption)) == \
        PRKV(static_ratio=0.5)
    assert auto_setting({"tol": 0.05, "schedule": [0.1]}, "k.toml") == AutoBudget(tol=0.05, schedule=(0.1,))
    assert auto_setting("tol=0.05", "k.toml") == auto_setting("auto(tol=0.05)", "k.toml") == AutoBudget(tol=0.05)
    with pytest.raises(BadDecodeOption, match="a decode table needs a 'name' \\(one of a, b\\)"):
        read_table({"window": 3}, "decode", BadDecodeOption, ["a", "b"])
    with pytest.raises(BadAutoOption, match="k.toml: auto: auto: tol must be a finite number"):
        auto_setting({"tol": -1.0}, "k.toml")


@pytest.mark.parametrize("old,new", [
    ({"recompute_ratio": "auto", "auto": {"tol": 0.05}}, {"recompute_ratio": AutoBudget(tol=0.05)}),
    ({"method": "deltaprop", "method_options": {"alpha_k": 0.5}}, {"method": DeltaProp(alpha_k=0.5)}),
    ({"decode": "prkv", "decode_options": {"window": 32, "page_size": 8}},
     {"decode": PRKV(window=32), "decode_options": {"page_size": 8}}),
])
def test_a_doubled_keyword_warns_and_gives_the_request_of_the_one_spelling(old, new):
    with pytest.warns(KVStitchDeprecationWarning, match="deprecated"):
        converted = GenerationRequest(question="q", chunks=["c"], **old)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the one spelling warns about nothing
        assert converted == GenerationRequest(question="q", chunks=["c"], **new)
