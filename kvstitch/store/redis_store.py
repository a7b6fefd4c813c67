"""Redis backend: one chunk store shared by many workers / machines.

Values are the same safetensors blobs as on disk (``<prefix><key>`` -> bytes), so an entry checks itself
wherever it travelled. Every socket operation has a timeout and no retries: an unreachable server is a
`StoreError` within ~`connect_timeout` seconds, never a hang (a tiered store then serves a miss).
Eviction: ``max_bytes`` (``serve --max-bytes``) trims least-recently-used unpinned entries after a put that
crosses it (an estimate per put, a scan per trim); Redis ``maxmemory`` + ``allkeys-lru`` is a hard budget
but does not know pins (use ``noeviction``/``volatile-lru`` with pins); `gc(max_bytes)` evicts by
``OBJECT IDLETIME`` for a one-off trim.
"""

from __future__ import annotations

import json
import re

import torch

from kvstitch.core.chunk import ChunkKV
from kvstitch.core.errors import CorruptEntryError, StoreError
from kvstitch.core.extras import require
from .base import ChunkStore, check_key, check_meta, group_by_model
from .codec import DEFAULT_CHECKSUM, check_storage_dtype, decode, encode, entry_info, splice_anchors


def _redis():
    """redis-py, imported on first use: it is the optional `redis` extra."""
    return require("redis", "redis", "a redis:// store")


_HEADER_PEEK = 64 * 1024


