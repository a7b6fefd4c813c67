"""The engine: the request path (`engine.Engine`), the adaptive budget (`budget`), the cold path (`cold`),
chunk-cache precompute (`precompute`), batched steps (`batch`) and the typed stats of a result (`stats`)."""

from .engine import STOP, Engine, GenerationRequest, GenerationResult, Prefill
from .stats import GenerationStats

__all__ = ["Engine", "GenerationRequest", "GenerationResult", "GenerationStats", "Prefill", "STOP"]
