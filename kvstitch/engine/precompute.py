"""The one way chunk caches come to exist: `ensure_chunks` (look up, compute the misses batched, store).

Every path that needs chunk caches goes through it: a request (`Engine.chunk_kvs`, which also loads the
caches), `kvstitch precompute` (`precompute_directory`), `kvstitch index` (`retrieval.precompute_chunks`),
the server's document API and the Ray workers (`kvstitch.corpus.ray_precompute`). Chunks are keyed by content
(`Engine.chunk_key`: model, tokenizer, storage dtype, shared prefix, chunk ids), so a second run — or a
second process on the same store — skips everything already stored, and an interrupted run resumes.
Within one call a chunk that occurs twice is computed once.

``anchors`` (an `AnchorSpec`, what `qcfuse` asks for): each chunk also gets QCFuse's anchor scores
(`kvstitch.core.anchors`), stored in its entry: computed with the chunk when it is computed, and added to
an entry stored without them (the entry's K/V bytes untouched, `ChunkStore.add_anchors`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch

from kvstitch.core.cache import StitchCache
from kvstitch.core.chunk import ChunkKV
from kvstitch.core.errors import InputError
from kvstitch.text.chunking import DOCUMENT_CHUNK_TOKENS, chunk_directory
from kvstitch.core.anchors import AnchorSpec, anchor_scores
from kvstitch.core.prompt import PromptBuilder
from kvstitch.store.codec import roundtrip
from kvstitch.models.stitch_adapter import writing


class ChunkComputer(Protocol):
    """What precompute needs of an engine (`kvstitch.Engine` is one): its store, how it keys and computes a
    chunk's K/V. Typed against this, not the engine, so the engine can import precompute without a cycle."""

    store: Any
    builder: PromptBuilder
    tokenizer: Any
    dtype: torch.dtype
    fingerprint: str
    precompute_mode: str

    def chunk_key(self, prefix_ids: torch.Tensor, chunk_ids: torch.Tensor) -> str: ...

    def compute_chunks(self, prefix_ids: torch.Tensor, chunks: list[torch.Tensor],
                       batch_size: int = 8) -> list[ChunkKV]: ...

    # the anchor pass (``anchors=``) runs the model itself: `forward`, `prefix_kv`, `adapter`, `device`
    def forward(self, cache, ids: torch.Tensor, slots: torch.Tensor, plan=None, logits_to_keep: int = 1,
                write: bool = True): ...

    def prefix_kv(self, prefix_ids: torch.Tensor): ...


@dataclass
class EnsureResult:
    """What `ensure_chunks` did. `keys` (and `kvs` when loading) have one entry per input chunk."""

    keys: list[str]
    kvs: list[ChunkKV] | None = None
    hits: int = 0          # input chunks found in the store
    misses: int = 0        # input chunks not found (a repeated chunk counts at each occurrence)
    computed: int = 0      # distinct chunks computed and stored
    already_stored: int = 0  # distinct chunks found stored
    tokens: int = 0        # tokens of the computed chunks
    seconds: float = 0.0   # compute + store time
    computed_keys: list[str] = field(default_factory=list)
    all_keys: list[list[str]] = field(default_factory=list)  # every key of each input chunk (one per prefix)
    anchored: int = 0      # stored chunks whose anchor scores were computed and added (``anchors=``)
    anchor_s: float = 0.0  # time of the anchor passes (also those of computed chunks)


