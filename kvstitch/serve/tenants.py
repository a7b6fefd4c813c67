"""Tenants: API keys (or groups of them) whose chunk caches and documents are kept apart in the store.

    [tenants.acme]                       # in the serve config file (or --tenants FILE.toml, or JSON)
    keys = ["sk-acme-1", "sk-acme-2"]    # a group of keys is one tenant
    [tenants.public]
    keys = ["sk-ingest"]
    shared = true                        # every tenant reads its chunks and documents; only its keys write

``--tenants per-key`` (or ``tenants = "per-key"``) makes every API key a tenant of its own; so is any
``--api-key`` key that no tenant table names (as ``key-<sha256(key)[:12]>``). The tenant's keys are API
keys (no need to repeat them in ``--api-key``). Without tenants every key shares one namespace, the store's
keys as they always were. A tenant's documents, chunk hits and /metrics series are its own: another
tenant's document id is a 404, and /metrics shows the request series (TTFT, store hits ...) of the
calling tenant only (`kvstitch.store.tenants` has the store side).
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path

from kvstitch.core.errors import InputError
from kvstitch.engine.cold import DeferredPrecompute
from kvstitch.store.tenants import current_tenant, tenant_tag

PER_KEY = "per-key"
_NAME_RE = re.compile(r"[a-z0-9][a-z0-9_-]{0,31}")
_FIELDS = {"keys", "shared"}


@dataclass
class Tenants:
    """API key -> tenant name, and the shared tenant (None: none)."""

    by_key: dict[str, str] = field(repr=False)
    shared: str | None = None

    def of(self, key: str | None) -> str | None:
        return self.by_key.get(key) if key is not None else None

    @property
    def names(self) -> list[str]:
        return sorted(set(self.by_key.values()))

    def records(self) -> dict[str, dict]:
        """What the store keeps about each tenant (``kvstitch store stats`` names tags with it)."""
        return {n: {"name": n, "tag": tenant_tag(n), "shared": n == self.shared} for n in self.names}


def _bad(msg: str):
    return InputError(f"tenants: {msg}", param="tenants")


def _spec(spec):
    """The tenants setting as a table: a dict, JSON text, ``per-key`` or a TOML file's ``[tenants]``."""
    if isinstance(spec, str):
        text = spec.strip()
        if text == PER_KEY:
            return {}
        if text.startswith("{"):
            try:
                return json.loads(text)
            except ValueError as e:
                raise _bad(f"not valid JSON: {e}") from None
        from .config import load_toml

        try:
            data = load_toml(Path(text))
        except InputError as e:
            raise _bad(f"{e} (expected '{PER_KEY}', JSON or a TOML file of [tenants.NAME] tables)") from None
        return data.get("tenants", data)
    return spec


def _keys_of(name, table) -> list[str]:
    if not isinstance(table, dict):
        raise _bad(f"[tenants.{name}] must be a table with 'keys' (and optionally 'shared = true')")
    unknown = sorted(set(table) - _FIELDS)
    if unknown:
        raise _bad(f"[tenants.{name}]: unknown field {unknown[0]!r}; known: keys, shared")
    keys = table.get("keys")
    keys = [keys] if isinstance(keys, str) else keys
    if not isinstance(keys, list) or not keys or not all(isinstance(k, str) and k.strip() for k in keys):
        raise _bad(f"[tenants.{name}]: 'keys' must be an API key or a non-empty list of them")
    if not isinstance(table.get("shared", False), bool):
        raise _bad(f"[tenants.{name}]: 'shared' must be true or false")
    return [k.strip() for k in keys]


def parse_tenants(spec, api_keys: tuple[str, ...] = ()) -> Tenants | None:
    """The tenants setting (None: no tenants) over the server's API keys; a malformed one is one `InputError`."""
    if spec is None or spec == "" or spec is False:
        return None
    spec = _spec(spec)
    if not isinstance(spec, dict):
        raise _bad(f"expected a table of tenants, '{PER_KEY}', JSON or a TOML file, got {type(spec).__name__}")
    by_key: dict[str, str] = {}
    shared = None
    for name, table in spec.items():
        if not isinstance(name, str) or _NAME_RE.fullmatch(name) is None:
            raise _bad(f"tenant name {name!r:.40} must be 1-32 of a-z, 0-9, '_', '-' (starting with a letter or "
                       "digit)")
        for k in _keys_of(name, table):
            if by_key.get(k, name) != name:
                raise _bad(f"an API key is listed by two tenants ({by_key[k]!r} and {name!r})")
            by_key[k] = name
        if table.get("shared", False):
            if shared is not None:
                raise _bad(f"two shared tenants ({shared!r} and {name!r}); at most one")
            shared = name
    for k in api_keys:  # a key no table names is a tenant of its own
        by_key.setdefault(k, "key-" + hashlib.sha256(k.encode()).hexdigest()[:12])
    if not by_key:
        raise _bad("tenants are told apart by API key: pass --api-key (or KVSTITCH_API_KEY) or list 'keys'")
    return Tenants(by_key, shared)


class TenantDeferred(DeferredPrecompute):
    """Chunks cold requests left to compute later, per tenant: computed while idle in their tenant's scope
    (`next_tenant`, then `take` in its scope), they are stored in its namespace."""

    def __init__(self):
        super().__init__()
        self._queues: dict[str | None, DeferredPrecompute] = {}
        self._qlock = threading.Lock()

    def _queue(self, tenant) -> DeferredPrecompute:
        with self._qlock:
            return self._queues.setdefault(tenant, DeferredPrecompute())

    def add(self, key, prefix_ids, chunk_ids) -> None:
        self._queue(current_tenant()).add(key, prefix_ids, chunk_ids)

    def __len__(self) -> int:
        with self._qlock:
            queues = list(self._queues.values())
        return sum(len(q) for q in queues)

    def take(self, max_chunks=None):
        return self._queue(current_tenant()).take(max_chunks)

    def next_tenant(self):
        """A tenant with chunks waiting (None also when none waits)."""
        with self._qlock:
            return next((t for t, q in self._queues.items() if len(q)), None)


# /metrics series of a request's own outcome: kept per tenant, shown to that tenant only (with the
# whole server's request durations and loaded bytes, which would carry the same signal, left out)
TENANT_SERIES = ("kvstitch_ttft_seconds", "kvstitch_store_hits_total", "kvstitch_store_misses_total",
                 "kvstitch_recomputed_tokens_total", "kvstitch_context_tokens_total", "kvstitch_recompute_ratio",
                 "kvstitch_prompt_tokens_total", "kvstitch_completion_tokens_total", "kvstitch_chat_method_total",
                 "kvstitch_auto_requests_total", "kvstitch_guard_checks_total",
                 "kvstitch_guard_disagreements_total")
HIDDEN_SERIES = ("kvstitch_request_duration_seconds", "kvstitch_store_entries_loaded_bytes_total")
_SUFFIXES = ("", "_total", "_bucket", "_sum", "_count", "_created")


def _family(line: str) -> str:
    if line.startswith("#"):
        parts = line.split()
        return parts[2] if len(parts) > 2 else ""
    return re.split(r"[{\s]", line, maxsplit=1)[0]


def _in(name: str, families) -> bool:
    return any(name == f.removesuffix("_total") + s for f in families for s in _SUFFIXES)


def filter_series(text: str, families, keep: bool) -> str:
    """The Prometheus text with only (``keep``) or without the series of ``families``."""
    lines = [ln for ln in text.splitlines() if ln and _in(_family(ln), families) == keep]
    return "\n".join(lines) + ("\n" if lines else "")
