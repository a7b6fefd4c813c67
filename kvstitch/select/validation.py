"""The functions every surface (engine, CLI, server, config, eval, calibrate, viz, benches) validates
methods with, over the registry of `kvstitch.select.method`: labels, lists of specs, config tables and the
options of each method."""

from __future__ import annotations

from kvstitch.core.errors import BadMethodOption, UnknownMethod
from .method import ALIASES, SELECTORS, Selector, build, make_selector, method_label, methods, spec_fields
from kvstitch.core.options import describe_type, field_default, read_table, type_hints
from kvstitch.core.spec import format_value, split_specs


def check_method(method) -> str:
    """The one validation of a method (engine, CLI, server, eval, viz and benches call it): a spec string, an
    alias or an object -> its label (`method_label`); `UnknownMethod` / `BadMethodOption` naming the valid ones."""
    return method_label(make_selector(method))


def check_methods(specs) -> list[str]:
    """`check_method` for a list -> labels; every unknown name in one `UnknownMethod`."""
    labels, unknown = [], []
    for s in list(specs):
        try:
            labels.append(check_method(s))
        except UnknownMethod:
            unknown.append(s)
    if len(unknown) == 1:
        check_method(unknown[0])
    if unknown:
        raise UnknownMethod(f"unknown methods {', '.join(f'{n!r:.60}' for n in unknown)}; "
                            f"known methods: {', '.join(methods())}; aliases: {', '.join(sorted(ALIASES))}")
    return labels


def resolve_methods(spec: str, exclude: str = "") -> list[str]:
    """"all" (or empty) = every method and alias (the registry's names); otherwise the comma list of specs
    (commas inside a spec's brackets are its own, `split_specs`). `exclude` drops some. -> labels."""
    names = sorted({*methods(), *ALIASES}) if spec.strip() in ("", "all") else split_specs(spec)
    drop = set(check_methods(split_specs(exclude)))
    return [m for m in dict.fromkeys(check_methods(names)) if m not in drop]


def from_mapping(table: dict) -> Selector:
    """A method given as a mapping (a TOML table): ``{"name": "deltaprop", "alpha_k": 0.5, "base": "infoflow"}``;
    an option may itself be such a mapping (`kvstitch.core.options.read_table`, the reader of every kind)."""
    return build(read_table(table, "method", BadMethodOption, methods()))


def method_options(name: str) -> list[tuple[str, str, str]]:
    """``(option, type in words, default)`` of a registered method (`kvstitch methods`)."""
    cls = SELECTORS[name]
    hints = type_hints(cls)
    return [(f.name, describe_type(hints[f.name]), format_value(field_default(f))) for f in spec_fields(cls)]
