"""The engine: `Engine` (`engine`), a facade over the request and its validation (`request`), prefill
(`prefill`: stitch, select, recompute; the cold path `cold`, the adaptive budget `budget` and its verification
`short_prompt`), decoding (`answer`), verification (`verify`), teacher forcing and the greedy answer read off it
(`forcing`), chunk-cache precompute (`precompute`), the server's batched passes (`batch`), the seams a harness uses
(`hooks`), the device and dtype (`device`) and the typed stats of a result (`stats`)."""

from .engine import Engine
from .hooks import EngineHooks
from .request import STOP, GenerationRequest, GenerationResult, Prefill
from .stats import GenerationStats

__all__ = ["Engine", "EngineHooks", "GenerationRequest", "GenerationResult", "GenerationStats", "Prefill", "STOP"]
