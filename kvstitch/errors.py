"""Typed errors. Every user-facing failure is one of these, with a one-line message."""


class KVStitchError(Exception):
    """Base class: the CLI prints `str(err)` on one line and exits non-zero."""


class InputError(KVStitchError, ValueError):
    """Bad request: empty question/chunks, ratio out of range, unknown method, prompt too long."""


class ModelLoadError(KVStitchError):
    """The model path is unreadable or the architecture is not supported."""


class PositionRecoveryError(KVStitchError):
    """RoPE re-rotation failed its self-check; stitching would silently corrupt attention."""


class StoreError(KVStitchError):
    """A store backend is unreachable or misconfigured."""


class CorruptEntryError(StoreError):
    """A stored entry failed its checksum / fingerprint check (it is not used)."""