def ensure_chunks(engine: ChunkComputer, chunk_ids: list[torch.Tensor], *, prefix_ids: torch.Tensor | None = None,
                  load: bool = False, batch_size: int = 8,
                  on_batch: Callable[[int, int, int], None] | None = None,
                  anchors: AnchorSpec | None = None) -> EnsureResult:
    """Make sure every chunk's K/V is in ``engine.store``: compute the missing ones (distinct chunks,
    ``batch_size`` per forward, in first-occurrence order) and write them back.

    ``prefix_ids``: the shared prefix of the request the chunks are for. None (precompute ahead of requests)
    = every canonical prefix (`PromptBuilder.canonical_prefixes`: the question layout's and the conversation
    layout's), so both kinds of request find their chunks; ``result.keys`` are then the first prefix's and
    ``result.all_keys[i]`` every key of chunk i.

    ``load=False`` checks presence only (no entry is read). ``load=True`` reads every stored chunk
    (refusing a foreign entry or one whose token ids differ: it is recomputed) and returns each input
    chunk's `ChunkKV` in ``result.kvs``; a freshly computed one is given in the form a later hit will
    return (storage dtype round trip), so cold and warm requests agree.
    ``on_batch(done, total, tokens)`` is called after each computed batch (distinct chunks).
    ``anchors``: every chunk also carries (and its entry stores) the anchor scores of that pass (module doc)."""
    if prefix_ids is None:
        if load:
            raise ValueError("ensure_chunks(load=True) needs the request's prefix_ids")
        total: EnsureResult | None = None
        for prefix in engine.builder.canonical_prefixes():
            res = _ensure(engine, chunk_ids, prefix, False, batch_size, on_batch, anchors)
            if total is None:
                total = res
                continue
            for i, k in enumerate(res.keys):
                total.all_keys[i].append(k)
            total.hits += res.hits
            total.misses += res.misses
            total.computed += res.computed
            total.already_stored += res.already_stored
            total.tokens += res.tokens
            total.seconds += res.seconds
            total.computed_keys += res.computed_keys
            total.anchored += res.anchored
            total.anchor_s += res.anchor_s
        return total
    return _ensure(engine, chunk_ids, prefix_ids, load, batch_size, on_batch, anchors)


def _ensure(engine: ChunkComputer, chunk_ids: list[torch.Tensor], prefix: torch.Tensor, load: bool, batch_size: int,
            on_batch: Callable[[int, int, int], None] | None, anchors: AnchorSpec | None = None) -> EnsureResult:
    store = engine.store
    keys = [engine.chunk_key(prefix, ids) for ids in chunk_ids]
    start = 0 if engine.precompute_mode == "isolated" else prefix.numel()  # where a valid entry was computed
    tag = anchors.tag(engine.tokenizer) if anchors is not None else ""
    first: dict[str, int] = {}
    for i, key in enumerate(keys):
        first.setdefault(key, i)
    found: dict[str, ChunkKV | None] = {}
    present: dict[str, bool] = {}
    for key, i in first.items():
        if load or anchors is not None:  # whether an entry has anchors is known only by reading it
            kv = store.lookup(key)
            if kv is not None and (kv.fingerprint != engine.fingerprint or kv.start != start
                                   or not torch.equal(kv.token_ids, chunk_ids[i].cpu())):
                kv = None  # a key collision, a foreign entry or another precompute mode: never use it
            found[key] = kv
            present[key] = kv is not None
        else:
            present[key] = key in store
    res = EnsureResult(keys=keys, all_keys=[[k] for k in keys])
    if anchors is not None:
        _add_anchors(engine, prefix, found, anchors, tag, res)
    res.hits = sum(present[k] for k in keys)
    res.misses = len(keys) - res.hits
    res.already_stored = sum(present.values())
    todo = [k for k in first if not present[k]]
    storage = getattr(store, "storage_dtype", "float32")
    t0 = time.perf_counter()
    for b in range(0, len(todo), batch_size):
        part = todo[b:b + batch_size]
        with torch.no_grad():
            fresh = forward_chunks(engine, prefix, [chunk_ids[first[k]] for k in part], batch_size)
        for key, kv in zip(part, fresh):
            if anchors is not None:  # scored on the stored form: the same anchors as a later on-demand pass
                t1 = time.perf_counter()
                loaded = roundtrip(kv, storage, engine.dtype)
                scores = anchor_scores(engine, prefix, loaded, anchors)
                kv, found[key] = kv.with_anchors(scores, tag), loaded.with_anchors(scores, tag)
                res.anchor_s += time.perf_counter() - t1
            store.put(key, kv)
            res.tokens += kv.n_tokens
            if load and anchors is None:
                found[key] = roundtrip(kv, storage, engine.dtype)
        res.computed += len(part)
        res.computed_keys += part
        res.seconds = time.perf_counter() - t0
        if on_batch is not None:
            on_batch(res.computed, len(todo), res.tokens)
    res.seconds = time.perf_counter() - t0
    if load:
        res.kvs = [found[k] for k in keys]
    return res


