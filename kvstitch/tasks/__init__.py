"""Tasks (foundations): RULER-style synthetic tasks (`tasks`, their haystacks and words), real QA datasets
(`datasets`), RULER scoring (`scoring`), fidelity metrics vs full prefill (`metrics`, needs torch) and agreement
with full prefill's answer (`agreement`).

Only the light, dependency-free pieces are re-exported here; import `metrics` and `datasets` directly.
"""

from .grading import aggregate, score, scorer_for, string_match_all, string_match_part
from .tasks import TASKS, Sample, generate
from .haystack import whitespace_tokens

__all__ = ["TASKS", "Sample", "generate", "whitespace_tokens", "score", "scorer_for", "aggregate",
           "string_match_all", "string_match_part"]
