"""The selection-method registry: small dataclasses with one signature (kvpress "presses" style).

A selector gets a `SelectionContext` (the stitched cache, the layout, the engine to run scoring
passes) and returns per-context-token scores; `Selector.select` turns them into exactly ``budget``
sorted, unique context indices (0-based within the context). The engine does the recompute.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

import torch

from ..errors import BadMethodOption, UnknownMethod

if TYPE_CHECKING:
    from ..attention import ForwardPlan
    from ..cache import StitchCache
    from ..engine import Engine
    from ..prompt import PromptLayout

SELECTORS: dict[str, type["Selector"]] = {}


def register(cls: type["Selector"]) -> type["Selector"]:
    SELECTORS[cls.name] = cls
    return cls


def methods() -> list[str]:
    """Names of the registered selection methods."""
    return sorted(SELECTORS)


def check_method(name) -> str:
    """The one validation of a selection method name (engine, CLI, server, eval, viz and benches call it):
    -> the name, or `UnknownMethod` naming the registered methods."""
    if not isinstance(name, str) or name not in SELECTORS:
        raise UnknownMethod(f"unknown method {name!r:.60}; known methods: {', '.join(methods())}")
    return name


def check_methods(names) -> list[str]:
    """`check_method` for a list: every unknown name in one `UnknownMethod`."""
    names = list(names)
    unknown = [n for n in names if not isinstance(n, str) or n not in SELECTORS]
    if len(unknown) == 1:
        check_method(unknown[0])
    if unknown:
        raise UnknownMethod(f"unknown methods {', '.join(f'{n!r:.60}' for n in unknown)}; "
                            f"known methods: {', '.join(methods())}")
    return names


def resolve_methods(spec: str, exclude: str = "") -> list[str]:
    """"all" (or empty) = every registered method; otherwise the comma list. `exclude` drops some."""
    def csv(s: str) -> list[str]:
        return [x.strip() for x in s.split(",") if x.strip()]

    names = methods() if spec.strip() in ("", "all") else csv(spec)
    drop = set(csv(exclude))
    return [m for m in names if m not in drop]


def make_selector(name: str, **kwargs) -> "Selector":
    check_method(name)
    try:
        return SELECTORS[name](**kwargs)
    except TypeError as e:
        raise BadMethodOption(f"bad option for method {name!r}: {e}") from e


@dataclass
class SelectionContext:
    engine: "Engine"
    cache: "StitchCache"  # the naively stitched cache (prefix + re-rotated chunks; suffix slots empty)
    layout: "PromptLayout"
    budget: int
    stats: dict = field(default_factory=dict)  # selectors may report what they measured

    @property
    def n_context(self) -> int:
        return self.layout.n_context

    @property
    def context_slots(self) -> torch.Tensor:
        return torch.arange(self.layout.context_start, self.layout.context_end, device=self.engine.device)

    @property
    def suffix_slots(self) -> torch.Tensor:
        return torch.arange(self.layout.context_end, self.layout.n_total, device=self.engine.device)


@dataclass
class Selector:
    """Base class. Subclasses set `name` and implement `score` (higher = recompute first)."""

    name: ClassVar[str] = ""
    full_prefill: ClassVar[bool] = False  # `full`: the engine prefills from scratch instead
    needs_full_prefill: ClassVar[bool] = False  # `oracle`: scores need a full prefill (analysis only)
    zero_budget: ClassVar[bool] = False  # `ape`: never recomputes context tokens, whatever the ratio

    def score(self, ctx: SelectionContext) -> torch.Tensor:
        raise NotImplementedError  # abstract: every registered selector overrides it

    def recompute_plan(self, ctx: SelectionContext) -> "ForwardPlan | None":
        """Plan of the recompute pass (selected tokens + suffix), e.g. APE's attention; None = plain."""
        return None

    def adjusts_decode(self) -> bool:
        """True when `decode_plan` changes decode attention (then a sparse decoder cannot take over)."""
        return type(self).decode_plan is not Selector.decode_plan

    def decode_plan(self, engine: "Engine", cache: "StitchCache", layout: "PromptLayout",
                    stats: dict) -> "ForwardPlan | None":
        """Plan for the decode steps after the first token (APE's attention, A3's eviction); None = plain."""
        return None

    def select(self, ctx: SelectionContext) -> tuple[torch.Tensor, torch.Tensor | None]:
        """-> (sorted unique context indices, exactly ``ctx.budget`` of them; scores or None)."""
        if ctx.budget <= 0 or self.zero_budget:
            return torch.zeros(0, dtype=torch.long), None
        if ctx.budget >= ctx.n_context:
            return torch.arange(ctx.n_context), None
        scores = self.score(ctx).float().cpu()
        return top_k_indices(scores, ctx.budget), scores


def top_k_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Exactly k indices, ties broken by position (stable, deterministic), returned sorted."""
    order = torch.sort(scores, descending=True, stable=True).indices
    return order[:k].sort().values
