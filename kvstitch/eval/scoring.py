"""RULER scoring: substring recall of the gold answers in the prediction, case-insensitive.

Per-sample scores are in [0, 1]; `aggregate` reports the mean x100 as RULER tables do. Retrieval and
aggregation tasks need every answer (`string_match_all`); QA-style tasks (qa, two_hop) accept any one
(`string_match_part`), since the gold list there holds alternative phrasings, not a set to recall.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence

Scorer = Callable[[str, Sequence[str]], float]


def _clean(pred: str) -> str:
    return pred.replace("\x00", "").strip().lower()


def _check(refs: Sequence[str]) -> None:
    if not refs:
        raise ValueError("no reference answers to score against")


def string_match_all(pred: str, refs: Sequence[str]) -> float:
    """Fraction of the references that occur in the prediction."""
    _check(refs)
    p = _clean(pred)
    return sum(r.lower() in p for r in refs) / len(refs)


def string_match_part(pred: str, refs: Sequence[str]) -> float:
    """1.0 if any reference occurs in the prediction."""
    _check(refs)
    p = _clean(pred)
    return float(any(r.lower() in p for r in refs))


_PART_PREFIXES = ("qa", "two_hop")

SCORERS: dict[str, Scorer] = {
    **{t: string_match_all for t in ("niah_single_repeat", "niah_single_essay", "niah_single_uuid", "niah_multikey",
                                     "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe")},
    "two_hop": string_match_part,
}


def scorer_for(task: str) -> Scorer:
    """The registered scorer, else RULER's rule by family: `qa*`/`two_hop*` -> part, everything else -> all."""
    if task in SCORERS:
        return SCORERS[task]
    return string_match_part if task.startswith(_PART_PREFIXES) else string_match_all


def score(task: str, pred: str, refs: Sequence[str]) -> float:
    """Score one prediction in [0, 1] with the task's scorer."""
    return scorer_for(task)(pred, refs)


def aggregate(scores: Iterable[float]) -> float:
    """Mean x100 (RULER's reported unit); NaN for no scores."""
    vals = [float(s) for s in scores if s is not None and not math.isnan(float(s))]
    return 100.0 * sum(vals) / len(vals) if vals else math.nan
