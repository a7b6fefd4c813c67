"""The server's cache-management API: documents whose chunk caches are precomputed once and reused by id.

    POST   /v1/documents        {"text": "..." | ["...", ...], "pin": false}
                                -> {"object": "list", "data": [{"id": "doc-…", "object": "document", ...}]}
                                   every chunk cache is in the store before this returns
    GET    /v1/documents        the documents this store knows
    GET    /v1/documents/{id}   {"id", "object": "document", "tokens", "chars", "pinned", "cached", "created"}
    DELETE /v1/documents/{id}   {"id", "object": "document.deleted", "deleted": true}; drops its chunk cache
    POST   /v1/chat/completions {"document_ids": ["doc-…", ...], "messages": [...]}   (instead of "documents")

A document is one passage (one chunk of the prompt, as in ``"documents"``). Its id is a content address
(``doc-`` + sha256 of the text), so posting the same text twice gives the same id and several servers on
one store agree on ids. Records live in the store's metadata (`ChunkStore.meta_put`, namespace
``documents``): servers sharing a Redis or a directory share them. ``pin`` pins the document's chunk
cache (`ChunkStore.pin`): `kvstitch store gc` and the memory tier's eviction keep pinned entries;
unpinned ones are evicted least-recently-used under the store budget (``serve --max-bytes``).
With tenants (`kvstitch.serve.tenants`) each request sees its tenant's documents and the shared tenant's:
another tenant's id is a 404, as an id nobody posted (a 403 would say it exists); a shared document is
read-only (403 on DELETE) for the keys of other tenants.
"""


import asyncio
import hashlib
import re
import time

from kvstitch.core.errors import InputError, StoreError
from .jobs import ApiError, Job, QueueFull

_ID_RE = re.compile(r"doc-[0-9a-f]{32}")
MAX_DOCUMENTS_PER_POST = 256


def document_id(text: str) -> str:
    return "doc-" + hashlib.sha256(text.encode("utf-8")).hexdigest()[:32]


def _bad(msg: str, param: str | None = None, code: str = "invalid_request"):
    return ApiError(400, msg, code=code, param=param)


def _not_found(doc_id: str):
    return ApiError(404, f"document {doc_id!r:.80} not found", code="document_not_found", param="document_ids")


def _store_down(e: Exception):
    return ApiError(503, f"the chunk store is unavailable: {e}", "server_error", "store_unavailable")


class DocumentService:
    """Document records in the engine's store; precompute runs on the engine worker's thread."""

    def __init__(self, engine, worker):
        self.engine, self.worker, self.store = engine, worker, engine.store

    def view(self, tenant: "str | None"):
        """The store as ``tenant`` sees it (the store itself without tenants)."""
        return self.store.view(tenant) if hasattr(self.store, "view") else self.store

    # -- records -------------------------------------------------------------------------------
    def get(self, doc_id: str, store=None) -> "dict | None":
        if not isinstance(doc_id, str) or _ID_RE.fullmatch(doc_id) is None:
            return None
        return (store or self.store).meta_get("documents", doc_id)

    def public(self, rec: dict, store=None) -> dict:
        store = store or self.store
        key = rec.get("keys", {}).get(self.engine.fingerprint)
        return {"id": rec["id"], "object": "document", "created": rec["created"], "chars": len(rec["text"]),
                "tokens": rec.get("tokens"), "pinned": bool(key) and store.meta_get("pins", key) is not None,
                "cached": bool(key) and key in store}

    def texts(self, ids, store=None) -> list[str]:
        """The passages of ``document_ids`` (in order); 400/404 as OpenAI-style errors."""
        if not isinstance(ids, list) or not ids or not all(isinstance(i, str) for i in ids):
            raise _bad("'document_ids' must be a non-empty list of document ids (POST /v1/documents)",
                       "document_ids")
        out = []
        for i in ids:
            rec = self.get(i, store)
            if rec is None:
                raise _not_found(i)
            out.append(rec["text"])
        return out

    def delete(self, doc_id: str, store=None) -> bool:
        """Drop a document and its chunk caches -> False when ``store`` has no such document (a 404)."""
        store = store or self.store
        rec = self.get(doc_id, store)
        if rec is None:
            return False
        if hasattr(store, "meta_own") and store.meta_own("documents", doc_id) is None:  # the shared tenant's
            raise ApiError(403, f"document {doc_id!r:.80} belongs to the shared tenant: only its keys delete it",
                           code="document_read_only", param="document_id")
        for key in rec.get("keys", {}).values():
            store.unpin(key)
            store.delete(key)
        store.meta_delete("documents", doc_id)
        return True

    # -- precompute on the engine thread -------------------------------------------------------
    def _create(self, engine, texts: list[str], pin: bool) -> dict:
        from kvstitch.engine.precompute import ensure_chunks

        store = engine.store  # the worker runs this in the tenant's scope
        ids = [engine.builder.encode_chunk(t) for t in texts]
        for t, i in zip(texts, ids):
            if i.numel() == 0:
                raise InputError(f"document {document_id(t)} has no tokens")
        res = ensure_chunks(engine, ids)
        now = int(time.time())
        docs = []
        for text, tok, keys in zip(texts, ids, res.all_keys):
            did = document_id(text)
            rec = store.meta_get("documents", did) or {"id": did, "text": text, "created": now, "keys": {}}
            # one entry per canonical prefix (question and chat layouts); the first under the plain fingerprint
            for n, k in enumerate(keys):
                rec["keys"][engine.fingerprint if n == 0 else f"{engine.fingerprint}:{n}"] = k
            rec["tokens"] = int(tok.numel())
            store.meta_put("documents", did, rec)
            if pin:
                for k in keys:
                    store.pin(k, document=did)
            docs.append(rec)
        return {"docs": docs, "computed": res.computed, "already_stored": res.already_stored}

    async def run_on_engine(self, fn, tenant: "str | None" = None):
        job = Job(None, asyncio.get_running_loop(), tenant=tenant)
        job.fn = fn
        try:
            self.worker.submit(job)
        except QueueFull as e:
            raise ApiError(429, f"the server is busy; retry after {e.retry_after} s", "rate_limit_error",
                           "queue_full", headers={"Retry-After": str(e.retry_after)}) from None
        result = error = None
        while True:
            kind, value = await job.events.get()
            if kind == "result":
                result = value
            elif kind == "error":
                error = value
            elif kind == "done":
                break
        if error is not None:
            raise error
        if result is None:
            raise ApiError(503, "the request was cancelled", "server_error", "cancelled")
        return result


