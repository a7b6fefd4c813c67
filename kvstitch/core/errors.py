"""Typed errors. Every user-facing failure is one of these, with a one-line message."""

from __future__ import annotations


class KVStitchError(Exception):
    """Base class: the CLI prints `str(err)` on one line and exits non-zero."""


class KVStitchDeprecationWarning(DeprecationWarning):
    """Every deprecation kvstitch warns about (a deprecated keyword or CLI spelling): one class, so callers (and
    kvstitch's own tests, which make it an error) can filter kvstitch's deprecations apart from other packages'."""


class InputError(KVStitchError, ValueError):
    """Bad request: empty question/chunks, ratio out of range, unknown method, prompt too long.

    `code` (OpenAI-style error code) and `param` (the offending request field, or None) say what was wrong
    in a form callers can dispatch on (the server maps them to its error JSON); the typed subclasses below
    set both. Pass ``param=`` / ``code=`` to override them for one error."""

    code: str = "invalid_request"
    param: str | None = None

    def __init__(self, message: str = "", *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        if param is not None:
            self.param = param
        if code is not None:
            self.code = code


class UnknownMethod(InputError):
    """A selection method name that is not registered (`kvstitch.select.check_method`)."""

    code, param = "invalid_method", "method"


class BadMethodOption(InputError):
    """Options a selection method does not take, or values it refuses."""

    code, param = "invalid_method", "method"


class BadRatio(InputError):
    """A recompute ratio outside [0, 1] (or not a number)."""

    code, param = "invalid_request", "ratio"


class BadAutoOption(InputError):
    """Options the adaptive budget (``recompute_ratio="auto"``, `AutoBudget`) does not take, or values it refuses."""

    code, param = "invalid_request", "auto"


class PromptTooLong(InputError):
    """Prompt + new tokens exceed the model's positions (nothing is ever truncated)."""

    code, param = "context_length_exceeded", "messages"


class UnknownDecodePolicy(InputError):
    """A sparse decode policy name that is not registered."""

    code, param = "invalid_decode", "decode"


class BadDecodeOption(InputError):
    """Options a decode policy does not take, or values it refuses."""

    code, param = "invalid_decode", "decode"


class EvalError(KVStitchError):
    """An evaluation run in which every sample failed (the log holds no new row; see errors.log)."""

    exit_code = 1  # the run failed; 2 is kept for bad input


class ModelLoadError(KVStitchError):
    """The model path is unreadable or the architecture is not supported."""


class PositionRecoveryError(KVStitchError):
    """RoPE re-rotation failed its self-check; stitching would silently corrupt attention."""


class StoreError(KVStitchError):
    """A store backend is unreachable or misconfigured."""


class CorruptEntryError(StoreError):
    """A stored entry failed its checksum / fingerprint check (it is not used)."""


class MissingExtra(KVStitchError, ImportError):
    """A feature whose optional dependencies (a pip extra of kvstitch) are not installed (`core.extras.require`).

    An ImportError too, so code that falls back on a missing import still does."""

    def __init__(self, feature: str, extra: str):
        super().__init__(f"{feature} needs the '{extra}' extra: pip install 'kvstitch[{extra}]'")
        self.feature, self.extra = feature, extra

    def __reduce__(self):  # rebuilt from its fields (pickled across processes, e.g. by Ray)
        return type(self), (self.feature, self.extra)