class RedisStore(ChunkStore):
    def __init__(self, url: str = "redis://127.0.0.1:6379/0", storage_dtype: str = "float16",
                 compute_dtype: torch.dtype | None = None, fingerprint: str | None = None,
                 prefix: str = "kvstitch:chunk:", ttl_s: int | None = None, connect_timeout: float = 1.0,
                 timeout: float = 5.0, check: bool = False, checksum_alg: str = DEFAULT_CHECKSUM,
                 max_bytes: int | None = None) -> None:
        super().__init__()
        redis = _redis()
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self.url = url
        self.storage_dtype = check_storage_dtype(storage_dtype)
        self.compute_dtype = compute_dtype
        self.fingerprint = fingerprint
        self.prefix = prefix
        self.meta_prefix = (prefix[:-len("chunk:")] + "meta:") if prefix.endswith("chunk:") else prefix + "~meta:"
        self.ttl_s = ttl_s
        self.checksum_alg = checksum_alg
        self.max_bytes = max_bytes  # budget: unpinned entries evicted by idle time above it (see put)
        self._approx_bytes: int | None = None
        try:
            self._r = redis.Redis.from_url(url, socket_connect_timeout=connect_timeout, socket_timeout=timeout,
                                           retry_on_timeout=False, retry=Retry(NoBackoff(), 0),
                                           health_check_interval=0)
        except (ValueError, redis.RedisError) as e:
            raise StoreError(f"bad Redis URL {url!r}: {e}") from None
        if check:
            self.ping()

    def __repr__(self) -> str:
        return f"RedisStore({self.url!r}, storage_dtype={self.storage_dtype!r})"

    def _call(self, fn, *args):
        try:
            return fn(*args)
        except (_redis().RedisError, OSError) as e:
            raise StoreError(f"Redis at {self.url} unavailable: {e}") from None

    def ping(self) -> None:
        """Raise `StoreError` unless the server answers (within the socket timeouts)."""
        self._call(self._r.ping)

    def _k(self, key: str) -> str:
        return self.prefix + check_key(key)

    def get(self, key: str) -> ChunkKV | None:
        data = self._call(self._r.get, self._k(key))
        if data is None:
            return None
        try:
            return decode(bytearray(data), key, self.fingerprint, self.compute_dtype)  # writable tensors
        except CorruptEntryError as e:
            self._report(key, str(e))
            return None

    def put(self, key: str, kv: ChunkKV) -> None:
        blob = b"".join(encode(key, kv, self.storage_dtype, self.checksum_alg))
        self._call(self._r.set, self._k(key), blob, self.ttl_s)
        self._reported = {kp for kp in self._reported if kp[0] != key}
        if self.max_bytes is not None:  # as DiskStore: an estimate per put, the truth (a scan) per gc
            if self._approx_bytes is None:
                self._approx_bytes = sum(r[1] for r in self._sizes_and_idle(self.keys()))
            else:
                self._approx_bytes += len(blob)
            if self._approx_bytes > self.max_bytes:
                self._approx_bytes = self.gc(int(self.max_bytes * 0.9))["bytes"]

    def add_anchors(self, key: str, scores: torch.Tensor, tag: str) -> bool:
        data = self._call(self._r.get, self._k(key))
        if data is None:
            return False
        try:
            blob = b"".join(splice_anchors(bytearray(data), key, scores, tag))
        except CorruptEntryError as e:
            self._report(key, str(e))
            return False
        self._call(self._r.set, self._k(key), blob, self.ttl_s)
        return True

    def put_raw(self, key: str, blob: bytes) -> None:
        """Store bytes as-is (tests and tools: simulate damage)."""
        self._call(self._r.set, self._k(key), blob)

    def __contains__(self, key: str) -> bool:
        return bool(self._call(self._r.exists, self._k(key)))

    def delete(self, key: str) -> bool:
        return bool(self._call(self._r.delete, self._k(key)))

    def keys(self) -> list[str]:
        n = len(self.prefix)
        pattern = re.sub(r"([*?\[\]\\])", r"\\\1", self.prefix) + "*"  # the prefix is literal, not a glob
        found = self._call(lambda: list(self._r.scan_iter(match=pattern, count=1000)))
        return sorted(k.decode()[n:] for k in found)

    def __len__(self) -> int:
        return len(self.keys())

    def verify(self) -> list[tuple[str, str]]:
        out = []
        for key in self.keys():
            try:
                check_key(key)
            except StoreError:
                out.append((key, "not a valid chunk key"))
                continue
            data = self._call(self._r.get, self._k(key))
            if data is None:
                continue
            try:
                decode(bytearray(data), key, self.fingerprint, None)
            except CorruptEntryError as e:
                out.append((key, str(e)))
        return out

    def _sizes_and_idle(self, keys: list[str]):
        def run():
            # idle times first, for every key: OBJECT does not touch the LRU clock, STRLEN does
            p = self._r.pipeline(transaction=False)
            for k in keys:
                p.object("idletime", self.prefix + k)
            for k in keys:
                p.strlen(self.prefix + k)
            return p.execute(raise_on_error=False)
        res = self._call(run)
        n = len(keys)
        return [(k, res[n + i] if isinstance(res[n + i], int) else 0,
                 res[i] if isinstance(res[i], int) else 0) for i, k in enumerate(keys)]

    def gc(self, max_bytes: int) -> dict:
        rows = self._sizes_and_idle(self.keys())
        total = sum(r[1] for r in rows)
        removed = freed = 0
        pins = self.pinned()
        for key, size, _ in sorted(rows, key=lambda r: -r[2]):  # longest idle first
            if total <= max_bytes:
                break
            if key in pins:
                continue  # pinned (`pin`): kept whatever the budget
            if self._call(self._r.delete, self.prefix + key):
                removed, freed = removed + 1, freed + size
            total -= size
        return {"removed": removed, "freed_bytes": freed, "bytes": total, "entries": len(rows) - removed}

    def stats(self) -> dict:
        keys = self.keys()
        rows = self._sizes_and_idle(keys)

        def heads():
            p = self._r.pipeline(transaction=False)
            for k in keys:
                p.getrange(self.prefix + k, 0, _HEADER_PEEK - 1)
            return p.execute(raise_on_error=False)
        by: dict[str, dict] = {}
        per_model = []
        for (_, size, _), head in zip(rows, self._call(heads) if keys else []):
            try:
                info = entry_info(head)
            except (CorruptEntryError, TypeError):
                info = {"storage_dtype": "unreadable", "n_tokens": 0}
            per_model.append((info.get("fingerprint"), size, info["n_tokens"]))
            d = by.setdefault(info["storage_dtype"], {"entries": 0, "bytes": 0, "tokens": 0})
            d["entries"] += 1
            d["bytes"] += size
            d["tokens"] += info["n_tokens"]
        for d in by.values():
            d["bytes_per_token"] = d["bytes"] / d["tokens"] if d["tokens"] else 0.0
        return {**super().stats(), "url": self.url, "entries": len(rows), "bytes": sum(r[1] for r in rows),
                "by_dtype": by, "by_model": group_by_model(per_model, self.models()), "pinned": len(self.pinned())}

    # -- metadata: <meta_prefix><namespace>:<name> -> JSON ---------------------------------------
    def meta_put(self, ns: str, name: str, value: dict) -> None:
        check_meta(ns, name)
        self._call(self._r.set, f"{self.meta_prefix}{ns}:{name}", json.dumps(value, sort_keys=True))

    def meta_get(self, ns: str, name: str) -> dict | None:
        check_meta(ns, name)
        data = self._call(self._r.get, f"{self.meta_prefix}{ns}:{name}")
        try:
            return json.loads(data) if data is not None else None
        except ValueError:
            return None

    def meta_delete(self, ns: str, name: str) -> bool:
        check_meta(ns, name)
        return bool(self._call(self._r.delete, f"{self.meta_prefix}{ns}:{name}"))

    def meta_list(self, ns: str) -> dict[str, dict]:
        check_meta(ns)
        head = f"{self.meta_prefix}{ns}:"
        pattern = re.sub(r"([*?\[\]\\])", r"\\\1", head) + "*"

        def run():
            names = [k.decode() for k in self._r.scan_iter(match=pattern, count=1000)]
            return names, (self._r.mget(names) if names else [])
        names, values = self._call(run)
        out = {}
        for k, v in zip(names, values):
            try:
                if v is not None:
                    out[k[len(head):]] = json.loads(v)
            except ValueError:
                continue
        return dict(sorted(out.items()))

    def close(self) -> None:
        try:
            self._r.close()
        except Exception:  # noqa: BLE001 - closing a dead connection is not an error
            pass
