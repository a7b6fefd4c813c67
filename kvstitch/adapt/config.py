"""The settings of a `kvstitch adapt` run (`AdaptConfig`: they must match to resume it) and the adapter's parts a
run may keep frozen."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from kvstitch.core.errors import InputError
from kvstitch.models.stitch_adapter import ATTENTION_TARGETS, StitchAdapterConfig

# an adapter's parts and the prefixes of their parameters' names
PARTS = {"links": ("links",), "reader": ("lora_a.", "lora_b."), "writer": ("writer_a.", "writer_b.")}


def part_size(config, part: str) -> int:
    """How many link tokens, or the LoRA's rank, of ``part`` in an `AdaptConfig` or `StitchAdapterConfig` (0: none)."""
    return getattr(config, "rank" if part == "reader" else part)


@dataclass(frozen=True)
class AdaptConfig:
    """The settings of a training run (they must match to resume it)."""

    links: int = 8
    rank: int = 8
    alpha: float = 16.0
    writer: int = 0  # writer LoRA rank (changes precompute; trains at ratio 0)
    targets: tuple[str, ...] = ATTENTION_TARGETS  # the projections the LoRAs adapt
    steps: int = 200
    batch: int = 8  # questions per optimizer step
    lr: float = 5e-4
    warmup: int = 10
    passages: int = 10  # passages per context
    per_context: int = 16  # questions per context
    groupings: int = 1  # shuffles of the built-in corpus's articles into contexts (`squad_contexts`)
    ratios: tuple[float, ...] = (0.0,)  # recompute ratios the student is trained at (cycled)
    method: str = "deltaprop(base=infoflow)"  # picks the recomputed tokens at a ratio > 0
    top_k: int = 64
    question_weight: float = 0.5
    answer_ce: float = 0.0  # weight of the teacher's answer tokens' cross-entropy, beside the KL (training only)
    answer_margin: float = 0.0  # weight of the hinge on those tokens' margins (`distill.margin_hinge`; training only)
    max_answer: int = 16
    seed: int = 0
    corpus: str = "squad"  # "squad" (built-in) or a folder of the user's documents
    val_questions: int = 16
    eval_every: int = 25
    save_every: int = 10
    init: str = ""  # digest of the adapter training starts from ("": fresh)
    freeze: tuple[str, ...] = ()  # parts (`PARTS`) kept as ``init`` holds them

    def __post_init__(self):
        for name in ("steps", "batch", "passages", "per_context", "groupings", "top_k", "max_answer", "save_every",
                     "eval_every"):
            v, least = getattr(self, name), 0 if name == "steps" else 1  # 0 steps: validate the start only
            if isinstance(v, bool) or not isinstance(v, int) or v < least:
                raise InputError(f"adapt {name} must be an integer >= {least}, got {v!r}")
        if not self.lr > 0:
            raise InputError(f"adapt lr must be > 0, got {self.lr}")
        for name in ("answer_ce", "answer_margin"):
            if not getattr(self, name) >= 0:
                raise InputError(f"adapt {name} must be >= 0, got {getattr(self, name)}")
        for r in self.ratios:
            if not 0 <= r < 1:
                raise InputError(f"adapt ratios must be in [0, 1), got {r}")
        unknown = [p for p in self.freeze if p not in PARTS]
        if unknown:
            raise InputError(f"adapt freeze takes parts among {', '.join(PARTS)}; got {', '.join(unknown)}")
        absent = [p for p in self.freeze if not part_size(self, p)]
        if absent:
            raise InputError(f"adapt freeze: this adapter has no {', '.join(absent)} to keep")
        if self.freeze and not self.init:
            raise InputError("adapt freeze keeps parts of the adapter training starts from: pass --init")
        if self.steps and set(self.freeze) >= {p for p in PARTS if part_size(self, p)}:
            raise InputError("adapt freeze leaves nothing to train")
        if self.trains_writer and any(r > 0 for r in self.ratios):
            raise InputError("an adapter with a writer LoRA trains at ratio 0 (its passages are written in the "
                             "student's pass; a method's selection would read stale caches); --freeze writer "
                             "trains the parts beside it at any ratio")
        try:
            self.adapter
        except ValueError as e:
            raise InputError(str(e)) from None

    @property
    def trains_writer(self) -> bool:
        """Its writer LoRA learns, so passages are written in the student's graph (not read from the store)."""
        return bool(self.writer) and "writer" not in self.freeze

    @property
    def adapter(self) -> StitchAdapterConfig:
        return StitchAdapterConfig(self.links, self.rank, self.alpha, tuple(self.targets), writer=self.writer)

    def identity(self) -> dict:
        """The settings a run directory records (an option left at its default is not recorded, so runs written
        before it existed still resume)."""
        d = json.loads(json.dumps(asdict(self)))
        for name, default in (("writer", 0), ("init", ""), ("answer_ce", 0.0), ("answer_margin", 0.0),
                              ("groupings", 1), ("targets", list(ATTENTION_TARGETS)), ("freeze", [])):
            if d[name] == default:
                d.pop(name)
        return d
