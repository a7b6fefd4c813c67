"""Agreement with full prefill: does the stitched answer say what full prefill would have said?

`first_words_agree`: the first ``words`` (12) whitespace words match exactly, after normalising case and
surrounding punctuation — the check a user would make reading both answers side by side. Answers shorter
than ``words`` must match whole. `same_answer`: the SQuAD-normalised first lines are equal (short answers).
`first_token_agree`: the first generated token ids are equal. `agreeing_prefix`: how far a teacher-forced argmax
reproduces a given answer (as far as it does, the greedy answer IS that answer: same conditioning at every step).
"""

from __future__ import annotations

import re

WORDS = 12
_STRIP = re.compile(r"^[\W_]+|[\W_]+$")


def _words(text: str, n: int) -> list[str]:
    out = []
    for w in text.split():
        w = _STRIP.sub("", w.lower())
        if w:
            out.append(w)
        if len(out) == n:
            break
    return out


def first_words_agree(text: str, reference: str, words: int = WORDS) -> bool:
    return _words(text, words) == _words(reference, words)


def same_answer(text: str, reference: str) -> bool:
    """The same answer once SQuAD-normalised: the first lines equal after lower-casing and dropping
    punctuation, articles and extra spaces (a short answer judged by what it says, not how)."""
    from .grading import first_line, normalize_answer

    return normalize_answer(first_line(text)) == normalize_answer(first_line(reference))


def first_token_agree(tokens, reference_tokens) -> bool:
    return bool(tokens) and bool(reference_tokens) and int(tokens[0]) == int(reference_tokens[0])


def agreeing_prefix(pred, tokens) -> int:
    """How many leading ``tokens`` the argmax ``pred`` (one per position, teacher-forced after the prompt)
    reproduces."""
    k = 0
    while k < len(tokens) and k < len(pred) and int(pred[k]) == int(tokens[k]):
        k += 1
    return k
