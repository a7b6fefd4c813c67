"""Tenants in one chunk store: a namespace each, so one tenant's requests never hit, read, list or delete
another's entries. A hit shows in the time to first token, so an entry two tenants share would tell
tenant B that tenant A asked about that passage (and a shared entry is what a cache-poisoning attack writes).

- An entry of tenant T lives under `tenant_key` (chunk key, T): 64 hex digits like any key, so every backend
  stores it unchanged; its last 8 digits are T's tag, by which `kvstitch store stats` groups entries.
- No tenant (None) is the store as it always was: the chunk key itself, bit for bit.
- Document records are named ``<tenant>.<doc id>``; pins are named by the tenant's key.
- The shared tenant (opt-in, for public corpora) is read by every tenant after its own namespace; only
  its own keys write it, so what another tenant reads there never depends on any other tenant's requests.

`TenantView` is the store as one tenant sees it (the documents API takes one per request); `TenantRouter`
is the engine's store, each call going to the view of the tenant whose request runs (`tenant_scope`).
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib

from .base import LookupCounts, check_key

TAG_HEX = 8  # the hex digits of a tenant's key that name its tenant
_CURRENT: contextvars.ContextVar = contextvars.ContextVar("kvstitch_tenant", default=None)


def _sha(*parts: bytes) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))  # length-prefixed: no ambiguity between parts
        h.update(part)
    return h.hexdigest()


def tenant_tag(tenant: str) -> str:
    return _sha(b"kvstitch-tenant-tag", tenant.encode())[:TAG_HEX]


def tenant_key(key: str, tenant: str | None) -> str:
    """The store key of chunk ``key`` in ``tenant``'s namespace (None: ``key`` itself, today's keys)."""
    if tenant is None:
        return check_key(key)
    return _sha(b"kvstitch-tenant", tenant.encode(), check_key(key).encode())[:64 - TAG_HEX] + tenant_tag(tenant)


def tenant_of(key: str, tags: dict[str, str]) -> str:
    """The tenant a stored key belongs to (``tags``: tag -> name), "default" for today's keys."""
    return tags.get(key[-TAG_HEX:], "default")


def entry_sizes(store) -> list[tuple[str, int]]:
    """``[(key, bytes)]`` of every entry of a directory or Redis store (others: bytes unknown, 0)."""
    if hasattr(store, "_scan"):
        return [(k, st.st_size) for k, _, st in store._scan()]
    if hasattr(store, "_sizes_and_idle"):
        return [(k, size) for k, size, _ in store._sizes_and_idle(store.keys())]
    return [(k, 0) for k in store.keys()]


def group_by_tenant(store) -> dict[str, dict]:
    """``{tenant: {entries, bytes, shared}}`` from the tenants the store records (empty: no tenants)."""
    recs = store.meta_list("tenants")
    if not recs:
        return {}
    tags = {r.get("tag", tenant_tag(n)): n for n, r in recs.items()}
    out: dict[str, dict] = {}
    for key, size in entry_sizes(store):
        name = tenant_of(key, tags)
        d = out.setdefault(name, {"entries": 0, "bytes": 0,
                                  "shared": bool((recs.get(name) or {}).get("shared"))})
        d["entries"] += 1
        d["bytes"] += size
    for name in recs:  # a tenant with nothing stored yet is listed too
        out.setdefault(name, {"entries": 0, "bytes": 0, "shared": bool(recs[name].get("shared"))})
    return out


def current_tenant() -> str | None:
    """The tenant whose request the engine's store serves now (None: none, today's keys)."""
    return _CURRENT.get()


@contextlib.contextmanager
def tenant_scope(tenant: str | None):
    """The engine's store (`TenantRouter`) serves ``tenant`` in this block (this thread only)."""
    token = _CURRENT.set(tenant)
    try:
        yield
    finally:
        _CURRENT.reset(token)


