"""Collections: chunk a directory of documents, embed the chunks, keep the index next to the KV store,
precompute every chunk's KV cache, and retrieve the top-k chunks for a question.

    col = build_index(engine, "docs/", "manuals")      # chunk + embed + persist + precompute chunk caches
    col = load_collection("manuals", root)             # reload (no model needed)
    hits = col.search("How do I reset the router?", k=4)
    result, hits = ask_collection(engine, "How do I reset the router?", "manuals", root)

Embeddings (`kvstitch.corpus.embedding`): MiniLM sentence embeddings, so a dot product is the cosine
similarity. When the model is absent (or ``KVSTITCH_EMBEDDER=bm25``) the index falls back to BM25 over the
chunk texts, at index time and at query time.

Small-to-big (``block_chunks`` K > 1; by default K = 4 over 128-token chunks, `kvstitch.corpus.units`): the
chunks are still what is embedded and ranked, but the cache unit, what is precomputed, stored and stitched, is the
fixed block of K consecutive chunks of one document that holds a retrieved chunk (each block once, in the order
of its best chunk). Larger cache units keep more of the
cross-passage attention that separate precompute loses, and ranking the small chunks keeps retrieval as precise
as small chunks retrieve (docs/results/squad/retrieval-small-to-big).

On disk (``ROOT/<collection>/``): ``chunks.jsonl`` (one chunk a line: id, doc, text, token count, store
key; with blocks, the block it belongs to), ``blocks.jsonl`` (small-to-big only: the cache units, the same
fields), ``embeddings.safetensors`` (float32 [n_chunks, dim]; absent for BM25) and ``collection.json``
(metadata, written last: a collection without it does not exist). ROOT defaults to ``STORE/collections``
for a directory store, else ``$KVSTITCH_CACHE/collections``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import secrets
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvstitch.text.bm25 import BM25, bm25_tokens  # noqa: F401  (re-exported: the collection's fallback)
from kvstitch.core.errors import InputError, KVStitchError
from kvstitch.text.chunking import chunk_directory
from .embedding import Embedder, get_embedder
from .embedding import EMBED_MODEL_NAME, embedder_dir  # noqa: F401  (re-exported: callers import them here)
from .units import (INDEX_BLOCK_CHUNKS, INDEX_CHUNK_TOKENS, Chunk, default_block_chunks,  # noqa: F401  (part of
                    group_blocks, take_units)  # this module's API: Chunk, group_blocks, INDEX_BLOCK_CHUNKS)

log = logging.getLogger("kvstitch.retrieval")

FORMAT_VERSION = 1
META = "collection.json"
CHUNKS = "chunks.jsonl"
BLOCKS = "blocks.jsonl"
EMBEDDINGS = "embeddings.safetensors"
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


class CollectionNotFound(KVStitchError, LookupError):
    """No collection of that name under the collections root."""


def check_collection_name(name) -> str:
    """Collection names come from clients (the server): letters, digits, ``._-`` only, no paths."""
    if not isinstance(name, str) or _NAME_RE.fullmatch(name) is None or name.endswith((".tmp", ".")):
        raise InputError(f"invalid collection name {name!r:.80}: use 1-64 letters, digits, '.', '_' or '-' "
                         "(starting with a letter or digit)")
    return name


# ---- where collections live ------------------------------------------------------------------------
def collections_root(store=None, explicit: str | os.PathLike | None = None) -> Path:
    """The collections directory: `explicit`, else ``<store dir>/collections`` for a directory store (a
    path spec, a DiskStore, or a tiered store with a disk tier), else ``$KVSTITCH_CACHE/collections``."""
    if explicit is not None:
        return Path(explicit).expanduser()
    d = _store_dir(store)
    if d is not None:
        return d / "collections"
    from kvstitch.models.loader import cache_root

    return cache_root() / "collections"


def _store_dir(store) -> Path | None:
    if store is None:
        return None
    if isinstance(store, os.PathLike):
        store = os.fspath(store)
    if isinstance(store, str):
        s = store.strip()
        if s.startswith("tiered:"):
            for part in s[len("tiered:"):].split(","):
                d = _store_dir(part)
                if d is not None:
                    return d
            return None
        if not s or s == "memory" or ("://" in s and not s.startswith("file://")):
            return None
        return Path(s.removeprefix("file://")).expanduser()
    root = getattr(store, "root", None)  # DiskStore
    if isinstance(root, Path):
        return root
    for tier in getattr(store, "tiers", []) or []:  # TieredStore
        d = _store_dir(tier)
        if d is not None:
            return d
    return None


# ---- the collection --------------------------------------------------------------------------------
@dataclass
class Hit:
    rank: int
    score: float
    chunk: Chunk

    @property
    def id(self) -> str:
        return self.chunk.id

    @property
    def text(self) -> str:
        return self.chunk.text

    def as_dict(self) -> dict:
        return {"rank": self.rank, "id": self.chunk.id, "doc": self.chunk.doc, "score": round(self.score, 6)}


@dataclass
class Collection:
    name: str
    chunks: list[Chunk]
    backend: str  # "embedding" | "bm25"
    embeddings: torch.Tensor | None = None  # [n, dim] float32 unit rows (embedding backend)
    meta: dict = field(default_factory=dict)
    path: Path | None = None
    blocks: list[Chunk] | None = None  # small-to-big cache units (None: each chunk is its own)
    _bm25: BM25 | None = field(default=None, repr=False)

    def __len__(self) -> int:
        return len(self.chunks)

    @property
    def units(self) -> list[Chunk]:
        """What is precomputed and stitched: the blocks (small-to-big), else the chunks."""
        return self.chunks if self.blocks is None else self.blocks

    @property
    def bm25(self) -> BM25:
        if self._bm25 is None:
            self._bm25 = BM25([c.text for c in self.chunks])
        return self._bm25

    def scores(self, query: str, embedder: Embedder | None = None) -> tuple[torch.Tensor, str]:
        """(score per chunk, the backend used). An embedding index queried without its embedding model
        (package absent) falls back to BM25."""
        if self.backend == "embedding" and self.embeddings is not None:
            emb = embedder if embedder is not None else get_embedder()
            if emb is not None and emb.dim == self.embeddings.shape[1]:
                return self.embeddings @ emb.encode([query])[0], "embedding"
            log.warning("collection %s: embedding model unavailable, using BM25", self.name)
        return self.bm25.scores(query), "bm25"

    def search(self, query: str, k: int | None = 4, embedder: Embedder | None = None,
               max_tokens: int | None = None) -> list[Hit]:
        """The top-`k` units (`units`) for `query`, best first (ties: index order); a block ranks as its best
        chunk. `max_tokens`: also stop before the first unit that would take the units' tokens past it
        (``k=None``: as many as fit)."""
        if not isinstance(query, str) or not query.strip():
            raise InputError("the query is empty")
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or k < 1):
            raise InputError(f"top_k must be a positive integer, got {k!r}")
        if k is None and max_tokens is None:
            raise InputError("search needs k or max_tokens")
        if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
            raise InputError(f"max_tokens must be a positive integer, got {max_tokens!r}")
        if not self.chunks:
            return []
        scores, _ = self.scores(query, embedder)
        # stable: sort by (-score, index)
        order = sorted(range(len(self.chunks)), key=lambda i: (-float(scores[i]), i))
        taken = take_units(order, self.chunks, self.blocks, k, max_tokens)
        return [Hit(r, float(scores[i]), self.units[u]) for r, (u, i) in enumerate(taken)]

    # -- persistence ---------------------------------------------------------------------------
    def save(self, root: str | os.PathLike) -> Path:
        check_collection_name(self.name)
        d = Path(root) / self.name
        d.mkdir(parents=True, exist_ok=True)
        chunks_bytes = _jsonl(self.chunks)
        (d / META).unlink(missing_ok=True)  # a half-rewritten collection must not load
        _atomic_write(d / CHUNKS, chunks_bytes)
        blocks_bytes = None
        if self.blocks is not None:
            blocks_bytes = _jsonl(self.blocks)
            _atomic_write(d / BLOCKS, blocks_bytes)
        else:
            (d / BLOCKS).unlink(missing_ok=True)
        if self.embeddings is not None:
            from safetensors.torch import save

            _atomic_write(d / EMBEDDINGS, save({"embeddings": self.embeddings.float().contiguous()}))
        else:
            (d / EMBEDDINGS).unlink(missing_ok=True)
        meta = {**self.meta, "format": "kvstitch-collection", "version": FORMAT_VERSION, "name": self.name,
                "backend": self.backend, "n_chunks": len(self.chunks),
                "chunks_sha256": hashlib.sha256(chunks_bytes).hexdigest(),
                "blocks_sha256": hashlib.sha256(blocks_bytes).hexdigest() if blocks_bytes is not None else None,
                "dim": int(self.embeddings.shape[1]) if self.embeddings is not None else None}
        _atomic_write(d / META, (json.dumps(meta, indent=2, ensure_ascii=False) + "\n").encode())
        self.meta, self.path = meta, d
        return d


def _jsonl(chunks: list[Chunk]) -> bytes:
    return "".join(json.dumps({"id": c.id, "doc": c.doc, "text": c.text, "n_tokens": c.n_tokens, "key": c.key,
                               **({"block": c.block} if c.block is not None else {})}, ensure_ascii=False) + "\n"
                   for c in chunks).encode("utf-8")


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def list_collections(root: str | os.PathLike) -> list[str]:
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if (p / META).is_file() and _NAME_RE.fullmatch(p.name))


def load_collection(name: str, root: str | os.PathLike) -> Collection:
    """Load a saved collection; `CollectionNotFound` if there is none, `KVStitchError` if it is damaged."""
    check_collection_name(name)
    d = Path(root) / name
    if not (d / META).is_file():
        known = list_collections(root)
        raise CollectionNotFound(f"collection {name!r} not found under {root}; "
                                 + (f"known collections: {', '.join(known)}" if known else
                                    "no collections there yet (create one with `kvstitch index DOCS_DIR "
                                    "--collection NAME`)"))
    try:
        meta = json.loads((d / META).read_text(encoding="utf-8"))
        blob = (d / CHUNKS).read_bytes()
    except (OSError, ValueError) as e:
        raise KVStitchError(f"collection {name!r} at {d} is unreadable: {e}") from None
    if meta.get("format") != "kvstitch-collection" or meta.get("version") != FORMAT_VERSION:
        raise KVStitchError(f"collection {name!r} at {d} has an unsupported format/version")
    if hashlib.sha256(blob).hexdigest() != meta.get("chunks_sha256"):
        raise KVStitchError(f"collection {name!r} at {d} is damaged ({CHUNKS} checksum mismatch): re-index it")
    chunks = [Chunk(**json.loads(line)) for line in blob.decode("utf-8").splitlines() if line.strip()]
    blocks = None
    if meta.get("blocks_sha256"):
        try:
            blocks_blob = (d / BLOCKS).read_bytes()
        except OSError as e:
            raise KVStitchError(f"collection {name!r} at {d} is unreadable: {e}") from None
        if hashlib.sha256(blocks_blob).hexdigest() != meta["blocks_sha256"]:
            raise KVStitchError(f"collection {name!r} at {d} is damaged ({BLOCKS} checksum mismatch): re-index it")
        blocks = [Chunk(**json.loads(line)) for line in blocks_blob.decode("utf-8").splitlines() if line.strip()]
        if any(c.block is None or not 0 <= c.block < len(blocks) for c in chunks):
            raise KVStitchError(f"collection {name!r} at {d} is damaged (a chunk names no block): re-index it")
    emb = None
    if meta.get("backend") == "embedding":
        from safetensors.torch import load_file

        try:
            emb = load_file(str(d / EMBEDDINGS))["embeddings"]
        except Exception as e:  # noqa: BLE001
            raise KVStitchError(f"collection {name!r} at {d}: cannot read {EMBEDDINGS}: {e}") from None
        if emb.shape[0] != len(chunks):
            raise KVStitchError(f"collection {name!r} at {d}: {emb.shape[0]} embeddings for {len(chunks)} chunks")
    return Collection(name=name, chunks=chunks, backend=meta.get("backend", "bm25"), embeddings=emb, meta=meta,
                      path=d, blocks=blocks)


class CollectionCache:
    """Loaded collections by name, reloaded when ``collection.json`` changes (re-indexing). Thread-safe."""

    def __init__(self, root: str | os.PathLike | None):
        self.root = Path(root) if root is not None else None
        self._cache: dict[str, tuple[float, Collection]] = {}
        self._lock = threading.Lock()

    def names(self) -> list[str]:
        return list_collections(self.root) if self.root is not None else []

    def get(self, name: str) -> Collection:
        check_collection_name(name)
        if self.root is None:
            raise CollectionNotFound(f"collection {name!r} not found: this server has no collections directory "
                                     "(start it with --collections DIR or a directory --store)")
        meta = self.root / name / META
        try:
            mtime = meta.stat().st_mtime_ns
        except OSError:
            mtime = None
        with self._lock:
            hit = self._cache.get(name)
            if hit is not None and mtime is not None and hit[0] == mtime:
                return hit[1]
            col = load_collection(name, self.root)
            self._cache[name] = (mtime, col)
            return col


# ---- building an index -----------------------------------------------------------------------------
def build_index(engine, docs_dir: str | os.PathLike, name: str, root: str | os.PathLike,
                chunk_tokens: int = INDEX_CHUNK_TOKENS, overlap: int = 0, embedder: str | Embedder | None = "auto",
                precompute: bool = True, batch: int = 8, progress=None, block_chunks: int | None = None) -> Collection:
    """Chunk every ``*.txt``/``*.md`` in `docs_dir` with the engine's tokenizer, embed the chunks (BM25 when
    no embedding model: `embedder` "auto" | "bm25" | an `Embedder`), save under ``root/name`` and, with
    `precompute`, compute every cache unit's KV cache into the engine's store (misses only). `block_chunks`
    K > 1: small-to-big, the cache units are blocks of K consecutive chunks (`group_blocks`); by default
    blocks of `INDEX_BLOCK_CHUNKS` (none with `overlap`), K = 1 for the chunks themselves.

    ``progress(done, total)`` is called after each precompute batch. Returns the saved collection, with
    ``meta["precompute"]`` = `precompute_chunks`' report."""

    check_collection_name(name)
    block_chunks = default_block_chunks(block_chunks, overlap)
    pairs = chunk_directory(docs_dir, engine.tokenizer, chunk_tokens, overlap)
    if not pairs:
        raise InputError(f"no .txt or .md documents with text in {docs_dir}")
    per_doc: Counter = Counter()
    chunks = []
    for doc, text in pairs:
        chunks.append(Chunk(id=f"{doc}#{per_doc[doc]}", doc=doc, text=text))
        per_doc[doc] += 1
    blocks = group_blocks(chunks, block_chunks) if block_chunks > 1 else None
    # token counts + store keys (the same ids the engine will build for these passages)
    prefix = engine.builder.prefix_ids
    for c in chunks + (blocks or []):
        ids = engine.builder.build("?", [c.text]).chunk_ids[0]
        c.n_tokens = int(ids.numel())
        if blocks is None or c.block is None:  # a cache unit
            c.key = engine.chunk_key(prefix, ids)

    emb_model = get_embedder() if embedder in ("auto", None) else (embedder if isinstance(embedder, Embedder)
                                                                    else None)
    if embedder not in ("auto", "bm25", None) and not isinstance(embedder, Embedder):
        raise InputError(f"unknown embedder {embedder!r}: use auto or bm25")
    t0 = time.perf_counter()
    if emb_model is not None:
        embeddings, backend = emb_model.encode([c.text for c in chunks]), "embedding"
    else:
        embeddings, backend = None, "bm25"
    embed_s = time.perf_counter() - t0

    stats = {"computed": 0, "already_stored": 0, "seconds": 0.0}
    if precompute:
        stats = precompute_chunks(engine, [c.text for c in (blocks or chunks)], batch, progress)

    meta = {"docs_dir": str(Path(docs_dir).resolve()), "documents": len(per_doc), "chunk_tokens": chunk_tokens,
            "block_chunks": block_chunks, "overlap": overlap,
            "embed_model": emb_model.name if emb_model is not None else None,
            "embed_s": round(embed_s, 3), "model_fingerprint": engine.fingerprint,
            "store_dtype": getattr(engine.store, "storage_dtype", None), "precompute": stats,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    col = Collection(name=name, chunks=chunks, backend=backend, embeddings=embeddings, meta=meta, blocks=blocks)
    col.save(root)
    return col


def precompute_chunks(engine, texts: list[str], batch: int = 8, progress=None) -> dict:
    """Compute the KV cache of every passage not yet in ``engine.store`` (``batch`` chunks per forward)
    and store it. Existing entries are only checked for presence (not loaded). -> {"computed": distinct
    caches computed, "already_stored": distinct caches found, "seconds": s}."""
    from kvstitch.engine.precompute import ensure_chunks

    ids = [engine.builder.build("?", [text]).chunk_ids[0] for text in texts]
    res = ensure_chunks(engine, ids, batch_size=batch,  # every canonical prefix (question and chat layouts)
                        on_batch=None if progress is None else (lambda done, total, _tokens: progress(done, total)))
    return {"computed": res.computed, "already_stored": res.already_stored, "seconds": round(res.seconds, 3)}


# ---- asking ----------------------------------------------------------------------------------------
def retrieve(question: str, collection: str | Collection, root: str | os.PathLike | None = None,
             top_k: int = 4) -> list[Hit]:
    col = collection if isinstance(collection, Collection) else load_collection(collection, root)
    return col.search(question, top_k)


def ask_collection(engine, question: str, collection: str | Collection, root: str | os.PathLike | None = None,
                   top_k: int = 4, **generate_kwargs):
    """Retrieve the top-k chunks of `collection` for `question` and answer over them (best first).
    -> (GenerationResult, hits). `generate_kwargs` go to `Engine.generate` (method, recompute_ratio, ...)."""
    hits = retrieve(question, collection, root, top_k)
    if not hits:
        raise InputError(f"collection {getattr(collection, 'name', collection)!r} is empty")
    result = engine.generate(question, [h.text for h in hits], **generate_kwargs)
    result.stats.extra["retrieved"] = [h.as_dict() for h in hits]
    return result, hits
