"""The chunk-store interface and its content-addressed key.

A key is the sha256 of everything that determines a chunk's K/V: the model fingerprint (weights hash,
RoPE config, compute dtype), the shared-prefix ids, the chunk ids, the storage dtype, the precompute mode
(``shared_prefix``: the chunk computed after the shared prefix; ``isolated``: from position 0 on its own,
no prefix, so the prefix ids do not enter the key) and the layout version. Never Python's `hash()`
(salted per process).

Every backend keeps the same contract (LMCache's lesson: silent misses and silently wrong hits are the
bugs that cost most): a corrupt, truncated or foreign entry is never returned. It is a miss, it is
reported once (``store.problems`` + ``logging.warning``), and the next ``put`` overwrites it.
"""

from __future__ import annotations

import hashlib
import logging
import re
import time
from abc import ABC, abstractmethod

import torch

from kvstitch.core.chunk import ChunkKV
from kvstitch.core.errors import InputError, StoreError

LAYOUT_VERSION = 1

log = logging.getLogger("kvstitch.store")

_KEY_RE = re.compile(r"[0-9a-f]{64}")


class InvalidKeyError(StoreError, ValueError):
    """A key that is not 64 lowercase hex digits: refused, so no key can name a path outside the store."""


def check_key(key) -> str:
    """Return `key` if it is a valid chunk key (``^[0-9a-f]{64}$``), else raise `InvalidKeyError`."""
    if not isinstance(key, str) or _KEY_RE.fullmatch(key) is None:
        raise InvalidKeyError(f"invalid chunk key {key!r:.80}: expected 64 lowercase hex digits (see chunk_key)")
    return key


def _ids_bytes(ids) -> bytes:
    t = torch.as_tensor(ids, dtype=torch.int64).flatten().cpu()
    return t.numpy().tobytes()


PRECOMPUTE_MODES = ("shared_prefix", "isolated")


def check_precompute(mode) -> str:
    if mode not in PRECOMPUTE_MODES:
        raise InputError(f"unknown precompute mode {mode!r}; known: {', '.join(PRECOMPUTE_MODES)}")
    return mode


def chunk_key(fingerprint: str, prefix_ids, chunk_ids, storage_dtype: str = "float16", *,
              precompute: str = "shared_prefix", tokenizer: str = "", writer: str = "") -> str:
    """`fingerprint` names the weights (+ RoPE, shapes, compute dtype); `tokenizer` the tokenizer
    (`kvstitch.core.identity.tokenizer_fingerprint`: vocabulary, merges, configuration; "" = not named, the
    key of older stores); the ids are the chunk's text under that tokenizer; `precompute` how it was
    computed (after the shared prefix, or isolated from position 0); `writer` the stitch adapter's writer that
    changed what precompute wrote (`StitchAdapter.precompute_tag`; "" = none, the plain caches' key)."""
    parts = [f"kvstitch-layout-{LAYOUT_VERSION}".encode(), fingerprint.encode(), _ids_bytes(prefix_ids),
             _ids_bytes(chunk_ids), storage_dtype.encode()]
    if check_precompute(precompute) != "shared_prefix":  # (shared_prefix keys are those of earlier versions)
        parts[2] = b""  # an isolated chunk's K/V do not depend on the prefix
        parts.append(f"precompute={precompute}".encode())
    if tokenizer:
        parts.append(b"tokenizer:" + tokenizer.encode())
    if writer:
        parts.append(b"writer:" + writer.encode())
    h = hashlib.sha256()
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))  # length-prefix: no ambiguity between parts
        h.update(part)
    return h.hexdigest()


_META_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
META_NAMESPACES = ("models", "pins", "documents", "tenants")


def check_meta(ns: str, name: str | None = None) -> None:
    """Metadata records live in a few fixed namespaces under names that cannot form a path."""
    if ns not in META_NAMESPACES:
        raise StoreError(f"unknown store metadata namespace {ns!r}")
    if name is not None and (not isinstance(name, str) or _META_NAME_RE.fullmatch(name) is None):
        raise InvalidKeyError(f"invalid store metadata name {name!r:.80}")


def group_by_model(rows, models: dict) -> dict:
    """``[(fingerprint, bytes, tokens)]`` -> ``{fingerprint: {name, entries, bytes, tokens}}``."""
    out: dict[str, dict] = {}
    for fp, size, tokens in rows:
        fp = fp or "unreadable"
        d = out.setdefault(fp, {"name": (models.get(fp) or {}).get("name", "?"), "entries": 0, "bytes": 0,
                                "tokens": 0})
        d["entries"] += 1
        d["bytes"] += size
        d["tokens"] += tokens
    return out


