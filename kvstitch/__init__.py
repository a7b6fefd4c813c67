"""kvstitch: stitched KV-cache reuse with selective recompute for long-context RAG."""

from .engine import Engine, GenerationResult, GenerationStats
from .engine.budget import AutoBudget
from .core.errors import (BadAutoOption, BadDecodeOption, BadMethodOption, BadRatio, EvalError, InputError,
                          KVStitchError, ModelLoadError, PositionRecoveryError, PromptTooLong, StoreError,
                          UnknownDecodePolicy, UnknownMethod)
from .decode import PRKV, ArkVale, DecodePolicy, Dense, Quest, ShadowKV, SnapKV
from .select import methods

__version__ = "0.1.0"
__all__ = ["Engine", "GenerationResult", "GenerationStats", "methods", "KVStitchError", "InputError", "ModelLoadError",
           "PositionRecoveryError", "StoreError", "EvalError", "UnknownMethod", "BadMethodOption", "BadRatio",
           "PromptTooLong", "UnknownDecodePolicy", "BadDecodeOption", "BadAutoOption", "AutoBudget", "DecodePolicy",
           "Dense", "PRKV", "Quest", "ArkVale", "SnapKV", "ShadowKV"]
