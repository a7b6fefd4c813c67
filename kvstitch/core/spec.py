"""Spec strings: the one text form of an option object (a selection method, a decode policy, the adaptive
budget), parsed the same way by every surface (the CLI, the server's ``method`` / ``decode`` / ``ratio``
fields, the config file, the eval's ``--methods`` and ``--ratios``). It sits in `kvstitch.core` so that
`kvstitch.select` and `kvstitch.decode`, which do not import each other, share the one parser.

Grammar (whitespace is free)::

    spec   := NAME | NAME "(" [opts] ")" | NAME ":" opts          (the short form runs to the end)
    opts   := KEY "=" value ("," KEY "=" value)*
    value  := spec | "[" [value ("," value)*] "]" | WORD | QUOTED
    WORD   := true | false | none | an integer | a float | any other bare word (a string)

So ``deltaprop(base=infoflow(reorder=max), alpha_k=0.5)`` and ``deltaprop:base=infoflow`` both give a
`DeltaProp`, ``prkv:kv_budget=512`` a `PRKV` policy, ``auto(tol=0.05)`` an `AutoBudget`. This module is the
syntax only (text -> `Call`, values -> text); `kvstitch.core.options` checks and formats the options of every
kind, and `kvstitch.select.method`, `kvstitch.decode.policies` and `kvstitch.engine.budget` build the objects.
``what`` (the kind of spec, for messages) and ``error`` (the typed error a syntax error raises) let each caller
keep its own error type.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import re

from kvstitch.core.errors import BadMethodOption, InputError

_TOKEN = re.compile(r"""\s*(?:(?P<punct>[(),=\[\]:])|(?P<quoted>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*')"""
                    r"""|(?P<word>[^\s(),=\[\]:"']+))""")
_INT = re.compile(r"[+-]?\d+")
_FLOAT = re.compile(r"[+-]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][+-]?\d+)?|[+-]?(?:inf|nan)")
_BARE = re.compile(r"[^\s(),=\[\]:\"']+")  # a string written without quotes
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_KEYWORDS = {"true": True, "false": False, "none": None, "null": None}


class BadSpec(BadMethodOption):
    """A method spec string that does not follow the grammar (`kvstitch.core.spec`)."""


@dataclasses.dataclass(frozen=True)
class Call:
    """A parsed ``name(key=value, ...)`` before it becomes an object (a method, a policy, ...)."""

    name: str
    options: dict


# ---- text -> Call ---------------------------------------------------------------------------------------
def _tokens(text: str, what: str, error: type[InputError]) -> list[tuple[str, str]]:
    out, pos, text = [], 0, text.rstrip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if not m or m.end() == pos:
            raise error(f"cannot read {what} spec {text!r:.80} at character {pos + 1}")
        kind = m.lastgroup
        out.append((kind, m.group(kind)))
        pos = m.end()
    return out


class _Parser:
    def __init__(self, text: str, what: str, error: type[InputError]):
        self.text, self.what, self.error = text, what, error
        self.toks, self.i = _tokens(text, what, error), 0

    def bad(self, message: str) -> InputError:
        return self.error(f"{self.what} spec {self.text!r:.80}: {message}")

    def peek(self) -> str | None:
        return self.toks[self.i][1] if self.i < len(self.toks) and self.toks[self.i][0] == "punct" else None

    def fail(self, what: str):
        got = self.toks[self.i][1] if self.i < len(self.toks) else "the end"
        raise self.bad(f"expected {what}, got {got!r}")

    def take(self, punct: str) -> None:
        if self.peek() != punct:
            self.fail(repr(punct))
        self.i += 1

    def word(self) -> str:
        if self.i >= len(self.toks) or self.toks[self.i][0] != "word":
            self.fail("a name")
        self.i += 1
        return self.toks[self.i - 1][1]

    def top(self) -> Call:
        name = self.name()
        if self.peek() == ":":  # short form: the options run to the end
            self.i += 1
            call = Call(name, self.options(end=None))
        else:
            call = self.call(name)
        if self.i < len(self.toks):
            self.fail("the end of the spec")
        return call

    def name(self) -> str:
        name = self.word()
        if not _NAME.fullmatch(name):
            raise self.bad(f"{name!r} is not a {self.what} name")
        return name

    def call(self, name: str) -> Call:
        if self.peek() != "(":
            return Call(name, {})
        self.i += 1
        opts = self.options(end=")")
        self.take(")")
        return Call(name, opts)

    def options(self, end: str | None) -> dict:
        opts: dict = {}
        while self.i < len(self.toks) and (end is None or self.peek() != end):
            key = self.word()
            if not _NAME.fullmatch(key):
                raise self.bad(f"{key!r} is not an option name")
            if key in opts:
                raise self.bad(f"option {key!r} given twice")
            self.take("=")
            opts[key] = self.value()
            if self.peek() != ",":
                break
            self.i += 1
        return opts

    def value(self):
        if self.peek() == "[":
            self.i += 1
            items = []
            while self.peek() != "]":
                items.append(self.value())
                if self.peek() != ",":
                    break
                self.i += 1
            self.take("]")
            return items
        if self.i < len(self.toks) and self.toks[self.i][0] == "quoted":
            self.i += 1
            return ast.literal_eval(self.toks[self.i - 1][1])
        word = self.word()
        if self.peek() == "(":
            return self.call(word)
        return _atom(word)


def _atom(word: str):
    low = word.lower()
    if low in _KEYWORDS:
        return _KEYWORDS[low]
    if _INT.fullmatch(word):
        return int(word)
    if _FLOAT.fullmatch(low):
        return float(word)
    return word


def parse_call(text: str, what: str = "method", error: type[InputError] | None = None) -> Call:
    """A spec string -> its `Call` (syntax only: names and options are checked when it is built). ``what``
    names the kind of spec in messages; ``error``: the typed error of a syntax error (default `BadSpec`)."""
    error = error or BadSpec
    if not isinstance(text, str) or not text.strip():
        raise error(f"a {what} spec must be a non-empty string, got {text!r:.60}")
    return _Parser(text, what, error).top()


def split_specs(text: str) -> list[str]:
    """A comma-separated list of specs -> the specs: commas inside brackets belong to their spec, and a
    ``key=value`` piece after a short-form spec (``deltaprop:base=infoflow,alpha_k=0.5``) is one of its options."""
    parts, depth, cur = [], 0, ""
    for ch in text:
        depth += ch in "([" and 1 or (-1 if ch in ")]" else 0)
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    out: list[str] = []
    for p in (p.strip() for p in parts):
        if not p:
            continue
        if out and ":" in out[-1] and re.match(r"[A-Za-z_]\w*\s*=", p):
            out[-1] += "," + p
        else:
            out.append(p)
    return out


def format_value(v) -> str:
    """A value as the grammar writes it (an option object, one with a ``spec``, as its own spec)."""
    if dataclasses.is_dataclass(v) and hasattr(v, "spec"):
        return v.spec
    if isinstance(v, bool):
        return "true" if v else "false"
    if v is None:
        return "none"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(format_value(x) for x in v) + "]"
    if isinstance(v, str) and _BARE.fullmatch(v) and _atom(v) == v:
        return v
    return json.dumps(v) if isinstance(v, str) else repr(v)