class TenantView(LookupCounts):
    """The store as one tenant sees it: its namespace read and written, the shared tenant's read only."""

    def __init__(self, inner, tenant: str, shared: str | None = None):
        self.inner, self.tenant = inner, tenant
        self.shared = shared if shared != tenant else None
        self.hits = self.misses = self.bytes_loaded = 0

    def _own(self, key: str) -> str:
        return tenant_key(key, self.tenant)

    def _reads(self, key: str) -> list[str]:
        return [self._own(key)] + ([tenant_key(key, self.shared)] if self.shared else [])

    def get(self, key: str):
        for k in self._reads(key):
            kv = self.inner.get(k)
            if kv is not None:
                return kv
        return None

    def __contains__(self, key: str) -> bool:
        return any(k in self.inner for k in self._reads(key))

    def put(self, key: str, kv) -> None:
        self.inner.put(self._own(key), kv)

    def add_anchors(self, key: str, scores, tag: str) -> bool:
        own = self._own(key)  # never into the shared namespace: the caller keeps them for its request
        return own in self.inner and self.inner.add_anchors(own, scores, tag)

    def delete(self, key: str) -> bool:
        return self.inner.delete(self._own(key))

    def pin(self, key: str, **info) -> None:
        self.inner.pin(self._own(key), **info)

    def unpin(self, key: str) -> bool:
        return self.inner.unpin(self._own(key))

    # -- metadata: documents and pins are the tenant's, other records are the store's ---------------
    def _names(self, ns: str, name: str) -> list[str]:
        if ns == "documents":
            return [f"{t}.{name}" for t in (self.tenant, self.shared) if t]
        if ns == "pins":
            return self._reads(name)
        return [name]

    def meta_get(self, ns: str, name: str) -> dict | None:
        for n in self._names(ns, name):
            rec = self.inner.meta_get(ns, n)
            if rec is not None:
                return rec
        return None

    def meta_own(self, ns: str, name: str) -> dict | None:
        """The record in this tenant's own namespace (not the shared tenant's)."""
        return self.inner.meta_get(ns, self._names(ns, name)[0])

    def meta_put(self, ns: str, name: str, value: dict) -> None:
        self.inner.meta_put(ns, self._names(ns, name)[0], value)

    def meta_delete(self, ns: str, name: str) -> bool:
        return self.inner.meta_delete(ns, self._names(ns, name)[0])

    def meta_list(self, ns: str) -> dict[str, dict]:
        if ns != "documents":
            return self.inner.meta_list(ns)
        recs = self.inner.meta_list(ns)
        out: dict[str, dict] = {}
        for t in (self.shared, self.tenant):  # its own records over the shared ones of the same id
            if t:
                out.update({n[len(t) + 1:]: r for n, r in recs.items() if n.startswith(t + ".")})
        return out

    def stats(self) -> dict:
        """Its own lookups only: another tenant's hits are nobody else's business."""
        return {"backend": f"tenant:{self.tenant}", "storage_dtype": self.inner.storage_dtype, "hits": self.hits,
                "misses": self.misses, "bytes_loaded": self.bytes_loaded, "problems": 0}

    def __getattr__(self, name: str):  # storage_dtype, fingerprint, compute_dtype, health ...
        return getattr(self.inner, name)


class TenantRouter:
    """The engine's store when tenants are configured: each call goes to the view of the tenant whose request
    runs (`tenant_scope`, set by the engine worker); outside any scope, the store as it always was."""

    _OWN = ("inner", "shared", "_views")

    def __init__(self, inner, shared: str | None = None):
        self.inner, self.shared, self._views = inner, shared, {}

    def view(self, tenant: str | None):
        if tenant is None:
            return self.inner
        v = self._views.get(tenant)
        if v is None:
            v = self._views[tenant] = TenantView(self.inner, tenant, self.shared)
        return v

    def _cur(self):
        return self.view(current_tenant())

    def get(self, key):
        return self._cur().get(key)

    def lookup(self, key):
        return self._cur().lookup(key)

    def __contains__(self, key) -> bool:
        return key in self._cur()

    def put(self, key, kv) -> None:
        self._cur().put(key, kv)

    def add_anchors(self, key, scores, tag) -> bool:
        return self._cur().add_anchors(key, scores, tag)

    def delete(self, key) -> bool:
        return self._cur().delete(key)

    def pin(self, key, **info) -> None:
        self._cur().pin(key, **info)

    def unpin(self, key) -> bool:
        return self._cur().unpin(key)

    def meta_get(self, ns, name):
        return self._cur().meta_get(ns, name)

    def meta_put(self, ns, name, value) -> None:
        self._cur().meta_put(ns, name, value)

    def meta_delete(self, ns, name) -> bool:
        return self._cur().meta_delete(ns, name)

    def meta_list(self, ns):
        return self._cur().meta_list(ns)

    def __len__(self) -> int:
        return len(self.inner)

    def __repr__(self) -> str:
        return f"{self.inner!r} (per tenant)"

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def __setattr__(self, name: str, value) -> None:
        if name in self._OWN:
            object.__setattr__(self, name, value)
        else:  # compute_dtype, fingerprint ...: the store's
            setattr(self.inner, name, value)
