"""`GenerationStats`: what the engine reports about one generation (`GenerationResult.stats`).

During prefill the engine, the adaptive budget and the selectors write into a plain dict (`Prefill.stats`:
selectors report what they measured under keys of their own, the eval adds its bookkeeping); the result turns
it into this typed object. Every key the engine writes is a documented field; keys of the method (InfoFlow's
layers, A3's eviction, CacheClip's grouping, ...) and keys callers add later go to ``extra``.

A field that is None was not reported by this generation (``converged`` is None unless the ratio was "auto",
``guard`` unless ``guard="full"``, ``decoder`` unless a sparse decoder ran past the first token, ...).
`to_dict` is the JSON form: the reported fields and ``extra``, flat, under the same keys as the fields.

Reading the stats as a mapping (``stats["ratio_used"]``, ``stats.get("converged")``, ``"guard" in stats``,
``{**stats}``) keeps working: a field reads as its key, an unreported field as a missing key, and ``extra``'s
keys as keys. It is kept so string readers need no change, but it is deprecated: new code reads attributes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass, field
from typing import Any


@dataclass
class GenerationStats(MutableMapping):
    # ---- the request, as the engine laid it out ------------------------------------------------------
    method: str = ""  # the method's label: its spec string, or its alias (`kvstitch.select.Selector.label`)
    ratio: float | str | None = None  # the requested recompute ratio: a fraction of the context, or "auto"
    prefix_tokens: int = 0  # the shared prefix (system prompt / template head), attention sink of every chunk
    context_tokens: int = 0  # the chunks
    suffix_tokens: int = 0  # question + template tail, always computed fresh
    chunks: int = 0  # number of chunks
    # ---- where the chunk caches came from ------------------------------------------------------------
    store_hits: int | None = None  # chunks found in the store
    store_misses: int | None = None  # chunks precomputed for this request (or deferred: ``cold_path``)
    precompute: str | None = None  # how chunk caches are computed: "shared_prefix" or "isolated"
    anchors_added: int | None = None  # stored chunks that got their anchor scores added (qcfuse)
    cold_path: str | None = None  # "stitched" or "full_prefill" (too much of the context missing from the store)
    store_missing_fraction: float | None = None  # of the context tokens, missing from the store
    deferred_chunks: int | None = None  # missing chunks queued to be precomputed after the answer
    # per chunk: "memory" (a tiered store's memory tier), "store" (a tier behind it, or an untiered store), "computed"
    chunk_sources: list[str] | None = None
    # ---- what was recomputed -------------------------------------------------------------------------
    ratio_used: float = 0.0  # context tokens with fresh K/V in the final cache / context tokens (1.0: full prefill)
    recomputed_tokens: int = 0  # context tokens recomputed (fewer than the budget for grouping methods)
    order: list[int] = field(default_factory=list)  # chunk order of the prompt (original chunk ids; InfoFlow reorders)
    recompute_batch: int | None = None  # requests packed into the recompute pass (the batching server)
    stitch_adapter: str | None = None  # the stitch adapter the stitched cache was read through (its form)
    # ---- stage times (seconds) -----------------------------------------------------------------------
    tokenize_s: float = 0.0  # laying out the prompt and checking the request
    chunk_load_s: float | None = None  # store look-ups and precompute of the misses
    anchor_s: float | None = None  # anchor scores computed for stored chunks (qcfuse)
    assemble_s: float | None = None  # stitching (RoPE re-rotation into one cache)
    select_s: float | None = None  # the method's selection (scoring included)
    recompute_s: float | None = None  # the recompute pass (all rounds for "auto"; full prefill when it answers)
    fallback_s: float | None = None  # "auto" that did not converge: the full prefill that answered instead
    ttft_s: float = 0.0  # time to the first answer token (the guard's check included)
    tpot_s: float = 0.0  # mean time per answer token after the first
    # ---- the adaptive budget (ratio "auto", `kvstitch.engine.budget`) ----------------------------------
    converged: bool | None = None  # a round's answer was stable (else full prefill or the ceiling answered)
    rounds: int | None = None  # rounds run (0: skipped, see ``auto_skipped``)
    recompute_cost: float | None = None  # context tokens forwarded over all rounds (fallback included) / context
    round_log: list[dict] | None = None  # per round: ratio, new_tokens, agreed, kl, first_divergence, probe, ...
    signal: float | None = None  # the last round's mean KL to the round before
    auto_skipped: str | None = None  # why no round ran: "short_context" or "few_chunks"
    verify: dict | None = None  # verified rounds: {"chunks", "answer" (the short prompt's), "seconds"}
    auto_spec: str | None = None  # the options the rounds ran with, as a spec ("auto", "auto(tol=0.05)")
    # ---- the guard (guard="full", `kvstitch.engine.verify`) ---------------------------------------
    guard: dict | None = None  # {"agreed", "first_divergence", "check_s"}
    # ---- decoding ------------------------------------------------------------------------------------
    decode_tokens: int = 0  # answer tokens (EOS included when produced)
    # the decode policy's canonical spec ("dense", "prkv", "prkv(static_ratio=0.5)"); unset when one token answered
    decode_policy: str | None = None
    batched_decode: bool | None = None  # steps ran in the server's batched decode passes
    kv_budget: int | None = None  # the sparse decoder's K/V budget (tokens)
    decoder: dict | None = None  # the sparse decoder's counters (`SparseDecoder.stats`)
    decode_recall: dict | None = None  # attention recall of the sparse steps (decode_options diagnostic=True)
    # ---- everything else -----------------------------------------------------------------------------
    extra: dict[str, Any] = field(default_factory=dict)  # the method's own keys, and keys callers add

    @classmethod
    def from_dict(cls, stats: dict) -> "GenerationStats":
        """The typed form of a prefill's stats dict: known keys to their fields, the rest to ``extra``."""
        known = FIELDS.keys() & stats.keys()
        return cls(**{k: stats[k] for k in known},
                   extra={k: v for k, v in stats.items() if k not in FIELDS})

    def to_dict(self) -> dict:
        """JSON form: the reported fields (not None) and ``extra``'s keys, flat."""
        out = {k: getattr(self, k) for k in FIELDS if getattr(self, k) is not None}
        out.update(self.extra)
        return out

    # ---- mapping access (deprecated: read the attributes) --------------------------------------------
    def __getitem__(self, key: str):
        if key in FIELDS:
            value = getattr(self, key)
            if value is None:
                raise KeyError(key)
            return value
        return self.extra[key]

    def __setitem__(self, key: str, value) -> None:
        if key in FIELDS:
            setattr(self, key, value)
        else:
            self.extra[key] = value

    def __delitem__(self, key: str) -> None:
        if key in FIELDS:
            if getattr(self, key) is None:
                raise KeyError(key)
            f = FIELDS[key]
            setattr(self, key, f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default)
        else:
            del self.extra[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.to_dict())

    def __len__(self) -> int:
        return len(self.to_dict())


FIELDS: dict[str, dataclasses.Field] = {f.name: f for f in dataclasses.fields(GenerationStats) if f.name != "extra"}
