"""kvstitch: stitched KV-cache reuse with selective recompute for long-context RAG."""

from .engine import Engine, GenerationResult
from .errors import InputError, KVStitchError, ModelLoadError, PositionRecoveryError, StoreError
from .select import methods

__version__ = "0.1.0"
__all__ = ["Engine", "GenerationResult", "methods", "KVStitchError", "InputError", "ModelLoadError",
           "PositionRecoveryError", "StoreError"]
