"""Precompute a document folder's chunk caches into a store (resumable, idempotent).

Chunks are keyed by content (model fingerprint, shared-prefix ids, chunk ids), so a second run — or a
second process on the same store — skips everything already stored, and an interrupted run resumes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from .chunking import chunk_directory
from .engine import Engine


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


def precompute_directory(engine: Engine, docs_dir, chunk_tokens: int = 256, overlap: int = 0,
                         batch_size: int = 8, progress: bool = True) -> tuple[PrecomputeReport, list[tuple[str, str]]]:
    """Chunk every document, precompute the chunks missing from ``engine.store`` (after every canonical
    prefix: `PromptBuilder.canonical_prefixes`), write them back.
    Returns the report and the ``(document, chunk text)`` list (what `index` embeds)."""
    chunks = chunk_directory(docs_dir, engine.tokenizer, chunk_tokens, overlap)
    # one cache per chunk and canonical prefix (the question layout's and the conversation layout's)
    chunk_ids = [engine.builder.encode_chunk(text) for _, text in chunks]
    pairs = [(prefix, c) for prefix in engine.builder.canonical_prefixes() for c in chunk_ids]
    keys = [engine.chunk_key(prefix, c) for prefix, c in pairs]
    todo = [i for i, k in enumerate(keys) if k not in engine.store]
    rep = PrecomputeReport(chunks=len(chunks), skipped=len(pairs) - len(todo))
    t0 = time.perf_counter()
    columns = [TextColumn("precompute"), BarColumn(), MofNCompleteColumn(),
               TextColumn("{task.fields[tps]:,.0f} tok/s"), TimeRemainingColumn()]
    with Progress(*columns, disable=not progress) as bar:
        task = bar.add_task("precompute", total=len(todo), tps=0.0)
        batches: list[list[int]] = []  # up to batch_size chunks after one prefix
        for i in todo:
            if batches and len(batches[-1]) < batch_size and pairs[batches[-1][0]][0] is pairs[i][0]:
                batches[-1].append(i)
            else:
                batches.append([i])
        for batch in batches:
            with torch.no_grad():
                kvs = engine.compute_chunks(pairs[batch[0]][0], [pairs[i][1] for i in batch], batch_size=batch_size)
            for i, kv in zip(batch, kvs):
                engine.store.put(keys[i], kv)
                rep.tokens += kv.n_tokens
            rep.computed += len(batch)
            rep.seconds = time.perf_counter() - t0
            bar.update(task, advance=len(batch), tps=rep.tokens_per_s)
    rep.seconds = time.perf_counter() - t0
    return rep, chunks
