"""Batched dense decode steps over several requests' caches (continuous batching, `Engine.decode_batch`).

Every request keeps its own `StitchCache` (lengths differ, nothing is padded or copied). One forward runs
the B new tokens as a batch ``[B, 1]``: embeddings, projections, RoPE (per-row positions) and MLPs are
batched GEMMs; inside each attention layer `BatchCache.update` writes row i's fresh K/V into cache i and
the attention runs per row over that row's own cache, through the same `kvstitch_attention` code path a
lone decode step takes (``ForwardPlan(q_slots=[length_i])``). A per-row mask is therefore implicit: row i
never sees another row's keys.

Exactness: a row's result equals the lone step's up to the batched GEMMs' float rounding (a GEMM of B rows
may sum in another order than one of one row, which can flip a near tie); the tests compare whole greedy
answers batched vs alone.

Batched recompute passes (`Engine.recompute_batch`): the recompute pass of a request (its selected context
tokens + suffix at their slots, or a full prefill's whole prompt over an empty cache) is a `RecomputeStep`.
Several are packed on the sequence axis, ``[1, sum n_i]`` with each token's own position id, and run as one
forward: every token-wise op (embeddings, norms, projections, RoPE, MLPs) is one GEMM over all tokens; in
each attention layer `PackedCache.update` scatters segment i's fresh K/V into request i's own `StitchCache`
at its slots, and `PackedCache.attend` runs segment i's queries over that cache with ``q_slots`` = its slots,
through the same `kvstitch_attention` call a lone pass makes. Segment i's logits are those of its last token.
Only plain passes pack (`can_batch`: no hooks, capture, APE, key masks, sparse decoder); the engine runs the
others alone.
"""

from __future__ import annotations

import time
from contextlib import ExitStack
from dataclasses import MISSING, dataclass, fields

import torch
from transformers.cache_utils import Cache

from kvstitch.core.attention import ForwardPlan, kvstitch_attention
from kvstitch.core.cache import StitchCache
from kvstitch.core.errors import InputError
from kvstitch.decode.batched import append_batch, attend_batch
from kvstitch.decode.decoder import attend_rows
from kvstitch.models import cache_kwargs
from kvstitch.models.stitch_adapter import gate_of, gated


@dataclass
class DecodeStep:
    """One pending dense decode step of a request: ``token`` at position ``cache.length`` over ``cache``.
    `Engine.steps(request, batch_decode=True)` yields these; the consumer runs them
    (`Engine.decode_batch`, several requests at once) and ``send``s back the step's logits ``[1, V]``."""

    cache: StitchCache
    token: int
    # a sparse decoder (`kvstitch.decode`) that owns this request's K/V: the row's new K/V are appended to it
    # and its attention runs over the tokens its policy selects (None: dense over ``cache``)
    decoder: object | None = None


class BatchCache(Cache):
    """A transformers `Cache` over B per-request `StitchCache`s for one batched decode step."""

    def __init__(self, caches: list[StitchCache], batched_sparse: bool = True):
        super().__init__(layers=caches[0].layers)  # protocol only: every call below is routed per row
        self.caches = caches
        self.batched_sparse = batched_sparse  # False: each sparse row's lone attend (the reference)
        self.row_kv: list[tuple[torch.Tensor, torch.Tensor]] = []

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        sparse = [i for i, c in enumerate(self.caches) if c.decoder is not None] if self.batched_sparse else []
        if len(sparse) > 1:  # the sparse rows append to their decoders together (what `StitchCache.update` does)
            index = torch.tensor(sparse, device=key_states.device)
            append_batch([self.caches[i].decoder for i in sparse], layer_idx, key_states.index_select(0, index),
                         value_states.index_select(0, index))
            for i in sparse:
                self.caches[i].layers[layer_idx].length += key_states.shape[-2]
        else:
            sparse = []
        done = set(sparse)
        self.row_kv = [(key_states[i:i + 1], value_states[i:i + 1]) if i in done else
                       c.update(key_states[i:i + 1], value_states[i:i + 1], layer_idx)
                       for i, c in enumerate(self.caches)]  # append mode: slots None -> at each row's length
        return key_states, value_states  # unused: the attention reads `row_kv` (see `attend`)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return max(c.get_seq_length(layer_idx) for c in self.caches)

    def attend(self, module, query, **kwargs):
        """Per-row attention: row i's query over row i's keys (or, for a row with a sparse decoder, over the
        tokens its policy selects), as a lone decode step computes it."""
        outs: list = [None] * len(self.row_kv)
        sparse = [i for i, c in enumerate(self.caches) if c.decoder is not None]
        if sparse:  # one batched sparse attention for the sparse rows (or each row's lone attend)
            scaling = kwargs.get("scaling")
            scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
            attend = attend_batch if self.batched_sparse else attend_rows
            got = attend([self.caches[i].decoder for i in sparse], module.layer_idx,
                         [query[i] for i in sparse], scaling)
            for i, o in zip(sparse, got):
                outs[i] = o[None].transpose(1, 2)
        for i, (k, v) in enumerate(self.row_kv):
            if outs[i] is not None:
                continue
            n = k.shape[2]
            plan = ForwardPlan(q_slots=torch.tensor([n - 1], device=query.device))
            outs[i], _ = kvstitch_attention(module, query[i:i + 1], k, v, kvstitch_plan=plan, **kwargs)
        return torch.cat(outs, dim=0), None


