"""The server's front door: API keys, request limits, CORS, and the refusal to expose an open server.

    kvstitch serve --host 0.0.0.0 --api-key "$KEY"            # or KVSTITCH_API_KEY=k1,k2 (several keys)
    curl -H "Authorization: Bearer $KEY" http://host:8000/v1/chat/completions -d '...'

- Every path but ``/health`` needs ``Authorization: Bearer <key>`` when keys are configured; a missing or
  wrong key is a 401 (OpenAI's error shape, ``WWW-Authenticate: Bearer``). Keys are compared with
  `hmac.compare_digest` against every configured key (no early exit), so timing says nothing about them.
- Binding a non-loopback address without a key refuses to start, unless ``--insecure`` is given.
- A request body over ``max_body_bytes`` is a 413 (the declared length is checked before reading; a
  chunked body is counted while it is read). JSON bodies naming more than ``max_documents`` passages, or
  passages of more than ``max_request_tokens`` tokens in total, are a 413 as well.
- CORS is off unless origins are given (``--cors-origin https://app.example``, repeatable, ``*`` for any).
- With ``tenants`` (`kvstitch.serve.tenants`) the key names the request's tenant (``request.state.tenant``);
  the tenants' keys are API keys too.

The checks are one pure ASGI middleware (no `BaseHTTPMiddleware`: it would break streaming disconnects). Every
server has it (`create_app` installs the body limit alone when nothing else is configured), so a body is
limited here only, and a JSON body is parsed here only: the routes read it from ``request.state.json_body``.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import os
from dataclasses import dataclass, field

from kvstitch.core.errors import InputError

ENV_API_KEY = "KVSTITCH_API_KEY"
_DOC_FIELDS = ("documents", "document_ids", "text")  # chat passages, chat ids, POST /v1/documents


@dataclass
class SecurityConfig:
    api_keys: tuple[str, ...] = ()
    insecure: bool = False
    max_body_bytes: int = 32 << 20
    max_documents: int | None = 256  # None: no limit
    max_request_tokens: int | None = None
    cors_origins: tuple[str, ...] = ()
    open_paths: tuple[str, ...] = ("/health",)
    tenants: object = field(default=None, repr=False)  # the setting (`parse_tenants`); `tenancy` once parsed
    _keys: tuple[bytes, ...] = field(default=(), repr=False)

    def __post_init__(self) -> None:
        from .tenants import parse_tenants

        keys = tuple(k.strip() for k in self.api_keys if k and k.strip())
        self.tenancy = parse_tenants(self.tenants, keys)
        if self.tenancy is not None:
            keys += tuple(k for k in self.tenancy.by_key if k not in keys)
        for k in keys:
            if len(k) < 8 or any(c.isspace() for c in k):
                raise InputError("an API key must be at least 8 characters without whitespace")
        self.api_keys = keys
        self._keys = tuple(k.encode() for k in keys)
        if self.max_body_bytes < 1:
            raise InputError(f"the body limit must be >= 1 byte, got {self.max_body_bytes}")
        if self.max_documents is not None and self.max_documents < 1:
            raise InputError(f"the documents limit must be >= 1, got {self.max_documents}")
        if self.max_request_tokens is not None and self.max_request_tokens < 1:
            raise InputError(f"the token limit must be >= 1, got {self.max_request_tokens}")

    def authorized(self, header: str | None) -> bool:
        return not self._keys or self.match(header) is not None

    def match(self, header: str | None) -> str | None:
        """The configured key the header carries (None: none)."""
        scheme, _, token = (header or "").partition(" ")
        given = token.strip().encode() if scheme.lower() == "bearer" else b""
        found = None
        for k in self._keys:  # every key, no early exit
            if hmac.compare_digest(given, k) and given:
                found = k
        return found.decode() if found is not None else None


def api_keys_from(flags: list[str] | None, env: dict | None = None) -> tuple[str, ...]:
    """``--api-key`` flags, else ``KVSTITCH_API_KEY`` (comma-separated)."""
    if flags:  # a flag value (or KVSTITCH_API_KEY read by the CLI) may hold several comma-separated keys
        return tuple(k.strip() for f in flags for k in str(f).split(",") if k.strip())
    raw = (os.environ if env is None else env).get(ENV_API_KEY, "")
    return tuple(k.strip() for k in raw.split(",") if k.strip())


def is_loopback(host: str) -> bool:
    h = host.strip().strip("[]").lower()
    if h == "localhost":
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False  # a host name other than localhost may resolve to anything


def check_bind(host: str, cfg: SecurityConfig) -> None:
    """Refuse to expose a server nobody has to authenticate to (unless explicitly `insecure`)."""
    if is_loopback(host) or cfg.api_keys or cfg.insecure:
        return
    raise InputError(f"refusing to bind {host} (reachable from other machines) without an API key: pass "
                     f"--api-key KEY (or set {ENV_API_KEY}), bind 127.0.0.1, or pass --insecure to serve "
                     "without authentication")


def _error(status: int, message: str, code: str, type_: str = "invalid_request_error",
           headers: dict | None = None):
    body = json.dumps({"error": {"message": message, "type": type_, "param": None, "code": code}}).encode()
    hdrs = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    hdrs += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    return {"type": "http.response.start", "status": status, "headers": hdrs}, \
        {"type": "http.response.body", "body": body}


class SecurityMiddleware:
    """Authentication, body limit and per-request passage limits, before any route runs."""

    def __init__(self, app, config: SecurityConfig, tokenizer=None):
        self.app, self.cfg, self.tokenizer = app, config, tokenizer

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def reply(status, message, code, **kw):
            start, body = _error(status, message, code, **kw)
            await send(start)
            await send(body)

        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        path = scope.get("path", "")
        if path not in self.cfg.open_paths and scope.get("method") != "OPTIONS" \
                and not self.cfg.authorized(headers.get("authorization")):
            missing = "authorization" not in headers
            return await reply(401, "missing API key: send 'Authorization: Bearer <key>'" if missing else
                               "invalid API key", "missing_api_key" if missing else "invalid_api_key",
                               headers={"WWW-Authenticate": "Bearer"})
        if self.cfg.tenancy is not None:  # the routes serve the key's tenant (None on open paths)
            scope.setdefault("state", {})["tenant"] = self.cfg.tenancy.of(self.cfg.match(headers.get("authorization")))
        if scope.get("method") not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        limit = self.cfg.max_body_bytes
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            return await reply(413, f"request body too large ({declared} bytes > {limit})", "body_too_large")
        chunks, size = [], 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            chunks.append(msg.get("body", b""))
            size += len(chunks[-1])
            if size > limit:
                return await reply(413, f"request body too large (> {limit} bytes)", "body_too_large")
            if not msg.get("more_body", False):
                break
        body = b"".join(chunks)
        parsed = parse_json(body, headers.get("content-type", ""))
        if parsed is not UNPARSED:  # the routes read it here instead of parsing the body again
            scope.setdefault("state", {})["json_body"] = parsed
        problem = self._passage_limits(parsed)
        if problem is not None:
            return await reply(413, problem[0], problem[1])
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # later: disconnects reach the app as before

        return await self.app(scope, replay, send)

    def _passage_limits(self, obj):
        if not isinstance(obj, dict):
            return None  # not JSON, or not an object: the route answers that itself
        texts, count = [], 0
        for name in _DOC_FIELDS:
            v = obj.get(name)
            items = [v] if isinstance(v, str) else v if isinstance(v, list) else []
            count += len(items)
            if name != "document_ids":
                texts += [t for t in items if isinstance(t, str)]
        if self.cfg.max_documents is not None and count > self.cfg.max_documents:
            return (f"too many documents in one request ({count} > {self.cfg.max_documents})", "too_many_documents")
        if self.cfg.max_request_tokens is not None and texts and self.tokenizer is not None:
            n = sum(len(ids) for ids in self.tokenizer(texts, add_special_tokens=False)["input_ids"])
            if n > self.cfg.max_request_tokens:
                return (f"documents too long for one request ({n} tokens > {self.cfg.max_request_tokens})",
                        "too_many_tokens")
        return None


UNPARSED = object()  # a body that is not JSON (the route reports malformed JSON itself)


def parse_json(body: bytes, content_type: str):
    """The JSON value of a request body, or `UNPARSED`."""
    if not body or "json" not in (content_type or "application/json"):
        return UNPARSED
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return UNPARSED


def install_security(app, config: SecurityConfig | None, tokenizer=None) -> None:
    """Add the checks (and CORS when origins are configured) to a FastAPI/Starlette app."""
    if config is None:
        return
    app.add_middleware(SecurityMiddleware, config=config, tokenizer=tokenizer)
    if config.cors_origins:  # added last = outermost: preflights are answered before authentication
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(config.cors_origins), allow_credentials=False,
                           allow_methods=["GET", "POST", "DELETE", "OPTIONS"],
                           allow_headers=["Authorization", "Content-Type"])
    app.state.security = config
