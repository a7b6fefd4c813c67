"""kvstitch: stitched KV-cache reuse with selective recompute for long-context RAG."""

import os

# torch's OpenMP workers (libgomp) spin GOMP_SPINCOUNT times after each parallel op before they sleep; the
# default 300,000 spins keep them busy for milliseconds on CPUs with a slow PAUSE, holding the cores the sparse
# decode kernel's threads then need (batched PRKV steps measured ~12% faster at 30,000, dense steps unchanged).
# libgomp reads it once, when torch loads it: a program that imports torch before kvstitch keeps its own.
os.environ.setdefault("GOMP_SPINCOUNT", "30000")

from .engine import Engine, GenerationResult, GenerationStats
from .engine.budget import AutoBudget
from .core.errors import (BadAutoOption, BadDecodeOption, BadMethodOption, BadRatio, EvalError, InputError,
                          KVStitchDeprecationWarning, KVStitchError, MissingExtra, ModelLoadError, PositionRecoveryError, PromptTooLong,
                          StoreError, UnknownDecodePolicy, UnknownMethod)
from .decode import PRKV, ArkVale, DecodePolicy, Dense, Quest, ShadowKV, SnapKV
from .select import methods

__version__ = "0.1.0"
__all__ = ["Engine", "GenerationResult", "GenerationStats", "methods", "KVStitchError", "KVStitchDeprecationWarning", "InputError",
           "ModelLoadError", "PositionRecoveryError", "StoreError", "EvalError", "MissingExtra", "UnknownMethod",
           "BadMethodOption", "BadRatio", "PromptTooLong", "UnknownDecodePolicy", "BadDecodeOption", "BadAutoOption",
           "AutoBudget", "DecodePolicy", "Dense", "PRKV", "Quest", "ArkVale", "SnapKV", "ShadowKV"]