def _create_body(raw: bytes) -> tuple[list[str], bool]:
    """A ``POST /v1/documents`` body -> (its texts, pin), or the 400 that says what is wrong with it."""
    import json

    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise _bad(f"the request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    text = body.get("text", body.get("input"))
    texts = [text] if isinstance(text, str) else text
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
        raise _bad("'text' must be a string or a non-empty list of strings", "text")
    if len(texts) > MAX_DOCUMENTS_PER_POST:
        raise _bad(f"at most {MAX_DOCUMENTS_PER_POST} documents per request", "text")
    for i, t in enumerate(texts):
        if not t.strip():
            raise _bad(f"text[{i}] is empty", "text")
    pin = body.get("pin", False)
    if not isinstance(pin, bool):
        raise _bad("'pin' must be a boolean", "pin")
    return texts, pin


def documents_router(service: DocumentService):
    from fastapi import APIRouter, Request
    from starlette.concurrency import run_in_threadpool

    router = APIRouter()  # errors are ApiError, answered by the app's handler

    def tenant(request: Request):
        return getattr(request.state, "tenant", None)

    @router.post("/v1/documents")
    async def create(request: Request):
        texts, pin = _create_body(await request.body())
        try:
            out = await service.run_on_engine(lambda eng: service._create(eng, texts, pin), tenant(request))
            store = service.view(tenant(request))
            data = [await run_in_threadpool(service.public, r, store) for r in out["docs"]]
        except StoreError as e:
            raise _store_down(e) from None
        return {"object": "list", "data": data,
                "kvstitch": {"computed": out["computed"], "already_stored": out["already_stored"]}}

    @router.get("/v1/documents")
    async def list_docs(request: Request):
        store = service.view(tenant(request))
        try:
            recs = await run_in_threadpool(store.meta_list, "documents")
            return {"object": "list",
                    "data": [await run_in_threadpool(service.public, r, store) for r in recs.values()]}
        except StoreError as e:
            raise _store_down(e) from None

    @router.get("/v1/documents/{doc_id}")
    async def get(doc_id: str, request: Request):
        store = service.view(tenant(request))
        try:
            rec = await run_in_threadpool(service.get, doc_id, store)
            if rec is None:
                raise _not_found(doc_id)
            return await run_in_threadpool(service.public, rec, store)
        except StoreError as e:
            raise _store_down(e) from None

    @router.delete("/v1/documents/{doc_id}")
    async def delete(doc_id: str, request: Request):
        try:
            if not await run_in_threadpool(service.delete, doc_id, service.view(tenant(request))):
                raise _not_found(doc_id)
        except StoreError as e:
            raise _store_down(e) from None
        return {"id": doc_id, "object": "document.deleted", "deleted": True}

    return router


async def resolve_document_ids(service: DocumentService | None, body, tenant: "str | None" = None):
    """A chat body naming ``document_ids`` -> the same body with ``documents`` (the passages)."""
    if not isinstance(body, dict) or "document_ids" not in body:
        return body
    if body.get("documents") is not None or body.get("collection") is not None:
        raise _bad("pass one of 'documents', 'document_ids' or 'collection'", "document_ids")
    from starlette.concurrency import run_in_threadpool

    try:
        texts = await run_in_threadpool(service.texts, body["document_ids"], service.view(tenant))
    except StoreError as e:
        raise _store_down(e) from None
    out = {k: v for k, v in body.items() if k != "document_ids"}
    out["documents"] = texts
    return out
