"""SQuAD as multi-passage RAG: each question over its gold paragraph and other paragraphs of the same article.

A RAG retriever returns several on-topic passages, one of which holds the answer; SQuAD's articles give that
shape for free (the other paragraphs of the article are on-topic distractors). For a question of paragraph g
of an article with paragraphs 0..M-1, a sample holds ``passages`` paragraphs: g plus ``passages - 1`` others
of the article drawn without replacement (all of them when the article has fewer), shuffled. Both draws use
an rng seeded by (seed, question id), so a sample is the same whatever else is run. The gold paragraph's
position is recorded (``gold_position`` and ``depth`` = position / (P - 1): the lost-in-the-middle plot).

``merge`` > 1 joins every ``merge`` adjacent passages into one chunk (the same text and order: one prompt,
fewer and larger chunk caches), to measure what separate precompute of many short passages costs.

Questions are visited in one seeded permutation of the whole dev set (``SPLIT_SEED``), so the samples
``0:100`` (the tuning split) and ``100:`` (the report split) are spread over every article.

SQuAD v2.0 adds unanswerable questions (empty ``answers``); their prompt asks the model to say
``unanswerable`` when the passages do not hold the answer, and a reply that does so is an abstention
(`abstains`). Scored with SQuAD's official EM / F1 (`kvstitch.tasks.grading.squad_em`, `squad_f1`) on the
answer's first line, an abstention counting as the empty answer.

Data: the official dev sets v1.1 and v2.0 (Rajpurkar et al. 2016, 2018), CC BY-SA 4.0, vendored in
``kvstitch/data/datasets`` with their attribution (``NOTICE``).
"""

from __future__ import annotations

import gzip
import json
import random
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path

from kvstitch.core.errors import InputError
from .grading import UNANSWERABLE, abstains  # noqa: F401 (part of this module's API)
from .tasks import Sample

FILES = {"squad": "squad-dev-v1.1.json.gz", "squad2": "squad-dev-v2.0.json.gz"}
SPLIT_SEED = 2016  # the visiting order of the questions: fixed, so splits name the same questions everywhere
TUNING_SPLIT = (0, 100)  # samples tuned on; results are reported on the rest (100:)
# Stitch adapters train on these articles of the v1.1 dev set (`kvstitch.adapt`): the articles v2.0's dev set
# does not hold, the eight with fewest questions among the tuning and report samples (v1.1 0:400, v2.0 0:250).
# Their questions are never reported for an adapter (`heldout`); the last one gives the validation loss only.
ADAPTER_ARTICLES = ("United_Methodist_Church", "Doctor_Who", "Genghis_Khan", "Newcastle_upon_Tyne", "Kenya",
                    "Teacher", "Victoria_and_Albert_Museum", "Chloroplast")
DEFAULT_PASSAGES = 10
ANSWER_TOKENS = 24
INSTRUCTION = ("Answer the question directly based on the given passages. Do NOT repeat the question. "
               "The answer should be within 5 words.")
ABSTAIN_INSTRUCTION = f" If the passages do not contain the answer, reply \"{UNANSWERABLE}\"."
@dataclass(frozen=True)
class Question:
    qid: str
    text: str
    answers: tuple[str, ...]  # empty: unanswerable (v2.0)
    article: int
    paragraph: int


@dataclass(frozen=True)
class SquadSet:
    version: str  # "squad" (v1.1) or "squad2" (v2.0)
    articles: tuple[tuple[str, ...], ...]  # per article, its paragraphs
    questions: tuple[Question, ...]  # in the visiting order
    titles: tuple[str, ...] = ()  # per article

    def adapter_articles(self) -> set[int]:
        """The articles stitch adapters train on (`ADAPTER_ARTICLES`), by index."""
        return {i for i, t in enumerate(self.titles) if t in ADAPTER_ARTICLES}

    def heldout(self, q: Question) -> bool:
        """True when a question may be reported for a stitch adapter: its article is not one it trained on."""
        return q.article not in self.adapter_articles()


def squad_path(version: str) -> Path:
    if version not in FILES:
        raise InputError(f"unknown SQuAD version {version!r}; known: {', '.join(FILES)}")
    return Path(str(resources.files("kvstitch") / "data" / "datasets" / FILES[version]))


