"""RULER scoring: substring recall of the gold answers in the prediction, case-insensitive.

Per-sample scores are in [0, 1]; `aggregate` reports the mean x100 as RULER tables do. Retrieval and
aggregation tasks need every answer (`string_match_all`); QA-style tasks (qa, two_hop) accept any one
(`string_match_part`), since the gold list there holds alternative phrasings, not a set to recall.
Real QA datasets (`kvstitch.tasks.datasets`) are scored by LongBench's QA F1 (`qa_f1`) and exact match.
"""

from __future__ import annotations

import math
import re
import string
from collections import Counter
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


# ---- Real QA (LongBench's `qa_f1_score`, SQuAD's normalisation) -------------------------------------------

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = set(string.punctuation)


def normalize_answer(s: str) -> str:
    """Lower case, no punctuation, no articles (a, an, the), single spaces: LongBench's ``normalize_answer``."""
    s = "".join(ch for ch in s.lower() if ch not in _PUNCT)
    return " ".join(_ARTICLES.sub(" ", s).split())


def first_line(pred: str) -> str:
    """The answer's first non-empty line: a short-answer prompt's answer, without what a model adds after it."""
    return next((line for line in pred.strip().splitlines() if line.strip()), "")


def _f1(pred_tokens: list[str], gold_tokens: list[str]) -> float:
    common = Counter(pred_tokens) & Counter(gold_tokens)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred_tokens), same / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def qa_f1(pred: str, refs: Sequence[str]) -> float:
    """LongBench's QA F1 (bag of normalised words), best over the gold answers, on the answer's first line."""
    _check(refs)
    p = normalize_answer(first_line(pred)).split()
    return max(_f1(p, normalize_answer(r).split()) for r in refs)


def exact_match(pred: str, refs: Sequence[str]) -> float:
    """1.0 when the normalised first line equals a normalised gold answer."""
    _check(refs)
    p = normalize_answer(first_line(pred))
    return float(any(p == normalize_answer(r) for r in refs))


def answer_correct(pred: str, refs: Sequence[str]) -> bool:
    """A QA answer is right when a normalised gold answer occurs as whole words in its normalised first line
    (exact match, or the answer inside a short sentence: "He studied at Exeter College")."""
    _check(refs)
    p = f" {normalize_answer(first_line(pred))} "
    return any(f" {normalize_answer(r)} " in p for r in refs if normalize_answer(r))


UNANSWERABLE = "unanswerable"  # what SQuAD v2.0 prompts ask the model to say
# a reply that says the passages do not answer, in the words small models use for it
_ABSTAIN = re.compile(r"\b(unanswerable|not (?:mentioned|provided|stated|given|specified|found|available|"
                      r"contained|answerable)|no (?:answer|information|mention)|cannot be (?:answered|determined)|"
                      r"does not (?:say|mention|contain|provide|state)|do not (?:say|mention|contain|provide|state)|"
                      r"unknown|none of the passages)\b", re.I)


def abstains(pred: str) -> bool:
    """Does the answer's first line say the passages do not answer the question?"""
    return bool(_ABSTAIN.search(first_line(pred)))



# ---- SQuAD's official EM / F1 (evaluate-v2.0.py), an abstention being the empty answer ------------------

def _squad_pred(pred: str) -> str:
    return "" if abstains(pred) else normalize_answer(first_line(pred))


def _squad_f1_one(pred: str, gold: str) -> float:
    p, g = pred.split(), normalize_answer(gold).split()
    if not p or not g:  # unanswerable gold (or an empty reply): right only when both are empty
        return float(p == g)
    return _f1(p, g)


def squad_f1(pred: str, refs: Sequence[str]) -> float:
    """SQuAD's F1 on the answer's first line, best over the gold answers; no gold answers = unanswerable,
    where only an abstention scores 1."""
    p = _squad_pred(pred)
    return max(_squad_f1_one(p, r) for r in (refs or [""]))


def squad_em(pred: str, refs: Sequence[str]) -> float:
    """SQuAD's exact match on the answer's first line (no gold answers: 1 for an abstention)."""
    p = _squad_pred(pred)
    return float(any(p == normalize_answer(r) for r in (refs or [""])))


def squad_correct(pred: str, refs: Sequence[str]) -> bool:
    """Right: a gold answer as whole words in the first line (`answer_correct`), or, for an unanswerable
    question, an abstention."""
    if not refs:
        return abstains(pred)
    return not abstains(pred) and answer_correct(pred, refs)


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
