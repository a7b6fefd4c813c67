"""Model loading (HF directory, GGUF, embedded wheels) and per-family architecture adapters."""

from .adapter import ADAPTERS, ModelAdapter, adapter_for, cache_kwargs
from .loader import DEFAULT_MODEL, embedded_gguf, load_model, resolve_model

__all__ = ["ADAPTERS", "ModelAdapter", "adapter_for", "cache_kwargs", "DEFAULT_MODEL", "embedded_gguf", "load_model", "resolve_model"]
