"""Typed errors. Every user-facing failure is one of these, with a one-line message."""


class KVStitchError(Exception):
    """Base class: the CLI prints `str(err)` on one line and exits non-zero."""


class InputError(KVStitchError, ValueError):
    """Bad request: empty question/chunks, ratio out of range, unknown method, prompt too long."""


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
