"""What a chat request gets for a field it leaves out: the server's defaults, checked once when it starts (and by
`kvstitch serve` before the model loads). No pydantic here: the CLI imports it on a plain install."""

from __future__ import annotations

from dataclasses import dataclass

from kvstitch.decode.policies import DecodePolicy, make_policy
from kvstitch.engine.budget import AutoBudget, split_ratio
from kvstitch.select import Selector, check_method

DEFAULT_MAX_TOKENS = 256


@dataclass(frozen=True)
class ChatDefaults:
    """What a request gets for a field it leaves out: the server's method and decode policy (canonical specs:
    each request gets its own objects), ratio, max_tokens, and the decode policies it serves (None: every
    registered one). `of` checks them once, when the server starts."""

    method: str
    ratio: float | str
    decode: str
    max_tokens: int = DEFAULT_MAX_TOKENS
    policies: frozenset[str] | None = None
    auto: AutoBudget | None = None  # the options an auto spec ratio carries (the engine's default_auto)

    @classmethod
    def of(cls, method: str | Selector, ratio, decode: str | DecodePolicy, max_tokens: int = DEFAULT_MAX_TOKENS,
           policies=None, auto: AutoBudget | dict | None = None) -> "ChatDefaults":
        """``auto``: options of ratio "auto" given beside ``ratio`` (`kvstitch serve --auto`); an auto spec
        ratio carries its own, and the two must agree."""
        ratio, auto = split_ratio(ratio, auto)
        return cls(check_method(method), ratio, make_policy(decode).spec, max_tokens,
                   None if policies is None else frozenset(policies), auto)


def decode_policies() -> set[str]:
    """The registered decode policy names (`kvstitch.decode`; the alias ``full`` is accepted too)."""
    from kvstitch.decode import DECODE_POLICIES

    return set(DECODE_POLICIES)
