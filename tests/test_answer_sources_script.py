"""scripts/answer_sources.py: where the stitched answers full prefill gets right, and the stitched one not, come
from (the gold passage, another one, none)."""

from __future__ import annotations

import gzip
import json

from tests.scripts_loader import load_script

PASSAGES = ["The castle was built in 1066 by the Normans.", "The bridge opened in 1932 after six years of work.",
            "The river floods every spring."]


def _load():
    return load_script("answer_sources")


def test_an_answer_comes_from_the_passage_holding_most_of_its_opening_words():
    mod = _load()
    assert mod.answer_source("The castle was built by the Saxons.", PASSAGES, 0) == "gold"
    assert mod.answer_source("The bridge opened in 1932", PASSAGES, 0) == "other"
    assert mod.answer_source("Nobody knows.", PASSAGES, 0) == "none"
    assert mod.answer_source("The", PASSAGES, 0) == "none"  # one word is too little to place it
    assert mod.answer_source("", PASSAGES, 0) == "none"


def _row(index, method, ratio, correct, pred=""):
    return {"task": "squad_p3", "seed": 0, "index": index, "method": method, "ratio": ratio, "correct": correct,
            "pred": pred}


def test_only_questions_full_prefill_gets_right_count_and_runs_compare_on_shared_questions(tmp_path, capsys):
    mod = _load()
    rows = [_row(0, "full", None, True), _row(0, "naive", None, False, "The bridge opened in 1932"),
            _row(0, "x", 0.1, True),
            _row(1, "full", None, True), _row(1, "naive", None, False, "The castle was built in 1100"),
            _row(1, "x", 0.1, False, "Nobody knows"),
            _row(2, "full", None, False), _row(2, "naive", None, False, "The river floods")]
    counts = mod.tally(rows, lambda r: (PASSAGES, 0))
    assert counts[("naive", None)] == {"other": 1, "gold": 1}
    assert counts[("x", 0.1)] == {"kept": 1, "none": 1}
    assert "| naive | – | 2 | 0 | 1 | 1 | 0 |" in mod.table(counts)
    # two runs, one of them over a question the other lacks: that question is left out of both
    for name, keep in (("a", {0, 1}), ("b", {0})):
        (tmp_path / name).mkdir()
        data = "".join(json.dumps(r) + "\n" for r in rows if r["index"] in keep)
        (tmp_path / name / "results.jsonl.gz").write_bytes(gzip.compress(data.encode()))
    mod._squad_passages = lambda: (lambda r: (PASSAGES, 0))
    mod.main([str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "t.md")])
    text = (tmp_path / "t.md").read_text()
    assert text.startswith("Written by `python scripts/answer_sources.py")
    assert text.count("| naive | – | 1 | 0 | 0 | 1 | 0 |") == 2
