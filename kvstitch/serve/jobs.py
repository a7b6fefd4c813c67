"""The pieces of the server that its parts share (kept apart so they import them without an import cycle):
OpenAI-shaped errors, a job for the engine worker, the queue-full signal."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvstitch.core.errors import InputError

if TYPE_CHECKING:
    from fastapi.responses import JSONResponse

    from kvstitch.engine.request import GenerationRequest


class ApiError(Exception):
    """An error answered as OpenAI's error JSON."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type_, code, param
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> "JSONResponse":
        from fastapi.responses import JSONResponse

        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def input_error(e: InputError) -> ApiError:
    """An `InputError` as a 400: its type sets `code` and `param` (`kvstitch.core.errors`), never its message."""
    return ApiError(400, str(e), code=e.code, param=e.param)


@dataclass
class Job:
    request: "GenerationRequest | None"  # what the engine runs (None for a ``fn`` job)
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    enqueued_at: float = field(default_factory=time.perf_counter)
    started_at: float | None = None
    tokens: int = 0
    checked_at: float = field(default_factory=time.monotonic)  # last client-disconnect check
    stop: list[str] = field(default_factory=list)  # stop sequences (handled here, not by the engine)
    fn: Any = None  # instead of a generation: fn(engine) -> result, run on the engine thread (documents API)
    kv_bytes: int | None = None  # the K/V it may hold (prompt + max_tokens), reserved in the worker's KV pool
    tenant: str | None = None  # whose store namespace it reads and writes (`kvstitch.serve.tenants`)

    def emit(self, kind: str, value=None) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:  # the event loop is gone (server shutting down)
            self.cancelled.set()

    def cancel(self) -> None:
        self.cancelled.set()


class ClientGone(Exception):
    """The client disconnected while its request waited or ran."""


class QueueFull(Exception):
    def __init__(self, retry_after: int):
        super().__init__(f"queue full; retry after {retry_after} s")
        self.retry_after = retry_after