@torch.no_grad()
def decode_batch(engine, steps: list[DecodeStep], batched_sparse: bool = True) -> list[torch.Tensor]:
    """Run B pending decode steps in one forward -> each step's next-token logits ``[1, V]`` (float32).
    Steps with a sparse decoder (``step.decoder``) append to it and attend through it, all of them in one
    batched sparse attention per layer (`kvstitch.decode.batched`; ``batched_sparse=False``: each row's lone
    attend); the caller ends the decoder's step (``decoder.end_step()``), as after a lone step."""
    for s in steps:
        if s.cache.decoder is not s.decoder:
            raise InputError("a decode step's decoder must be the one its cache hands its K/V to (cache.decoder)")
        if s.cache.slots is not None:
            raise InputError("a decode step's cache must be in append mode (slots=None)")
    if len(steps) == 1 and steps[0].decoder is None:
        s = steps[0]
        return [engine.forward(s.cache, torch.tensor([s.token]), torch.tensor([s.cache.length]))]
    dev = engine.device
    ids = torch.tensor([[s.token] for s in steps], device=dev)
    pos = torch.tensor([[s.cache.length] for s in steps], device=dev)
    batch = BatchCache([s.cache for s in steps], batched_sparse)
    # a decoded token comes after the passages: its row reads through the adapter when its cache has one
    gate = gate_of(torch.tensor([[float(s.cache.adapted)] for s in steps])) if any(s.cache.adapted for s in steps) else None
    with gated(gate.to(dev) if isinstance(gate, torch.Tensor) else gate):
        out = engine.model(input_ids=ids, position_ids=pos, **cache_kwargs(engine.model, batch), use_cache=True,
                           logits_to_keep=1, kvstitch_plan=ForwardPlan(batch=batch))
    logits = out.logits[:, -1:].float()
    return [logits[i] for i in range(len(steps))]



# ---- batched recompute passes ------------------------------------------------------------------------
@dataclass
class RecomputeStep:
    """One pending recompute pass of a request: ``ids`` at global positions ``slots`` (sorted) over ``cache``,
    its fresh K/V written into ``cache``; the result is the last token's logits ``[1, V]``.
    `Engine.steps(request, batch_prefill=True)` yields these (plain passes only, see
    `can_batch`); the consumer runs them (`Engine.recompute_batch`, several requests at once) and ``send``s
    back the logits. ``seconds`` / ``batch_size``: set by the pass that ran it (its wall time, its steps)."""

    cache: StitchCache
    ids: torch.Tensor
    slots: torch.Tensor
    plan: ForwardPlan | None = None
    seconds: float | None = None
    batch_size: int = 0


_PLAN_ANY = {"q_slots"}  # set by the pass itself


def plain_plan(plan: ForwardPlan | None) -> bool:
    """True when ``plan`` changes nothing about a forward (every field but ``q_slots`` at its default). A field
    added to `ForwardPlan` later makes plans that set it unbatchable until `PackedCache` learns it."""
    if plan is None:
        return True
    for f in fields(plan):
        if f.name in _PLAN_ANY:
            continue
        v = getattr(plan, f.name)
        if f.default_factory is not MISSING:
            if v:  # e.g. captured queries
                return False
        elif f.default is None:
            if v is not None:
                return False
        elif v != f.default:
            return False
    return True


