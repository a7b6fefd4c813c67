"""Real RAG questions from a file: JSON or JSON lines, one chunk per passage, as `Sample`s for the eval.

Two record shapes are read:

- the common retrieval-QA shape (DPR / FiD / CacheBlend): ``question``, ``answers`` (a list, or one string
  under ``answer``), ``ctxs: [{"title", "text"}, ...]``; each passage is one chunk, ``title`` on its own
  line above the text when it has one;
- LongBench's: ``input`` (the question), ``context`` (one string), ``answers``; the context is split into
  its passages at LongBench's ``Passage N:`` markers (HotpotQA, 2WikiMQA, MuSiQue), else at blank lines.

``musique`` names the bundled file: the 150 MuSiQue samples of CacheBlend's evaluation
(``inputs/musique_s.json`` of github.com/YaoJiayi/CacheBlend, Apache-2.0; MuSiQue, Trivedi et al. 2022,
CC BY 4.0: see ``kvstitch/data/datasets/NOTICE``). A record that is not one of the shapes is an
`InputError` naming the file and the record; nothing is guessed.

The question carries CacheBlend's short-answer instruction (its ``query_prompt``), so answers are a few
words and scored by LongBench's QA F1 (`kvstitch.tasks.grading.qa_f1`) on the answer's first line.
"""

from __future__ import annotations

import gzip
import json
import re
from importlib import resources
from pathlib import Path

from kvstitch.core.errors import InputError
from .tasks import Sample

# CacheBlend's query instruction (example/blend_musique.py), after the question.
SHORT_ANSWER = ("Answer the question directly based on the given passages. Do NOT repeat the question. "
                "The answer should be within 5 words.")
ANSWER_TOKENS = 24  # greedy answer cap: a 5-word answer and its formatting; the first line is scored
BUNDLED = {"musique": "musique_s.json.gz"}  # squad / squad2: `kvstitch.tasks.squad`
_PASSAGE = re.compile(r"(?:^|\n)\s*Passage \d+:\s*\n")
_BLANK = re.compile(r"\n[ \t]*\n")


def dataset_path(spec: str) -> Path:
    """A bundled dataset's name (``musique``) or a file path -> the file."""
    if spec in BUNDLED:
        return Path(str(resources.files("kvstitch") / "data" / "datasets" / BUNDLED[spec]))
    p = Path(spec).expanduser()
    if not p.is_file():
        raise InputError(f"dataset {spec!r} is neither a file nor a bundled dataset ({', '.join(BUNDLED)})")
    return p


def dataset_name(spec: str) -> str:
    """The task name rows carry: the bundled name, or the file's stem (``data/nq_dev.jsonl`` -> ``nq_dev``)."""
    from .squad import FILES as SQUAD

    if spec in BUNDLED or spec in SQUAD:
        return spec
    name = Path(spec).name
    for suffix in (".gz", ".jsonl", ".json"):
        name = name.removesuffix(suffix)
    return name


def _records(path: Path) -> list[tuple[str, object]]:
    """-> [(where, record)]: JSON (a list, or {"data": [...]}) or JSON lines, gzip-compressed or not."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"cannot read dataset {path}: {e}") from None
    stripped = text.lstrip()
    if not stripped:
        raise InputError(f"dataset {path} is empty")
    if stripped[0] == "[" or (stripped[0] == "{" and not _is_jsonl(text)):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise InputError(f"dataset {path} is not valid JSON: {e}") from None
        if isinstance(data, dict):
            data = data.get("data")
        if not isinstance(data, list):
            raise InputError(f"dataset {path}: expected a list of records (or {{\"data\": [...]}})")
        return [(f"record {i}", r) for i, r in enumerate(data)]
    out = []
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            out.append((f"line {n}", json.loads(line)))
        except json.JSONDecodeError as e:
            raise InputError(f"dataset {path}, line {n}: not valid JSON ({e})") from None
    return out


def _is_jsonl(text: str) -> bool:
    first = text.lstrip().split("\n", 1)[0]
    try:
        json.loads(first)
    except json.JSONDecodeError:
        return False
    return bool(text.strip().count("\n"))


def _answers(rec: dict, where: str) -> list[str]:
    ans = rec.get("answers") if rec.get("answers") is not None else rec.get("answer")
    if isinstance(ans, str):
        ans = [ans]
    if not isinstance(ans, list) or not ans or not all(isinstance(a, str) and a.strip() for a in ans):
        raise InputError(f"{where}: 'answers' must be a non-empty list of non-empty strings")
    return [a.strip() for a in ans]


def _ctxs_chunks(ctxs, where: str) -> list[str]:
    if not isinstance(ctxs, list) or not ctxs:
        raise InputError(f"{where}: 'ctxs' must be a non-empty list of passages")
    chunks = []
    for j, c in enumerate(ctxs):
        if isinstance(c, str):
            c = {"text": c}
        if not isinstance(c, dict) or not isinstance(c.get("text"), str) or not c["text"].strip():
            raise InputError(f"{where}: passage {j} needs a non-empty 'text'")
        title = c.get("title") or ""
        if not isinstance(title, str):
            raise InputError(f"{where}: passage {j} has a 'title' that is not a string")
        chunks.append(f"{title.strip()}\n{c['text'].strip()}" if title.strip() else c["text"].strip())
    return chunks


def split_passages(context: str) -> list[str]:
    """LongBench's context -> its passages: at ``Passage N:`` markers when it has them, else at blank lines."""
    parts = _PASSAGE.split(context) if _PASSAGE.search(context) else _BLANK.split(context)
    return [p.strip() for p in parts if p.strip()]