def _add_anchors(engine: ChunkComputer, prefix: torch.Tensor, found: dict, spec: AnchorSpec, tag: str,
                 res: EnsureResult) -> None:
    """Stored chunks without the anchors of ``tag``: compute them and add them to the entry."""
    t0 = time.perf_counter()
    for key, kv in found.items():
        if kv is None or kv.has_anchors(tag):
            continue
        scores = anchor_scores(engine, prefix, kv, spec)
        found[key] = kv.with_anchors(scores, tag)
        engine.store.add_anchors(key, scores, tag)  # False (not kept) on a backend that cannot: computed again
        res.anchored += 1
    res.anchor_s += time.perf_counter() - t0


def forward_chunks(engine, prefix_ids: torch.Tensor, chunks: list[torch.Tensor], batch_size: int = 8) -> list[ChunkKV]:
    """`Engine.compute_chunks`: the chunks' K/V by the engine's forward, ``batch_size`` per pass, each chunk after
    the shared prefix (or, ``isolated``, alone from position 0). Chunks of a batch are right-padded to one length;
    causal masks keep every real token blind to the padding after it."""
    pk, pv = engine.prefix_kv(prefix_ids)
    p = prefix_ids.numel()
    if engine.precompute_mode == "isolated":
        pk, pv, p = pk[:, :, :0], pv[:, :, :0], 0
    out: list[ChunkKV] = []
    writes = engine.stitch_adapter is not None and engine.stitch_adapter.writes
    for b0 in range(0, len(chunks), batch_size):
        batch = chunks[b0:b0 + batch_size]
        n = max(c.numel() for c in batch)
        ids = torch.full((len(batch), n), int(batch[0][0]), dtype=torch.long)
        for i, c in enumerate(batch):
            ids[i, :c.numel()] = c
        cache = StitchCache.from_stacked(pk, pv, capacity=p + n, batch=len(batch))
        with writing(writes):  # the stitch adapter's writer, if any (its caches have their own key)
            engine.forward(cache, ids, torch.arange(p, p + n))
        keys, values = cache.stacked_keys(p, p + n, batch=True), cache.stacked_values(p, p + n, batch=True)
        for i, c in enumerate(batch):
            m = c.numel()
            out.append(ChunkKV(keys[i, :, :, :m].clone(), values[i, :, :, :m].clone(), c.clone().cpu(), p,
                               engine.fingerprint))
    return out


def load_chunk_kvs(engine, layout, stats: dict | None = None, anchors: AnchorSpec | None = None) -> list[ChunkKV]:
    """`Engine.chunk_kvs`: every chunk of ``layout`` from the store, the misses computed and stored, on the engine's
    device and dtype; store hits, misses and the time taken recorded in ``stats``."""
    t0 = time.perf_counter()
    front = _memory_front(engine.store) if stats is not None else None
    # asked before the load, which promotes hits into the memory tier
    local = [engine.chunk_key(layout.prefix_ids, ids) in front for ids in layout.chunk_ids] \
        if front is not None else None
    res = ensure_chunks(engine, layout.chunk_ids, prefix_ids=layout.prefix_ids, load=True, anchors=anchors)
    if stats is not None:
        stats.update(store_hits=res.hits, store_misses=res.misses, chunk_load_s=time.perf_counter() - t0,
                     precompute=engine.precompute_mode)
        computed = set(res.computed_keys)
        stats["chunk_sources"] = ["computed" if k in computed else "memory" if local and local[i] else "store"
                                  for i, k in enumerate(res.keys)]
        if anchors is not None:
            stats.update(anchors_added=res.anchored, anchor_s=res.anchor_s)
    return [kv.to(engine.device, engine.dtype) for kv in res.kvs]


def _memory_front(store):
    """The memory tier in front of a tiered store (through the resilient wrapper), or None: where a hit is local.
    A tenant's store maps keys, so it is not looked through."""
    from kvstitch.store import MemoryStore, TieredStore
    from kvstitch.store.resilient import ResilientStore

    store = store.inner if isinstance(store, ResilientStore) else store
    if isinstance(store, TieredStore) and isinstance(store.tiers[0], MemoryStore) and len(store.tiers) > 1:
        return store.tiers[0]
    return None


