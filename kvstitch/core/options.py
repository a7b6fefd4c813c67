"""Option objects: the one checking, formatting and config reading of every dataclass whose fields are options
(a selection method, a decode policy, the adaptive budget), over the syntax of `kvstitch.core.spec`.

- `check_options(obj, error)`: every option (init field) checked against its annotation and converted where the
  meaning is unambiguous (`coerce`: an integer for a number becomes a float, a list a tuple); a bad value is
  ``error`` (the kind's typed `InputError`) saying what the option takes (`describe_type`). Frozen dataclasses
  too. Range checks (``0 < max_ratio <= 1``) stay in each class, after it.
- `format_options(obj)`: the canonical spec, the object's ``name`` then only the options that differ from their
  defaults, in declaration order, without spaces (``prkv(static_ratio=0.5)``); the bare name at the defaults.
  ``full=True`` spells every option out, nested option objects too.
- `read_table(table, ...)`: a config table (TOML) -> the `Call` its spec would parse to, for the kind to build.

An option typed by a class of option objects (a method's ``base: Selector``) is converted by that class: it
defines ``option_kind`` (what it is in words) and a classmethod ``coerce_option(value, where)`` returning the
object, or None when ``value`` is not one. So this module needs no import of the kinds it serves.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Any, Literal, Union

from kvstitch.core.errors import InputError
from kvstitch.core.spec import Call, format_value

_WORDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string", dict: "a mapping"}
_PLURAL = {"an integer": "integers", "a number": "numbers", "a string": "strings"}


@functools.cache
def type_hints(cls) -> dict:
    return typing.get_type_hints(cls)


def option_fields(cls) -> list[dataclasses.Field]:
    """The options of an option class: its init fields that are part of its identity (``compare``); a field such
    as CacheClip's ``aux_engine`` (an object, not an option) is settable from Python only."""
    return [f for f in dataclasses.fields(cls) if f.init and f.compare]


def field_default(f: dataclasses.Field):
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def _hook(hint):
    return hint if isinstance(hint, type) and hasattr(hint, "coerce_option") else None


def describe_type(hint) -> str:
    """An option's type in words (error messages, `kvstitch methods`)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (Union, types.UnionType):
        arms = [describe_type(a) for a in args if a is not type(None)]
        return " or ".join(arms + (["none"] if type(None) in args else []))
    if origin is Literal:
        return "one of " + ", ".join(format_value(a) for a in args)
    if origin is tuple:
        inner = [a for a in args if a is not Ellipsis]
        one = describe_type(inner[0]) if inner else "values"
        return "a list of " + _PLURAL.get(one, one)
    if hint in _WORDS:
        return _WORDS[hint]
    return hint.option_kind if _hook(hint) else getattr(hint, "__name__", str(hint))


def coerce(value, hint, where: str, error: type[InputError] = InputError):
    """``value`` checked against ``hint`` (converted where the meaning is unambiguous), or ``error`` saying what
    ``where`` (e.g. ``"prkv: window"``) takes."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    bad = error(f"{where} must be {describe_type(hint)}, got {value!r:.60}")
    if hint in (Any, object):
        return value
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for arm in (a for a in args if a is not type(None)):
            try:
                return coerce(value, arm, where, error)
            except InputError:
                continue
        raise bad
    if origin is Literal:
        if any(value == a and type(value) is type(a) for a in args):
            return value
        raise bad
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise bad
        inner = args[:1] * len(value) if len(args) == 2 and args[1] is Ellipsis else args
        if args and len(inner) != len(value):
            raise bad
        return tuple(coerce(v, h, where, error) for v, h in zip(value, inner)) if args else tuple(value)
    if hint in (bool, int, str, dict) or origin is dict:
        if not isinstance(value, origin or hint) or (hint is int and isinstance(value, bool)):
            raise bad
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad
        return float(value)
    if _hook(hint):
        out = hint.coerce_option(value, where)
        if out is None:
            raise bad
        return out
    return value


def check_options(obj, error: type[InputError] = InputError) -> None:
    """Every option of ``obj`` checked against its annotation and converted in place (`coerce`), the first bad
    one an ``error`` naming ``obj.name`` and the option."""
    hints = type_hints(type(obj))
    for f in option_fields(type(obj)):
        value = getattr(obj, f.name)
        new = coerce(value, hints.get(f.name, Any), f"{obj.name}: {f.name}", error)
        if new is not value:
            object.__setattr__(obj, f.name, new)  # frozen dataclasses too


def _is_option_object(v) -> bool:
    return dataclasses.is_dataclass(v) and not isinstance(v, type) and hasattr(v, "spec")


def format_options(obj, full: bool = False) -> str:
    """The canonical spec of an option object (module doc): parses back to an equal object. ``full``: every
    option spelled out, defaults included, nested option objects too (what a label meant when eval rows were
    written, so that a changed default cannot pass for the same method)."""
    fs = option_fields(type(obj))
    if full:
        def value(v):
            return format_options(v, full=True) if _is_option_object(v) else format_value(v)

        return obj.name + "(" + ",".join(f"{f.name}={value(getattr(obj, f.name))}" for f in fs) + ")"
    opts = [f"{f.name}={format_value(getattr(obj, f.name))}" for f in fs if getattr(obj, f.name) != field_default(f)]
    return obj.name + (f"({','.join(opts)})" if opts else "")


def read_table(table: dict, what: str, error: type[InputError], names=(), name: str | None = None) -> Call:
    """A config table of an option object -> its `Call` (the kind builds it as it builds a parsed spec): the
    ``name`` key (else ``name``: the kind's only name, e.g. ``[auto]``) and the options; an option that is itself
    a table with a ``name`` is read alike (``base = { name = "infoflow", reorder = "max" }``). ``names``: the
    valid names, for the message of a table without one."""
    opts = dict(table)
    name = opts.pop("name", name)
    if not isinstance(name, str):
        known = f" (one of {', '.join(names)})" if names else ""
        raise error(f"a {what} table needs a 'name'{known}, got {table!r:.80}")
    return Call(name, {k: read_table(v, what, error, names) if isinstance(v, dict) and "name" in v else v
                       for k, v in opts.items()})
