"""RULER scorers: known values, case-insensitivity, task -> scorer mapping, end-to-end with generated samples."""

from __future__ import annotations

import math

import pytest

from kvstitch.tasks.grading import (SCORERS, aggregate, score, scorer_for, string_match_all,
                                    string_match_part)
from kvstitch.tasks.tasks import TASKS, generate


def test_string_match_all_is_fraction_of_refs_found():
    assert string_match_all("The numbers are 123 and 456.", ["123", "456", "789", "000"]) == 0.5
    assert string_match_all("nothing here", ["123"]) == 0.0
    assert string_match_all("ABCDE, fghij", ["abcde", "FGHIJ"]) == 1.0


def test_string_match_part_is_any_ref_found():
    assert string_match_part("I think it is Paris", ["London", "paris"]) == 1.0
    assert string_match_part("I think it is Rome", ["London", "Paris"]) == 0.0


def test_empty_refs_are_an_error():
    with pytest.raises(ValueError):
        string_match_all("x", [])
    with pytest.raises(ValueError):
        string_match_part("x", [])


def test_task_to_scorer_mapping_follows_ruler():
    assert set(TASKS) <= set(SCORERS)
    assert scorer_for("two_hop") is string_match_part
    assert scorer_for("qa_1") is string_match_part  # RULER's qa family
    for t in ("niah_multikey", "niah_multivalue", "vt", "cwe", "fwe"):
        assert scorer_for(t) is string_match_all
    assert scorer_for("some_new_task") is string_match_all
    assert score("niah_multivalue", "1111111 and 2222222", ["1111111", "2222222", "3333333", "4444444"]) == 0.5
    assert score("two_hop", "Paris or London", ["London"]) == 1.0


def test_aggregate_is_mean_times_100_skipping_missing():
    assert aggregate([1.0, 0.5, 0.0, 0.5]) == 50.0
    assert aggregate([1.0, None, math.nan]) == 100.0
    assert math.isnan(aggregate([]))


@pytest.mark.parametrize("task", sorted(TASKS))
def test_gold_answers_score_full_marks_and_empty_scores_zero(task):
    s = generate(task, 1, 1024, 256, seed=0)[0]
    assert score(task, " ".join(s.answers), s.answers) == 1.0
    assert score(task, "I don't know.", s.answers) == 0.0


# ---- real QA: LongBench's qa_f1_score / SQuAD normalisation, on fixed examples computed by hand ----------

from kvstitch.tasks.grading import answer_correct, exact_match, normalize_answer, qa_f1  # noqa: E402


def test_normalize_answer_is_longbench_s():
    assert normalize_answer("The  Eiffel-Tower, in Paris!") == "eiffeltower in paris"
    assert normalize_answer("An apple a day") == "apple day"
    assert normalize_answer("theatre") == "theatre"  # articles only as whole words


@pytest.mark.parametrize("pred, refs, f1", [
    ("Exeter College", ["Exeter College"], 1.0),
    ("He studied at Exeter College.", ["Exeter College"], 2 * (2 / 5) * 1.0 / (2 / 5 + 1.0)),  # P 2/5, R 1
    ("the University of Oxford", ["Oxford", "Exeter College"], 2 * (1 / 3) * 1.0 / (1 / 3 + 1.0)),
    ("Paris Paris", ["Paris"], 2 * 0.5 * 1.0 / 1.5),  # bag of words: one match of two predicted
    ("London", ["Exeter College"], 0.0),
    ("Exeter College\nThe author was Thomas Nabbes.", ["Exeter College"], 1.0),  # the first line is scored
    ("", ["Exeter College"], 0.0),
])
def test_qa_f1_matches_longbench_definition(pred, refs, f1):
    assert qa_f1(pred, refs) == pytest.approx(f1)


def test_exact_match_and_correct():
    assert exact_match("The Exeter College.", ["Exeter College"]) == 1.0
    assert exact_match("Exeter College, Oxford", ["Exeter College"]) == 0.0
    assert answer_correct("He studied at Exeter College, Oxford", ["Exeter College"])
    assert not answer_correct("Exeterian College", ["Exeter College"])  # whole words only
    assert not answer_correct("Oxford\nExeter College", ["Exeter College"])  # first line only
    with pytest.raises(ValueError):
        qa_f1("x", [])