def check_anchors(anchors) -> AnchorSpec | None:
    """`Engine.precompute`'s ``anchors``: True (QCFuse's default pass), an `AnchorSpec` or None (no anchors)."""
    if anchors is True:
        anchors = AnchorSpec()
    elif anchors is not None and not isinstance(anchors, AnchorSpec):
        raise InputError(f"anchors must be True, None or an AnchorSpec, got {anchors!r:.60}")
    return anchors or None


# ---- a document folder (`kvstitch precompute`) ---------------------------------------------------------
@dataclass
class PrecomputeReport:
    chunks: int = 0
    computed: int = 0
    skipped: int = 0
    tokens: int = 0
    seconds: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def progress_bar(progress: bool = True):
    """The rich progress bar every precompute shares: done/total, chunks/s, tokens/s, ETA."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("{task.fields[cps]:,.1f} chunks/s"), TextColumn("{task.fields[tps]:,.0f} tok/s"),
               TimeRemainingColumn()]
    return Progress(*columns, disable=not progress)


def directory_chunks(engine: ChunkComputer, docs_dir, chunk_tokens: int = DOCUMENT_CHUNK_TOKENS,
                     overlap: int = 0) -> tuple[list[tuple[str, str]], list[torch.Tensor]]:
    """``(document, chunk text)`` pairs of a folder and each chunk's token ids (as a request builds them)."""
    chunks = chunk_directory(docs_dir, engine.tokenizer, chunk_tokens, overlap)
    return chunks, [engine.builder.encode_chunk(text) for _, text in chunks]


def precompute_directory(engine: ChunkComputer, docs_dir, chunk_tokens: int = DOCUMENT_CHUNK_TOKENS, overlap: int = 0,
                         batch_size: int = 8, progress: bool = True) -> tuple[PrecomputeReport, list[tuple[str, str]]]:
    """Chunk every document, precompute the chunks missing from ``engine.store`` (after every canonical
    prefix: `PromptBuilder.canonical_prefixes`), write them back.
    Returns the report and the ``(document, chunk text)`` list (what `index` embeds)."""
    chunks, ids = directory_chunks(engine, docs_dir, chunk_tokens, overlap)
    return precompute_ids(engine, ids, batch_size, progress), chunks


def precompute_texts(engine: ChunkComputer, texts: list[str], chunk_tokens: int | None = None, overlap: int = 0,
                     batch_size: int = 8, progress: bool = True, anchors: AnchorSpec | None = None) -> PrecomputeReport:
    """Cache passages ahead of the questions. ``chunk_tokens`` None: each text is one chunk, exactly as
    ``generate(chunks=texts)`` will use it; else each text is a document split into chunks of about that many
    tokens (`kvstitch.text.chunking.chunk_text`, as `kvstitch precompute` does)."""
    from kvstitch.text.chunking import chunk_text
    from kvstitch.core.prompt import check_chunks

    texts = check_chunks(texts)
    if chunk_tokens is not None:
        texts = [c for t in texts for c in chunk_text(t, engine.tokenizer, chunk_tokens, overlap)]
    return precompute_ids(engine, [engine.builder.encode_chunk(t) for t in texts], batch_size, progress, anchors)


def precompute_ids(engine: ChunkComputer, ids: list[torch.Tensor], batch_size: int = 8,
                   progress: bool = True, anchors: AnchorSpec | None = None) -> PrecomputeReport:
    """`ensure_chunks` for every canonical prefix, with the shared progress bar and a report."""
    t0 = time.perf_counter()
    with progress_bar(progress) as bar:
        task = bar.add_task("precompute", total=None, tps=0.0, cps=0.0)

        def step(done: int, total: int, tokens: int) -> None:
            dt = time.perf_counter() - t0
            bar.update(task, completed=done, total=total, tps=tokens / dt if dt else 0.0,
                       cps=done / dt if dt else 0.0)

        # every canonical prefix
        res = ensure_chunks(engine, ids, batch_size=batch_size, on_batch=step, anchors=anchors)
    return PrecomputeReport(chunks=len(ids), computed=res.computed, skipped=res.already_stored,
                            tokens=res.tokens, seconds=time.perf_counter() - t0)