class LookupCounts:
    """`lookup`: `get` plus hit/miss accounting (what the engine calls), for a store or a view of one. The
    instance keeps ``hits``, ``misses`` and ``bytes_loaded``."""

    hits = misses = bytes_loaded = 0

    def lookup(self, key: str) -> ChunkKV | None:
        kv = self.get(key)
        if kv is None:
            self.misses += 1
        else:
            self.hits += 1
            self.bytes_loaded += kv.nbytes
        return kv


class ChunkStore(LookupCounts, ABC):
    """A key -> ChunkKV map. Implementations never return a corrupt or foreign entry: they return None
    (a miss) and record the problem in `self.problems`.

    `storage_dtype` is how entries are kept ("float16", "bfloat16", "float32" or "int8");
    `compute_dtype` is the dtype `get` returns (None: the storage dtype, float32 for int8);
    `fingerprint`, when set, is the model fingerprint every entry must carry (else: foreign, a miss).
    """

    storage_dtype: str = "float16"
    compute_dtype: torch.dtype | None = None
    fingerprint: str | None = None

    def __init__(self) -> None:
        self.hits = 0
        self.misses = 0
        self.bytes_loaded = 0
        self._problems: list[str] = []
        self._reported: set[tuple[str, str]] = set()

    # -- the interface -------------------------------------------------------------------------
    @abstractmethod
    def get(self, key: str) -> ChunkKV | None: ...

    @abstractmethod
    def put(self, key: str, kv: ChunkKV) -> None: ...

    @abstractmethod
    def __contains__(self, key: str) -> bool: ...

    def add_anchors(self, key: str, scores: torch.Tensor, tag: str) -> bool:
        """Add QCFuse anchor scores (`ChunkKV.anchor_scores`) to the stored entry ``key``, leaving its K/V bytes
        as they are -> True if stored; False when the entry is gone or this backend cannot add them (the
        caller keeps them for its own request)."""
        return False

    def delete(self, key: str) -> bool:
        """Remove one entry; True if it existed."""
        raise NotImplementedError(f"{type(self).__name__} does not support delete")

    def keys(self) -> list[str]:
        """All stored keys (maintenance only: may scan)."""
        raise NotImplementedError(f"{type(self).__name__} does not list keys")

    def verify(self) -> list[tuple[str, str]]:
        """Check every entry; return ``(key, problem)`` for each one that would not be served."""
        return []

    def gc(self, max_bytes: int) -> dict:
        """Evict least-recently-used entries until at most `max_bytes` remain."""
        raise NotImplementedError(f"{type(self).__name__} does not support gc")

    def close(self) -> None:
        """Release connections / handles (idempotent)."""

    # -- metadata records: model descriptors, pins, documents (small JSON objects) ---------------
    def meta_put(self, ns: str, name: str, value: dict) -> None:
        raise NotImplementedError(f"{type(self).__name__} keeps no metadata")

    def meta_get(self, ns: str, name: str) -> dict | None:
        return None

    def meta_delete(self, ns: str, name: str) -> bool:
        return False

    def meta_list(self, ns: str) -> dict[str, dict]:
        return {}

    def register_model(self, record: dict) -> None:
        """Name a model fingerprint (what `stats()["by_model"]` shows); best effort."""
        if self.meta_get("models", record["fingerprint"]) != record:
            self.meta_put("models", record["fingerprint"], record)

    def models(self) -> dict[str, dict]:
        return self.meta_list("models")

    def pin(self, key: str, **info) -> None:
        """Keep `key` through `gc` and eviction until `unpin`."""
        self.meta_put("pins", check_key(key), {"pinned_at": time.time(), **info})

    def unpin(self, key: str) -> bool:
        return self.meta_delete("pins", check_key(key))

    def pinned(self) -> set[str]:
        return set(self.meta_list("pins"))

    # -- shared behaviour ----------------------------------------------------------------------
    @property
    def problems(self) -> list[str]:
        """One line per entry that was refused (``"<key>: <problem>"``), in the order met."""
        return self._problems

    @problems.setter
    def problems(self, value: list[str]) -> None:
        self._problems = list(value)
        self._reported = set()

    def _report(self, key: str, problem: str) -> None:
        """Record + log a refused entry once per (key, problem), however often it is looked up."""
        if (key, problem) in self._reported:
            return
        self._reported.add((key, problem))
        self._problems.append(f"{key}: {problem}")
        log.warning("kvstitch store %s: entry %s not used (%s); it will be recomputed and overwritten",
                    type(self).__name__, key, problem)

    def stats(self) -> dict:
        return {"backend": type(self).__name__, "storage_dtype": self.storage_dtype, "hits": self.hits,
                "misses": self.misses, "bytes_loaded": self.bytes_loaded, "problems": len(self.problems)}

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