def to_sample(rec: object, where: str, task: str, index: int) -> Sample:
    """One record (either shape) -> a `Sample` (question with the short-answer instruction, one chunk per
    passage). `where` names the record in errors."""
    if not isinstance(rec, dict):
        raise InputError(f"{where}: a record must be a JSON object, got {type(rec).__name__}")
    if "ctxs" in rec:
        question, chunks = rec.get("question"), _ctxs_chunks(rec["ctxs"], where)
    elif "context" in rec:
        question = rec.get("input", rec.get("question"))
        if not isinstance(rec["context"], str) or not rec["context"].strip():
            raise InputError(f"{where}: 'context' must be a non-empty string")
        chunks = split_passages(rec["context"])
    else:
        raise InputError(f"{where}: neither the retrieval-QA shape (question, answers, ctxs) nor LongBench's "
                         f"(input, context, answers); keys: {', '.join(sorted(rec)) or 'none'}")
    if not isinstance(question, str) or not question.strip():
        raise InputError(f"{where}: the question ('question' or 'input') is missing or empty")
    answers = _answers(rec, where)
    q = question.strip()
    return Sample(task=task, chunks=chunks, question=f"{q}\n{SHORT_ANSWER}", answers=answers,
                  meta={"task": task, "seed": 0, "index": index, "length": 0, "chunk_tokens": 0, "depth": None,
                        "n_chunks": len(chunks), "raw_question": q, "max_new_tokens": ANSWER_TOKENS,
                        "qa": True})


def load_dataset(spec: str, start: int = 0, stop: int | None = None, *, passages: int | None = None,
                 merge: int = 1, seed: int = 0) -> list[Sample]:
    """Samples ``start`` .. ``stop`` (exclusive; None = to the end) of a dataset file or bundled name. Every
    record of the file is checked, so a bad record fails the run before any model time is spent.
    ``squad`` / ``squad2`` are built from SQuAD's articles (`kvstitch.tasks.squad`: ``passages`` paragraphs a
    question, ``seed`` their draw); ``merge`` > 1 joins every ``merge`` adjacent passages into one chunk.
    (SQuAD over retrieval from the whole dev set: `kvstitch.eval.squad_retrieval`.)"""
    from .squad import FILES as SQUAD, DEFAULT_PASSAGES, load_squad

    if spec in SQUAD:
        return load_squad(spec, DEFAULT_PASSAGES if passages is None else passages, seed, start, stop, merge)
    if passages is not None:
        raise InputError(f"--passages builds the prompts of squad / squad2; {spec!r} brings its own passages")
    if merge < 1:
        raise InputError(f"--merge-passages must be >= 1, got {merge}")
    path = dataset_path(spec)
    task = dataset_name(spec)
    samples = [to_sample(rec, f"dataset {path}, {where}", task, i) for i, (where, rec) in enumerate(_records(path))]
    if not samples:
        raise InputError(f"dataset {path} holds no records")
    if not 0 <= start < len(samples) or (stop is not None and not start < stop):
        raise InputError(f"sample range {start}:{'' if stop is None else stop} is outside the dataset's "
                         f"{len(samples)} records")
    out = samples[start:stop]
    if merge > 1:
        for s in out:
            s.chunks = ["\n\n".join(s.chunks[j:j + merge]) for j in range(0, len(s.chunks), merge)]
            s.task = s.meta["task"] = f"{task}_m{merge}"
            s.meta["n_chunks"] = len(s.chunks)
    return out


def sample_range(samples: str | None, n: int | None) -> tuple[int, int | None]:
    """The records to run: ``--samples START:STOP`` and / or ``--n`` (the first n of that range). Both with a
    STOP that disagrees with n is an error, not a guess."""
    start, stop = parse_range(samples)
    if n is None:
        return start, stop
    if n < 1:
        raise InputError(f"--n must be >= 1, got {n}")
    if stop is not None and stop - start != n:
        raise InputError(f"--samples {samples} is {stop - start} records but --n is {n}: give one of them")
    return start, start + n


def parse_range(text: str | None) -> tuple[int, int | None]:
    """'10:50' -> (10, 50); ':50' -> (0, 50); '10:' -> (10, None); '' / None -> (0, None)."""
    if not text:
        return 0, None
    try:
        a, b = text.split(":")
        return int(a) if a.strip() else 0, int(b) if b.strip() else None
    except ValueError:
        raise InputError(f"--samples takes START:STOP (e.g. 0:50 or 50:), got {text!r}") from None
