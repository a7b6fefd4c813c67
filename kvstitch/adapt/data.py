"""What a stitch adapter trains on: contexts of passages, each with the questions asked over it.

The built-in corpus is SQuAD dev v1.1, split **by article**: adapters train on the articles
`kvstitch.tasks.squad.ADAPTER_ARTICLES` names (the v1.1 dev articles that v2.0's dev set does not hold, the eight
with fewest questions among the tuning and report samples). Their questions are never reported: evaluation of
an adapter keeps only the other articles' questions (`SquadSet.heldout`, `kvstitch eval --heldout`), and the
whole of SQuAD v2.0, NIAH and MuSiQue stay out of training. The last training article (`VALIDATION_ARTICLE`)
gives the validation loss only. The reader's strength may instead be tuned on the tuning split's held-out questions
(`tuning_contexts`): each over the passages the evaluation gives it, so like the reported questions, yet never
reported.

A context is ``passages`` paragraphs of one article; its questions are SQuAD's questions of those paragraphs
(human-written), prompted as the evaluation prompts them. A user's own documents (`document_contexts`)
get questions the model itself writes about one passage.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from kvstitch.core.errors import InputError
from kvstitch.tasks.squad import ADAPTER_ARTICLES, INSTRUCTION, TUNING_SPLIT, SquadSet, passages_for, read_squad

VALIDATION_ARTICLE = ADAPTER_ARTICLES[-1]
QUESTION_PROMPT = ("Write one question that the passage below answers with a short fact (a name, a number, a "
                   "date or a few words). Reply with the question only.\n\nPassage: {passage}")


@dataclass(frozen=True)
class Context:
    """Passages stitched together, and questions over them (prompt text: question + answer instruction)."""

    key: str
    passages: tuple[str, ...]
    questions: tuple[str, ...]


def prompt_question(text: str) -> str:
    return f"{text.strip()}\n{INSTRUCTION}"


def squad_contexts(passages: int, per_context: int, seed: int = 0, validation: bool = False,
                   groupings: int = 1) -> list[Context]:
    """Contexts over the training articles (or the validation article): each article's paragraphs shuffled and
    cut into groups of ``passages``; each group keeps up to ``per_context`` questions of its paragraphs.

    ``groupings`` > 1 adds the contexts of further shuffles (seeds ``seed + 1`` ...): an article of 40-odd
    paragraphs gives one context of 40 per shuffle, so this is how long contexts multiply. Validation keeps the
    one grouping of ``seed``, so runs with more groupings validate on the same questions."""
    if passages < 1 or per_context < 1:
        raise InputError("passages and questions per context must be >= 1")
    if isinstance(groupings, bool) or not isinstance(groupings, int) or groupings < 1:
        raise InputError(f"groupings must be a positive integer, got {groupings!r}")
    if groupings > 1 and not validation:
        return [c for k in range(groupings) for c in squad_contexts(passages, per_context, seed + k)]
    squad: SquadSet = read_squad("squad")
    titles = squad.titles
    rng = random.Random(f"adapt:{seed}")
    by_para: dict[tuple[int, int], list[str]] = {}
    for q in squad.questions:
        by_para.setdefault((q.article, q.paragraph), []).append(q.text)
    out = []
    for a in sorted(squad.adapter_articles()):
        if (titles[a] == VALIDATION_ARTICLE) != validation:
            continue
        order = list(range(len(squad.articles[a])))
        rng.shuffle(order)
        for g in range(0, len(order) - passages + 1, passages):
            group = order[g:g + passages]
            qs = [t for p in group for t in by_para.get((a, p), [])]
            rng.shuffle(qs)
            out.append(Context(f"squad:{titles[a]}:{g // passages}", tuple(squad.articles[a][p] for p in group),
                               tuple(prompt_question(t) for t in qs[:per_context])))
    rng.shuffle(out)
    return out


def tuning_contexts(passages: int, n: int, seed: int = 0) -> list[Context]:
    """The first ``n`` held-out questions of SQuAD's tuning split (`TUNING_SPLIT`; articles no adapter trains on),
    one context each: the ``passages`` paragraphs `kvstitch eval --dataset squad --passages N` gives it (``seed``:
    the eval's)."""
    if passages < 1 or n < 1:
        raise InputError("passages and tuning questions must be >= 1")
    squad = read_squad("squad")
    out = []
    for q in squad.questions[slice(*TUNING_SPLIT)]:
        if squad.heldout(q) and len(out) < n:
            paras, _ = passages_for(squad, q, passages, seed)
            out.append(Context(f"squad-tuning:{q.qid}", tuple(paras), (prompt_question(q.text),)))
    return out


def document_contexts(engine, passages_text: list[str], passages: int, per_context: int, seed: int = 0,
                      progress: bool = True) -> list[Context]:
    """Contexts over a user's passages: groups of ``passages`` (in a seeded shuffle), each question written by
    the model about one passage of its group (full prefill of a one-passage prompt, greedy)."""
    if len(passages_text) < passages:
        raise InputError(f"the corpus has {len(passages_text)} passages, fewer than --passages {passages}")
    rng = random.Random(f"adapt-docs:{seed}")
    order = list(range(len(passages_text)))
    rng.shuffle(order)
    groups = [order[g:g + passages] for g in range(0, len(order) - passages + 1, passages)]
    from kvstitch.engine.precompute import progress_bar

    out = []
    with progress_bar(progress) as bar:
        task = bar.add_task("writing questions", total=len(groups), cps=0.0, tps=0.0)
        for k, group in enumerate(groups):
            asked = rng.sample(group, min(per_context, len(group)))
            qs = [q for q in (write_question(engine, passages_text[i]) for i in asked) if q]
            out.append(Context(f"docs:{k}", tuple(passages_text[i] for i in group),
                               tuple(prompt_question(q) for q in qs)))
            bar.advance(task)
    return [c for c in out if c.questions]


def write_question(engine, passage: str) -> str | None:
    """A question the model writes about ``passage`` (its first line ending in '?'), or None."""
    res = engine.generate(messages=[{"role": "user", "content": QUESTION_PROMPT.format(passage=passage.strip())}],
                          method="full", max_new_tokens=48)
    for line in res.text.splitlines():
        line = line.strip().removeprefix("Question:").strip()
        if line.endswith("?") and len(line) > 8:
            return line
    return None
