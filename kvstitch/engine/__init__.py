"""The engine: the request path (`engine.Engine`), the adaptive budget (`budget`), the cold path (`cold`),
chunk-cache precompute (`precompute`) and batched steps (`batch`)."""

from .engine import STOP, Engine, GenerationRequest, GenerationResult, Prefill

__all__ = ["Engine", "GenerationRequest", "GenerationResult", "Prefill", "STOP"]
