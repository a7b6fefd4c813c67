"""Decode-time KV selection policies: small dataclasses registered by name (like kvpress presses).

A policy only decides; `SparseDecoder` owns the pools and the state. What a policy says:

- ``sinks`` / ``window``: tokens always attended at the start / end of the cache (rounded out to pages);
  the window (64 tokens, PRKV Sec. 5.1) is also the observation window of the static policies;
- ``static``: whether it keeps a static set restructured to the front (`static_ratio` of the budget,
  refreshed every ``refresh_interval`` steps, PRKV Alg. 1), and how the static scores are pooled;
- `page_scores`: how the remaining pages are ranked each step (``None`` from `select_all` = all).

| name      | static set                     | dynamic pages                                  |
|-----------|--------------------------------|------------------------------------------------|
| `dense`   | -                              | all (dense reference; alias `full`)            |
| `snapkv`  | S = 1 (SnapKV+, PRKV Sec. 5.3) | most recent (only the slack of the page rounding) |
| `quest`   | -                              | top by bound, per KV head                      |
| `arkvale` | -                              | top by bound, shared by a group of KV heads    |
| `prkv`    | S = 0.25 or online (App. G)    | top by bound (group mean), per KV head         |
| `shadowkv`| outlier chunks (static)        | top 8-token chunks by landmark, per KV head; keys rebuilt from a low-rank factorisation (`shadowkv`) |

The bound policies (`quest`, `arkvale`, `prkv`) also take ``digest``: what a page keeps to be ranked by, the
papers' bounding box (default) or its keys' mean and variance (``"moments"``), and ``rerank_interval``: rank the
pages every r steps (default 1), reusing the last ranking between (`BoundPolicy`).

A policy is an object (``PRKV(static_ratio=0.5, kv_budget=512)``) or its spec string in the grammar of
`kvstitch.core.spec` (``"prkv(static_ratio=0.5,kv_budget=512)"``, ``"prkv:kv_budget=512"``): `make_policy`
builds either, checking every option against its annotation (`kvstitch.core.options`, as methods and the
adaptive budget are), and `DecodePolicy.spec` writes the canonical spec back (the name, then the options that
differ from their defaults, in declaration order). ``kv_budget`` is the one field no policy reads itself: the
decoder's budget, None = the request's (`policy_budget`).
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

from kvstitch.core.errors import BadDecodeOption, UnknownDecodePolicy
from kvstitch.core.options import check_options, format_options
from kvstitch.core.spec import Call, parse_call
from .page_scores import bound_scores, box_scores, moment_query, signed_query

DECODE_POLICIES: dict[str, type["DecodePolicy"]] = {}
# names dense decoding had: commands, configs and result files written with them keep working
DECODE_ALIASES: dict[str, str] = {"full": "dense"}
DEFAULT_KV_BUDGET = 1024  # tokens, when neither the policy nor the request gives one
GroupReduce = Literal["max", "mean", "sum", "softmax"]
Digest = Literal["box", "moments"]
GROUP_REDUCES = typing.get_args(GroupReduce)
DIGESTS = typing.get_args(Digest)


def register(cls: type["DecodePolicy"]) -> type["DecodePolicy"]:
    """Class decorator: ``cls.name`` becomes a decode policy of every surface (its options: its fields)."""
    DECODE_POLICIES[cls.name] = cls
    return cls


def policies() -> list[str]:
    """Names of the registered decode policies (aliases: `DECODE_ALIASES`)."""
    return sorted(DECODE_POLICIES)


def unknown_policy(name) -> UnknownDecodePolicy:
    return UnknownDecodePolicy(f"unknown decode policy {name!r:.60}; known: {', '.join(policies())}; "
                               f"aliases: {', '.join(f'{a} = {n}' for a, n in sorted(DECODE_ALIASES.items()))}")


def make_policy(decode: "str | Call | DecodePolicy" = "dense", **options) -> "DecodePolicy":
    """The policy object of ``decode``: a registered name or alias, a spec string (``"prkv(static_ratio=0.5)"``,
    ``"prkv:kv_budget=512"``) or a policy object; ``options`` (its fields as Python keywords) merged in. Unknown
    names and options are typed errors naming the valid ones."""
    if isinstance(decode, DecodePolicy):
        policy = decode
    elif isinstance(decode, (str, Call)):
        call = decode if isinstance(decode, Call) else parse_call(decode, "decode policy", BadDecodeOption)
        name = DECODE_ALIASES.get(call.name, call.name)
        if name not in DECODE_POLICIES:
            raise unknown_policy(call.name)
        _check_names(DECODE_POLICIES[name], call.options)
        policy = DECODE_POLICIES[name](**call.options)
    else:
        raise unknown_policy(decode)
    if not options:
        return policy
    _check_names(type(policy), options)
    return dataclasses.replace(policy, **options)




def _check_names(cls: type["DecodePolicy"], options: dict) -> None:
    takes = [f.name for f in dataclasses.fields(cls) if f.init]
    unknown = [k for k in options if k not in takes]
    if unknown:
        raise BadDecodeOption(f"bad options for decode policy {cls.name!r}: unknown option {unknown[0]!r:.60}; "
                              f"{cls.name} takes: {', '.join(takes)}")


def is_dense(decode) -> bool:
    """True when ``decode`` (a name, spec or policy) attends the whole cache: the engine then decodes densely
    over its contiguous cache, with no sparse decoder."""
    return make_policy(decode).select_all()


def policy_budget(policy: "DecodePolicy", kv_budget: int | None) -> int:
    """The K/V budget of a decoder of ``policy``: its own ``kv_budget``, else ``kv_budget`` (a request's), else
    `DEFAULT_KV_BUDGET`. Both given and different is an error (which one was meant is unclear)."""
    if kv_budget is not None and (isinstance(kv_budget, bool) or not isinstance(kv_budget, int) or kv_budget < 1):
        raise BadDecodeOption(f"kv_budget must be a positive integer, got {kv_budget!r}", param="kv_budget")
    if policy.kv_budget is not None and kv_budget is not None and policy.kv_budget != kv_budget:
        raise BadDecodeOption(f"two kv budgets: the decode policy {policy.spec!r} says {policy.kv_budget}, "
                              f"kv_budget says {kv_budget}; give one", param="kv_budget")
    return policy.kv_budget or kv_budget or DEFAULT_KV_BUDGET


@dataclass
class DecodePolicy:
    """Base: sinks + local window + pages chosen by `page_scores` (PRKV Sec. 3.4: local tokens always help)."""

    name: ClassVar[str] = ""
    static: ClassVar[bool] = False
    sinks: int = 4
    window: int = 64
    kv_budget: int | None = None  # the decoder's budget (tokens); None: the request's (`policy_budget`)

    def __post_init__(self) -> None:
        check_options(self, BadDecodeOption)  # every option against its annotation (`kvstitch.core.options`)
        if self.sinks < 0 or self.window < 1:
            raise BadDecodeOption(f"{self.name}: sinks must be >= 0 and window >= 1, got {self.sinks}, {self.window}")
        if self.kv_budget is not None and self.kv_budget < 1:
            raise BadDecodeOption(f"{self.name}: kv_budget must be a positive integer (or none: the request's), "
                                  f"got {self.kv_budget}")

    @property
    def spec(self) -> str:
        """The canonical spec string: parses back to an equal policy (module doc)."""
        return format_options(self)

    def __str__(self) -> str:
        return self.spec

    def fixed_tokens(self, page_size: int) -> tuple[int, int]:
        """(sink tokens, local-window tokens) for this page size."""
        return self.sinks, self.window

    def select_all(self) -> bool:
        return False

    def page_scores(self, q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, first_page: int) -> torch.Tensor:
        """Rank candidate pages ``first_page, first_page + 1, ...``: ``q [Hkv, G, D]`` (the step's query,
        grouped by KV head), boxes ``[Hkv, C, D]`` -> scores ``[Hkv, C]``, higher = attend."""
        raise NotImplementedError

    def box_scores(self, q: torch.Tensor, box: torch.Tensor, first_page: int,
                   scaling: float | None = None) -> torch.Tensor:
        """`page_scores` from `PageBounds.boxes` ``(kmax | -kmin)`` ``[Hkv, C, 2D]`` (what the decoder calls;
        policies override it with a faster equivalent). ``scaling``: the model's attention scaling (only
        rankings that pass bounds through a softmax use it; default ``D ** -0.5``)."""
        D = box.shape[-1] // 2
        return self.page_scores(q, -box[..., D:], box[..., :D], first_page)

    def rank_pages(self, q: torch.Tensor, boxes: list[torch.Tensor], first_pages: list[int],
                   scaling: float | None = None) -> torch.Tensor:
        """`box_scores` of several rows at once (a batched decode step, `batched.attend_batch`): ``q [b, Hkv,
        G, D]``, row i's candidate boxes ``boxes[i] [Hkv, C_i, 2D]`` from page ``first_pages[i]`` ->
        ``[b, Hkv, max C_i]``, ``-inf`` past a row's candidates. Each row's scores are its `box_scores`
        (this default calls it per row; policies override it with batched ops)."""
        out = _padded(q, boxes, 1)[:, :, 0]
        for i, (box, first) in enumerate(zip(boxes, first_pages)):
            out[i, :, : box.shape[1]] = self.box_scores(q[i], box, first, scaling)
        return out


def _padded(q: torch.Tensor, boxes: list[torch.Tensor], rows_per_head: int) -> torch.Tensor:
    """``-inf`` scores ``[b, Hkv, rows_per_head, max C_i]`` to fill row by row."""
    C = max(box.shape[1] for box in boxes)
    return torch.full((q.shape[0], q.shape[1], rows_per_head, C), float("-inf"), device=q.device)


def bound_matmuls(q2: torch.Tensor, boxes: list[torch.Tensor]) -> torch.Tensor:
    """`scoring.box_scores` of every row: signed queries ``q2 [b, Hkv, G, 2D]`` (G may be 1: pre-reduced)
    and row i's boxes ``[Hkv, C_i, 2D]`` -> ``[b, Hkv, G, max C_i]`` (``-inf`` past C_i), one matmul per row
    written in place (each row's numbers are its own matmul's)."""
    out = _padded(q2, boxes, q2.shape[2])
    for i, box in enumerate(boxes):
        torch.bmm(q2[i], box.transpose(1, 2), out=out[i, :, :, : box.shape[1]])
    return out


@register
@dataclass
class Dense(DecodePolicy):
    """Dense attention over the whole cache: the reference every other policy is measured against (the engine
    decodes it over its contiguous cache; a `SparseDecoder` of it attends every page)."""

    name: ClassVar[str] = "dense"

    def select_all(self) -> bool:
        return True




@dataclass
class BoundPolicy(DecodePolicy):
    """Pages ranked by the bounding-box upper bound Σ max(q·kmin, q·kmax), one choice per KV head combined
    over the query heads of its group by ``group_reduce``:

    - "max": the bound of the group's best head (Quest's bound taken over the group);
    - "mean" / "sum": the mean / sum of the heads' bounds (linear in the query: one matmul);
    - "softmax": each query head's softmax over the candidate pages (of ``scaling x`` bound, the page's
      estimated share of that head's attention), averaged over the group: the GQA rule PRKV gives for its
      static set (Sec. 4.1: score per query head, normalise, then average), applied to the dynamic pages,
      so a head with large logits cannot outvote the others.

    ``digest`` is what a page keeps to be ranked by: ``"box"``, the papers' bounding box (the bound above),
    or ``"moments"``, its keys' mean and per-dimension variance, ranked by the page's estimated attention mass
    q·μ + (s/2)·q²·σ² (`page_scores.moment_query`) in place of the bound; the group rules apply alike.

    ``rerank_interval``: rank the candidate pages every r steps (1, the papers' choice: every step); in between a
    step attends the pages of the last ranking (and the current sinks, static set and local window), skipping
    the ranking's reads of every candidate's digest and its top-k. Consecutive decode queries are alike (docs/decode.md
    has the measured recall and step time)."""

    group_reduce: GroupReduce = "max"
    digest: Digest = "box"
    rerank_interval: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.rerank_interval < 1:
            raise BadDecodeOption(f"{self.name}: rerank_interval must be >= 1, got {self.rerank_interval}")

    def reduce_group(self, per_head: torch.Tensor, scaling: float | None, head_dim: int) -> torch.Tensor:
        """``[..., G, C]`` per query head bounds -> ``[..., C]`` per KV head scores."""
        if self.group_reduce == "max":
            return per_head.amax(dim=-2)
        if self.group_reduce == "softmax":
            scale = scaling if scaling is not None else head_dim ** -0.5
            # log of the group's summed softmax: ranks as the mean does, without ties where exp underflows
            return (per_head * scale).log_softmax(dim=-1).logsumexp(dim=-2)
        return per_head.mean(dim=-2) if self.group_reduce == "mean" else per_head.sum(dim=-2)

    def page_scores(self, q, kmin, kmax, first_page, scaling=None):
        """The box bound from (kmin, kmax) views (``digest="box"``; `box_scores` takes either digest)."""
        return self.reduce_group(bound_scores(q, kmin, kmax), scaling, q.shape[-1])  # [Hkv, G, C] -> [Hkv, C]

    def _signed(self, q: torch.Tensor, scaling: float | None = None) -> torch.Tensor:
        """The query side of the digest, ``[..., G, 2D]``: ``(relu(q) | relu(-q))`` for boxes, ``(q | s/2·q²)``
        for moments; for mean / sum already reduced over the group (``G`` = 1): both scores are linear in it,
        so one ``[1, 2D] x [2D, C]`` matmul per KV head does."""
        if self.digest == "moments":
            q2 = moment_query(q, scaling if scaling is not None else q.shape[-1] ** -0.5)
        else:
            q2 = signed_query(q)
        if self.group_reduce == "mean":
            return q2.mean(dim=-2, keepdim=True)
        return q2.sum(dim=-2, keepdim=True) if self.group_reduce == "sum" else q2

    def _from_bounds(self, per_head: torch.Tensor, scaling: float | None, head_dim: int) -> torch.Tensor:
        if self.group_reduce in ("mean", "sum"):
            return per_head[..., 0, :]
        return self.reduce_group(per_head, scaling, head_dim)

    def box_scores(self, q, box, first_page, scaling=None):
        return self._from_bounds(box_scores(self._signed(q, scaling), box), scaling, q.shape[-1])

    def rank_pages(self, q, boxes, first_pages, scaling=None):
        return self._from_bounds(bound_matmuls(self._signed(q, scaling), boxes), scaling, q.shape[-1])


@register
@dataclass
class Quest(BoundPolicy):
    """Quest (Tang et al., 2024): top pages per KV head by the bounding-box upper bound of q·k."""

    name: ClassVar[str] = "quest"


@register
@dataclass
class ArkVale(BoundPolicy):
    """ArkVale (Chen et al., 2024): sink *pages* plus top pages by the cuboid digest, recalled from the host
    pool, plus the same 64-token local window as Quest and PRKV (PRKV Sec. 5.1 runs all three with page
    size 32 and local window 64). Its pages hold every head (NHD), so ``kv_head_groups`` groups of KV heads
    share one page choice (1 = all heads, ArkVale's default); scores are summed within a group."""

    name: ClassVar[str] = "arkvale"
    sink_pages: int = 1
    kv_head_groups: int = 1
    group_reduce: GroupReduce = "sum"

    def fixed_tokens(self, page_size):
        return self.sink_pages * page_size, self.window

    def page_scores(self, q, kmin, kmax, first_page, scaling=None):
        return self._share(super().page_scores(q, kmin, kmax, first_page, scaling))

    def box_scores(self, q, box, first_page, scaling=None):
        return self._share(super().box_scores(q, box, first_page, scaling))

    def rank_pages(self, q, boxes, first_pages, scaling=None):
        return self._share(super().rank_pages(q, boxes, first_pages, scaling))

    def _share(self, per_kv_head: torch.Tensor) -> torch.Tensor:
        *lead, Hkv, C = per_kv_head.shape  # [..., Hkv, C] -> the sum over each group of KV heads, repeated
        groups = self.kv_head_groups
        if Hkv % groups:
            raise BadDecodeOption(f"arkvale: kv_head_groups={groups} does not divide {Hkv} KV heads")
        shared = per_kv_head.reshape(*lead, groups, -1, C).sum(dim=-2, keepdim=True)
        return shared.expand(*lead, groups, Hkv // groups, C).reshape(*lead, Hkv, C)


@dataclass
class StaticSet:
    """Fields of the policies with a static set (PRKV Alg. 1): its share of the budget (a ratio, or
    "auto" for the online choice of App. G), the refresh interval T and SnapKV's score pooling."""

    static: ClassVar[bool] = True
    static_ratio: float | Literal["auto"] = 0.25
    refresh_interval: int = 128
    kernel_size: int = 1

    def check_static(self) -> None:
        auto = self.static_ratio == "auto"
        if not auto and not (isinstance(self.static_ratio, (int, float)) and 0 <= self.static_ratio <= 1):
            raise BadDecodeOption(f"{self.name}: static_ratio must be in [0, 1] or 'auto', got {self.static_ratio!r}")
        if self.refresh_interval < 1:
            raise BadDecodeOption(f"{self.name}: refresh_interval must be >= 1, got {self.refresh_interval}")
        if self.kernel_size < 1 or self.kernel_size % 2 == 0:
            raise BadDecodeOption(f"{self.name}: kernel_size must be odd, got {self.kernel_size}")


@register
@dataclass
class SnapKV(StaticSet, DecodePolicy):
    """SnapKV (Li et al., 2024) for decoding, as PRKV evaluates it (SnapKV+, Sec. 5.1/5.3): the whole
    budget is the static set (observation-window attention, pooled) refreshed every T steps, plus the
    local window; the page-rounding slack goes to the most recent pages."""

    name: ClassVar[str] = "snapkv"
    static_ratio: float | Literal["auto"] = 1.0
    kernel_size: int = 5

    def __post_init__(self) -> None:
        super().__post_init__()
        self.check_static()

    def page_scores(self, q, kmin, kmax, first_page):
        C = kmin.shape[1]
        recency = torch.arange(first_page, first_page + C, device=kmin.device, dtype=torch.float32)
        return recency.expand(kmin.shape[0], C)

    def box_scores(self, q, box, first_page, scaling=None):
        return self.page_scores(q, box, box, first_page)  # recency only needs the shape

    def rank_pages(self, q, boxes, first_pages, scaling=None):
        C = max(box.shape[1] for box in boxes)
        first = torch.tensor(first_pages, device=q.device, dtype=torch.float32).view(-1, 1, 1)
        count = torch.tensor([box.shape[1] for box in boxes], device=q.device).view(-1, 1, 1)
        c = torch.arange(C, device=q.device)
        recency = (first + c).masked_fill(c >= count, float("-inf"))
        return recency.expand(q.shape[0], q.shape[1], C)


@register
@dataclass
class PRKV(StaticSet, BoundPolicy):
    """PRKV (Sec. 4.1): static tokens (ratio S of the budget, top by GQA-aware observation attention over
    the observation window = the 64-token local window, restructured to the front and refreshed every
    T = 128 steps) + dynamic pages by the bounding box + local window (64) + sinks. ``static_ratio="auto"`` chooses S per layer at prefill (App. G)."""

    name: ClassVar[str] = "prkv"
    # per query head bounds averaged in the group (Sec. 4.1 averages per-head scores; "softmax" also
    # normalises each head's scores first, as the paper does for the static set)
    group_reduce: GroupReduce = "mean"

    def __post_init__(self) -> None:
        super().__post_init__()
        self.check_static()


# the class names policies were first published under
