"""Method objects: the `Selector` base class, the `Wrapper` of one method over another, the registry of
method names and aliases, and the building of an object from its spec (`kvstitch.core.spec`'s syntax).

A method is a `Selector` subclass registered under a name (`register`); its options are its fields, typed
and defaulted (``InfoFlow(reorder="max")``, ``DeltaProp(base=InfoFlow(), alpha_k=0.5)``), checked and
converted against their annotations at construction (`kvstitch.core.options`, shared with decode policies and
the adaptive budget): an ``int`` given to a ``float`` option becomes a float, a list a tuple, a spec (or a
name) given to a ``Selector`` option that method object (`Selector.coerce_option`); a value outside a
``Literal`` is an error naming the allowed ones. Adding a method is one class::

    @register
    @dataclass
    class MyMethod(Selector):
        name: ClassVar[str] = "mine"
        window: int = 8                      # "mine(window=16)" on every surface

        def score(self, ctx): ...

Selection runs in three steps, `Selector.select` running them: `prepare(ctx)` (optional, may change the
prompt itself: InfoFlow's reorder calls ``ctx.reorder``), `score(ctx)` -> per-context-token scores (higher =
recompute first), `pick(scores, ctx)` -> sorted unique context indices (the top ``budget`` by default;
grouping windows override only this step and may return fewer: they are not `exact_budget`). The engine
does the recompute and reads the other hooks: `recompute_plan`, `adjusts_decode`, `decode_plan`, and the
flags ``full_prefill`` / ``needs_full_prefill`` / ``zero_budget`` / ``exact_budget``. A method over another
one (grouping, deltaprop) is a `Wrapper`, which forwards every one of them to its ``base``.

`format_spec` writes the canonical spec: the name, then only the options that differ from their defaults,
in declaration order, without spaces (``deltaprop(base=infoflow,alpha_k=0.5)``); a method at its defaults
is its bare name. Parsing it gives an equal object. The registry names the variants once had stay as
`ALIASES`: each parses to the same object as its spec, and `method_label` names an object by its alias
when it is one, so eval rows written under those names keep their ``method``.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import InitVar, dataclass, field
from typing import TYPE_CHECKING, ClassVar

import torch

from kvstitch.core.errors import BadMethodOption, InputError, UnknownMethod
from kvstitch.core.options import check_options, format_options, type_hints
from kvstitch.core.options import option_fields as spec_fields
from .context import top_k_indices
from kvstitch.core.spec import Call, parse_call

if TYPE_CHECKING:
    from kvstitch.core.attention import ForwardPlan
    from .context import EngineView, SelectionContext
    from kvstitch.core.cache import StitchCache
    from kvstitch.core.prompt import PromptLayout

SELECTORS: dict[str, type["Selector"]] = {}
# variant names -> the spec they stand for (published commands and eval logs use them)
ALIASES: dict[str, str] = {
    "a3_stitched": "a3(stitched=true)",
    "cacheclip_refill": "cacheclip(refill=true)",
    "infoflow_reorder": "infoflow(reorder=topk_mass)",
    "infoflow_reorder_max": "infoflow(reorder=max)",
    "oracle_ideal": "oracle(mode=ideal)",
}


def register(cls: type["Selector"]) -> type["Selector"]:
    """Class decorator: ``cls.name`` becomes a method name of every surface (its options: its fields)."""
    SELECTORS[cls.name] = cls
    return cls


def methods() -> list[str]:
    """Names of the registered selection methods (methods, not variants: see `ALIASES`)."""
    return sorted(SELECTORS)


@dataclass
class Selector:
    """Base class. Subclasses set `name` and implement `score` (higher = recompute first); optionally
    `prepare` and `pick` (see the module doc). Options are dataclass fields with defaults; a subclass with
    checks of its own defines ``__post_init__`` and calls ``super().__post_init__()`` first."""

    name: ClassVar[str] = ""
    full_prefill: ClassVar[bool] = False  # `full`: the engine prefills from scratch instead
    needs_full_prefill: ClassVar[bool] = False  # `oracle`: scores need a full prefill (analysis only)
    zero_budget: ClassVar[bool] = False  # `ape`: never recomputes context tokens, whatever the ratio
    # False: `select` may return FEWER than ``budget`` indices (CacheClip's grouping drops sparse windows,
    # as the paper does); the engine reports the tokens actually recomputed (``recomputed_tokens``)
    exact_budget: ClassVar[bool] = True
    option_kind: ClassVar[str] = "a method spec"  # an option typed as a method (`kvstitch.core.options`)

    def __post_init__(self):
        check_options(self, BadMethodOption)  # every option against its annotation: a typed error naming what it takes

    @classmethod
    def coerce_option(cls, value, where: str) -> "Selector | None":
        """The value of an option typed as this class (a wrapper's ``base``): a spec, a parsed spec or config
        table (a `Call`) or a method object -> the method object; None when it is not one of ``cls``."""
        if isinstance(value, (str, Call)):
            try:
                value = build(value)
            except UnknownMethod as e:
                raise BadMethodOption(f"{where}: {e}") from None
        return value if isinstance(value, cls) else None

    @property
    def spec(self) -> str:
        """The canonical spec string: parses back to an equal object (`format_spec`)."""
        return format_spec(self)

    @property
    def label(self) -> str:
        """What rows, tables and metrics call this method: an alias's name when it is one, else `spec`."""
        return method_label(self)

    def __str__(self) -> str:
        return self.spec

    def score(self, ctx: SelectionContext) -> torch.Tensor:
        raise NotImplementedError  # abstract: every registered selector overrides it

    def chunk_anchors(self):
        """The anchor pass (`kvstitch.core.anchors.AnchorSpec`) the chunk caches must carry for this method
        (`qcfuse`), so the engine's precompute runs it with the chunks; None = none."""
        return None

    def recompute_plan(self, ctx: SelectionContext) -> "ForwardPlan | None":
        """Plan of the recompute pass (selected tokens + suffix), e.g. APE's attention; None = plain."""
        return None

    def adjusts_decode(self) -> bool:
        """True when `decode_plan` changes decode attention (then a sparse decoder cannot take over)."""
        return type(self).decode_plan is not Selector.decode_plan

    def decode_plan(self, engine: EngineView, cache: "StitchCache", layout: "PromptLayout",
                    stats: dict) -> "ForwardPlan | None":
        """Plan for the decode steps after the first token (APE's attention, A3's eviction); None = plain."""
        return None

    def has_layer_scores(self) -> bool:
        """True when `layer_scores` gives per-layer scores: the method defines it (a wrapper: its base does)."""
        return type(self).layer_scores is not Selector.layer_scores

    def layer_scores(self, ctx: SelectionContext) -> "dict[int, torch.Tensor] | None":
        """{layer: [n_context]} the per-layer scores the method fuses into `score` (prophet, infoflow, qcfuse:
        their mean), what deltaprop's ``fusion="union"`` ranks by; None (the default): a method that has none,
        so callers check `has_layer_scores` first."""
        return None

    def prepare(self, ctx: SelectionContext) -> None:
        """Before scoring: change the prompt itself if the method does (InfoFlow's reorder); default nothing."""

    def pick(self, scores: torch.Tensor, ctx: SelectionContext) -> torch.Tensor:
        """Scores [n_context] -> sorted unique indices: the top ``ctx.budget`` (ties by position)."""
        return top_k_indices(scores, ctx.budget)

    def select(self, ctx: SelectionContext) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`prepare`, `score`, `pick` -> (sorted unique context indices, ``ctx.budget`` of them (at most, if
        not `exact_budget`); scores or None). Subclasses override the steps, not this."""
        self.prepare(ctx)
        if ctx.budget <= 0 or self.zero_budget:
            return torch.zeros(0, dtype=torch.long), None
        if ctx.budget >= ctx.n_context:
            return torch.arange(ctx.n_context), None
        scores = ctx.scores(self).float().cpu()
        return self.pick(scores, ctx), scores

    def ranking(self, ctx: SelectionContext):
        """For budgets decided later (``recompute_ratio="auto"``): `prepare` and `score` once, then -> a picker
        ``k -> sorted indices`` (this method's own `pick` at budget k)."""
        n = ctx.n_context
        self.prepare(ctx)
        if self.zero_budget:
            raise InputError(f"method {self.name!r} does not rank context tokens, so it cannot choose a budget "
                             f"adaptively (recompute_ratio='auto'); use a scoring method such as prophet")
        scores = ctx.scores(self).float().cpu() if n > 1 else torch.zeros(n)

        def pick(k: int) -> torch.Tensor:
            k = min(max(int(k), 0), n)
            if k == 0 or k == n:
                return torch.arange(k)
            return self.pick(scores, dataclasses.replace(ctx, budget=k))

        return pick


@dataclass
class Wrapper(Selector):
    """A method over another one, ``base`` (a method object, or a spec string parsed at construction). Every
    hook and flag the engine reads is the base's unless the wrapper redefines it (`grouped` redefines `pick`;
    `deltaprop` extends `prepare`, `score` and `pick` and still calls the base's), so a wrapper never silently
    drops what its base does to the prompt, the recompute pass or decoding (A3's eviction, APE's attention).
    ``base_options`` (Python keywords only, kept for callers that name the base): options merged into it."""

    base: Selector = field(default_factory=lambda: SELECTORS["prophet"]())
    base_options: InitVar[dict | None] = None

    def __post_init__(self, base_options: dict | None = None):
        try:
            self.base = make_selector(self.base, **(base_options or {}))
        except UnknownMethod as e:  # a bad value of the option ``base``
            raise BadMethodOption(f"{self.name}: base: {e}") from None
        super().__post_init__()
        if type(self.base) is type(self):
            raise BadMethodOption(f"{self.name} cannot wrap itself")
        if self.base.full_prefill:
            raise BadMethodOption(f"{self.name} cannot wrap {self.base.name!r}: it prefills from scratch and "
                                  f"selects nothing")

    @property
    def needs_full_prefill(self) -> bool:  # e.g. over the oracle
        return self.base.needs_full_prefill

    @property
    def zero_budget(self) -> bool:  # e.g. over ape: still nothing to recompute
        return self.base.zero_budget

    @property
    def exact_budget(self) -> bool:
        return self.base.exact_budget

    def prepare(self, ctx: SelectionContext) -> None:
        self.base.prepare(ctx)

    def score(self, ctx: SelectionContext) -> torch.Tensor:
        return self.base.score(ctx)

    def pick(self, scores: torch.Tensor, ctx: SelectionContext) -> torch.Tensor:
        return self.base.pick(scores, ctx)

    def chunk_anchors(self):
        return self.base.chunk_anchors()

    def recompute_plan(self, ctx: SelectionContext):
        return self.base.recompute_plan(ctx)

    def adjusts_decode(self) -> bool:
        return self.base.adjusts_decode()

    def decode_plan(self, engine, cache, layout, stats: dict):
        return self.base.decode_plan(engine, cache, layout, stats)

    def has_layer_scores(self) -> bool:  # e.g. grouped over prophet: its scores are the base's
        return self.base.has_layer_scores()

    def layer_scores(self, ctx: SelectionContext):
        return self.base.layer_scores(ctx)


# what a `Wrapper` forwards (the wrapper test checks each reaches the engine through every wrapper)
WRAPPED_HOOKS = ("prepare", "score", "pick", "chunk_anchors", "recompute_plan", "adjusts_decode", "decode_plan")
WRAPPED_FLAGS = ("needs_full_prefill", "zero_budget", "exact_budget")


# ---- Call -> object, object -> text -----------------------------------------------------------------------
def build(spec):
    """A spec string, a `Call` or a method object -> the method object (the one parser: aliases resolved,
    unknown methods and options are typed errors naming the known ones)."""
    if isinstance(spec, Selector):
        return spec
    call = spec if isinstance(spec, Call) else parse_call(spec)
    return resolve_name(call.name, call.options)


def format_spec(obj) -> str:
    """The canonical spec of a method object (module doc)."""
    return format_options(obj)


def full_spec(obj) -> str:
    """Every option of a method object spelled out, defaults included (nested methods too): what a label meant
    when rows were written, so that a changed default cannot pass for the same method (`kvstitch eval`'s resume)."""
    return format_options(obj, full=True)


def unknown_method(name) -> UnknownMethod:
    return UnknownMethod(f"unknown method {name!r:.60}; known methods: {', '.join(methods())}; "
                         f"aliases: {', '.join(sorted(ALIASES))}")


def _python_options(cls) -> list[str]:
    """What a method class takes as Python keywords: its options, object-valued fields (CacheClip's
    ``aux_engine``) and init-only ones (a wrapper's ``base_options``)."""
    init_vars = [k for k, v in type_hints(cls).items() if isinstance(v, dataclasses.InitVar)]
    return [f.name for f in dataclasses.fields(cls) if f.init] + init_vars


def _bad_options(name: str, cls, given, allowed: list[str]) -> None:
    unknown = [k for k in given if k not in allowed]
    if unknown:
        takes = ", ".join(f.name for f in spec_fields(cls)) or "no options"
        raise BadMethodOption(f"bad option for method {name!r}: unknown option {unknown[0]!r:.60}; "
                              f"{name} takes: {takes}")


def resolve_name(name: str, options: dict) -> Selector:
    """A method or alias name and its spec options -> the method object."""
    if name in SELECTORS:
        cls = SELECTORS[name]
        _bad_options(name, cls, options, [f.name for f in spec_fields(cls)])
        try:
            return cls(**options)
        except TypeError as e:
            raise BadMethodOption(f"bad option for method {name!r}: {e}") from None
    if name in ALIASES:
        return with_options(build(ALIASES[name]), **options)
    raise unknown_method(name)


def with_options(obj: Selector, **options) -> Selector:
    """A copy of ``obj`` with ``options`` changed (checked as at construction); ``obj`` itself when none."""
    if not options:
        return obj
    cls = type(obj)
    _bad_options(obj.name, cls, options, _python_options(cls))
    try:
        return dataclasses.replace(obj, **options)
    except TypeError as e:
        raise BadMethodOption(f"bad option for method {obj.name!r}: {e}") from None


def make_selector(method, **options) -> Selector:
    """The method object of ``method`` (a spec string, an alias or an object) with ``options`` (Python
    keywords, e.g. the deprecated ``method_options`` of a request) merged in."""
    if not isinstance(method, (str, Selector, Call)):
        raise unknown_method(method)
    return with_options(build(method), **options)


@functools.cache
def _alias_of_spec() -> dict[str, str]:
    return {format_spec(build(spec)): alias for alias, spec in ALIASES.items()}


def method_label(obj: Selector) -> str:
    """What rows, tables and metrics call ``obj``: its alias when it is one (``infoflow_reorder_max``), else its
    canonical spec (the bare name when every option is at its default)."""
    spec = format_spec(obj)
    return _alias_of_spec().get(spec, spec)