def can_batch(step: RecomputeStep) -> bool:
    """The rule for packing a recompute pass with others: a plain plan (no attention hooks, early stops, query
    capture, APE scaling, key masks, sparse decoder) over a cache in its default modes (writes in place, no
    K/V capture, no decoder) and at least one token. Sliding-window layers pack: the window is applied per
    segment by the same attention call. Everything else runs alone."""
    c = step.cache
    return (plain_plan(step.plan) and step.ids.numel() > 0 and step.ids.numel() == step.slots.numel()
            and c.write and not c.capture and c.decoder is None and c.slots is None)


class PackedCache(Cache):
    """A transformers `Cache` over several requests' `StitchCache`s for one packed recompute pass: the token
    axis is cut into segments, segment i belongs to cache i."""

    def __init__(self, steps: list[RecomputeStep], slots: list[torch.Tensor]):
        super().__init__(layers=steps[0].cache.layers)  # protocol only: every call below is routed per segment
        self.caches = [s.cache for s in steps]
        self.slots = slots  # each segment's slots, on the model's device
        bounds = [0]
        for s in steps:
            bounds.append(bounds[-1] + s.ids.numel())
        self.bounds = bounds
        self.seg_kv: list[tuple[torch.Tensor, torch.Tensor]] = []

    def segments(self):
        return zip(self.bounds[:-1], self.bounds[1:])

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        # each cache is in mode(slots=its slots): its segment's K/V overwrite its own slots
        self.seg_kv = [c.update(key_states[:, :, a:b], value_states[:, :, a:b], layer_idx)
                       for c, (a, b) in zip(self.caches, self.segments())]
        return key_states, value_states  # unused: the attention reads `seg_kv` (see `attend`)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return max(c.get_seq_length(layer_idx) for c in self.caches)

    def attend(self, module, query, **kwargs):
        """Per-segment attention: segment i's queries over cache i at its slots, as a lone pass computes it."""
        outs = []
        for (k, v), s, (a, b) in zip(self.seg_kv, self.slots, self.segments()):
            out, _ = kvstitch_attention(module, query[:, :, a:b], k, v, kvstitch_plan=ForwardPlan(q_slots=s),
                                        **kwargs)
            outs.append(out)  # [1, n_i, Hq, d]
        return torch.cat(outs, dim=1), None


@torch.no_grad()
def recompute_batch(engine, steps: list[RecomputeStep]) -> list[torch.Tensor]:
    """Run recompute passes as one packed forward -> each step's last-token logits ``[1, V]`` (float32).
    One step is the lone path (`Engine.forward`); several that `can_batch` refuses raise InputError."""
    if not steps:
        return []
    t0 = time.perf_counter()
    if len(steps) == 1:
        s = steps[0]
        out = [engine.forward(s.cache, s.ids, s.slots, s.plan)]
    else:
        for s in steps:
            if not can_batch(s):
                raise InputError("a recompute pass with a non-plain plan or cache mode cannot be packed; run it alone")
        if len({id(s.cache) for s in steps}) != len(steps):
            raise InputError("two packed recompute passes share one cache")
        dev = engine.device
        slots = [s.slots.to(dev) for s in steps]
        packed = PackedCache(steps, slots)
        ids = torch.cat([s.ids.reshape(-1).to(dev) for s in steps]).view(1, -1)
        pos = torch.cat(slots).view(1, -1)
        last = torch.tensor(packed.bounds[1:], device=dev) - 1
        with ExitStack() as stack:
            for s, sl in zip(steps, slots):
                stack.enter_context(s.cache.mode(slots=sl, write=True))
            if any(s.cache.adapted for s in steps):
                stack.enter_context(gated(gate_of(torch.cat([s.cache.reader_gate(sl) for s, sl in zip(steps, slots)]))))
            res = engine.model(input_ids=ids, position_ids=pos, **cache_kwargs(engine.model, packed), use_cache=True,
                               logits_to_keep=last, kvstitch_plan=ForwardPlan(batch=packed))
        logits = res.logits[0].float()
        out = [logits[i:i + 1] for i in range(len(steps))]
    dt = time.perf_counter() - t0
    for s in steps:
        s.seconds, s.batch_size = dt, len(steps)
    return out