@lru_cache(maxsize=4)
def read_squad(version: str, path: str | None = None) -> SquadSet:
    """A SQuAD JSON file (official shape, gzip or not) -> its articles and questions, questions in the
    seeded visiting order. A malformed record is an `InputError` naming it."""
    p = Path(path) if path else squad_path(version)
    opener = gzip.open if p.suffix == ".gz" else open
    try:
        with opener(p, "rt", encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InputError(f"cannot read SQuAD file {p}: {e}") from None
    if not isinstance(data, dict) or not isinstance(data.get("data"), list) or not data["data"]:
        raise InputError(f"{p}: expected SQuAD's shape {{\"data\": [{{\"title\", \"paragraphs\"}}]}}")
    articles, questions, titles = [], [], []
    for a, art in enumerate(data["data"]):
        where = f"{p}, article {a}"
        paras = art.get("paragraphs") if isinstance(art, dict) else None
        if not isinstance(paras, list) or not paras:
            raise InputError(f"{where}: 'paragraphs' must be a non-empty list")
        texts = []
        for g, para in enumerate(paras):
            ctx = para.get("context") if isinstance(para, dict) else None
            if not isinstance(ctx, str) or not ctx.strip():
                raise InputError(f"{where}, paragraph {g}: 'context' must be a non-empty string")
            texts.append(ctx.strip())
            for qa in para.get("qas") or []:
                questions.append(_question(qa, f"{where}, paragraph {g}", a, g, version))
        articles.append(tuple(texts))
        titles.append(str(art.get("title", a)))
    if not questions:
        raise InputError(f"{p} holds no questions")
    random.Random(SPLIT_SEED).shuffle(questions)
    return SquadSet(version, tuple(articles), tuple(questions), tuple(titles))


def _question(qa: object, where: str, article: int, paragraph: int, version: str) -> Question:
    if not isinstance(qa, dict) or not isinstance(qa.get("question"), str) or not qa["question"].strip():
        raise InputError(f"{where}: a question needs a non-empty 'question'")
    answers = qa.get("answers")
    if not isinstance(answers, list) or not all(isinstance(x, dict) and isinstance(x.get("text"), str)
                                                for x in answers):
        raise InputError(f"{where}, question {qa.get('id')!r}: 'answers' must be a list of {{\"text\"}}")
    texts = tuple(dict.fromkeys(x["text"].strip() for x in answers if x["text"].strip()))
    if not texts and (version == "squad" or not qa.get("is_impossible", True)):
        raise InputError(f"{where}, question {qa.get('id')!r}: no answer (only SQuAD v2.0 has unanswerable ones)")
    return Question(str(qa.get("id", "")), qa["question"].strip(), texts, article, paragraph)


def passages_for(squad: SquadSet, q: Question, passages: int, seed: int) -> tuple[list[str], int]:
    """The question's paragraphs (gold + on-topic distractors, shuffled) and the gold one's position."""
    paras = squad.articles[q.article]
    rng = random.Random(f"{seed}:{q.qid}")
    others = [i for i in range(len(paras)) if i != q.paragraph]
    picked = [q.paragraph] + rng.sample(others, min(len(others), passages - 1))
    rng.shuffle(picked)
    return [paras[i] for i in picked], picked.index(q.paragraph)


def task_name(version: str, passages: int, merge: int = 1) -> str:
    """What rows call the task: ``squad_p10``, ``squad2_p40``, ``squad_p40_m4`` (4 passages a chunk)."""
    return f"{version}_p{passages}" + (f"_m{merge}" if merge > 1 else "")


def load_squad(version: str, passages: int = DEFAULT_PASSAGES, seed: int = 0, start: int = 0,
               stop: int | None = None, merge: int = 1, path: str | None = None) -> list[Sample]:
    """Samples ``start`` .. ``stop`` of the visiting order, each over ``passages`` paragraphs of its article,
    ``merge`` adjacent passages to a chunk."""
    if passages < 1:
        raise InputError(f"--passages must be >= 1, got {passages}")
    if merge < 1:
        raise InputError(f"--merge-passages must be >= 1, got {merge}")
    squad = read_squad(version, path)
    n = len(squad.questions)
    if not 0 <= start < n or (stop is not None and not start < stop):
        raise InputError(f"sample range {start}:{'' if stop is None else stop} is outside {version}'s {n} questions")
    task = task_name(version, passages, merge)
    instruction = INSTRUCTION + (ABSTAIN_INSTRUCTION if version == "squad2" else "")
    out = []
    for i in range(start, min(stop if stop is not None else n, n)):
        q = squad.questions[i]
        paras, gold = passages_for(squad, q, passages, seed)
        chunks = ["\n\n".join(paras[j:j + merge]) for j in range(0, len(paras), merge)]
        out.append(Sample(task=task, chunks=chunks, question=f"{q.text}\n{instruction}", answers=list(q.answers),
                          meta={"task": task, "seed": seed, "index": i, "length": 0, "chunk_tokens": 0,
                                "depth": gold / max(1, len(paras) - 1), "gold_position": gold,
                                "n_passages": len(paras), "n_chunks": len(chunks), "raw_question": q.text,
                                "qid": q.qid, "answerable": bool(q.answers), "max_new_tokens": ANSWER_TOKENS,
                                "qa": True, "squad": version}))
    return out
