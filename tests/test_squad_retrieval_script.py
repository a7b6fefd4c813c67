"""scripts/squad_retrieval.py: answer recall of MiniLM retrieval over SQuAD articles at several chunk sizes."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "squad_retrieval.py"


def _load():
    spec = importlib.util.spec_from_file_location("squad_retrieval", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_an_answer_counts_as_whole_normalised_words():
    answer_in = _load().answer_in
    assert answer_in("It was built in 1889, for the fair.", ["1889"])
    assert answer_in("THE Eiffel tower", ["eiffel Tower"])  # case, articles
    assert not answer_in("It was built in 18890.", ["1889"])  # not inside a longer word
    assert not answer_in("anything", ["", "the"])  # an answer that normalises to nothing never matches


def test_recall_per_chunk_size_and_budget(tmp_path):
    """Two articles as the collection: recall in [0, 1], never lower with a larger budget (the retrieved chunks at a
    larger budget include those at a smaller one), and a budget holding the whole collection finds almost every
    answer (SQuAD's answers are spans of its paragraphs; the few that are fragments of a word are not whole words)."""
    out = tmp_path / "r"
    assert _load().main(["--samples", "0:10570", "--chunk-tokens", "64,256", "--budgets", "128,512,100000",
                         "--model", "smollm2", "--max-articles", "2", "--out", str(out)]) == 0
    rows = json.loads((out / "retrieval.json").read_text())["rows"]
    assert [(r["chunk_tokens"], r["budget"]) for r in rows] == [(64, 128), (64, 512), (64, 100000),
                                                                 (256, 128), (256, 512), (256, 100000)]
    for size in (64, 256):
        recall = [r["answer_recall"] for r in rows if r["chunk_tokens"] == size]
        assert 0.0 <= recall[0] <= recall[1] <= recall[2] and recall[2] >= 0.98
    assert rows[0]["chunks"] > rows[3]["chunks"] and rows[0]["n"] > 100  # smaller chunks: more of them
    assert "| 256 |" in (out / "retrieval.md").read_text()
