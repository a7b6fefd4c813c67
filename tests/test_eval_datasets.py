"""Real QA datasets: both record shapes, the bundled MuSiQue file, bad records named, the eval end to end."""

from __future__ import annotations

import gzip
import json

import pytest

from kvstitch.core.errors import InputError
from kvstitch.tasks.datasets import (SHORT_ANSWER, load_dataset, parse_range, split_passages, to_sample)
from kvstitch.eval.rows import read_jsonl
from kvstitch.eval.runner import RESULTS, EvalConfig, run_eval

from .conftest import make_tiny_engine

CTXS_RECORD = {"question": "Who built the tower?", "answers": ["Tomas Reyne", "Reyne"],
               "ctxs": [{"title": "Reyne Tower", "text": "The tower was built by Tomas Reyne."},
                        {"title": "", "text": "Alder Bay is a town by the sea."}]}
LONGBENCH_RECORD = {"input": "Who built the tower?", "answers": ["Tomas Reyne"],
                    "context": "Passage 1:\nReyne Tower\nThe tower was built by Tomas Reyne.\n"
                               "Passage 2:\nAlder Bay\nAlder Bay is a town by the sea."}


def test_common_shape_one_chunk_per_passage_with_title_and_instruction():
    s = to_sample(CTXS_RECORD, "record 0", "mine", 0)
    assert s.chunks == ["Reyne Tower\nThe tower was built by Tomas Reyne.", "Alder Bay is a town by the sea."]
    assert s.question == f"Who built the tower?\n{SHORT_ANSWER}"
    assert s.answers == ["Tomas Reyne", "Reyne"]
    assert s.meta["qa"] and s.meta["index"] == 0 and s.meta["length"] == 0


def test_longbench_shape_splits_at_passage_markers_or_blank_lines():
    s = to_sample(LONGBENCH_RECORD, "record 0", "lb", 3)
    assert s.chunks == ["Reyne Tower\nThe tower was built by Tomas Reyne.", "Alder Bay\nAlder Bay is a town by the sea."]
    assert s.meta["raw_question"] == "Who built the tower?" and s.meta["index"] == 3
    assert split_passages("one para\n\n  \ntwo para\n\nthree") == ["one para", "two para", "three"]
    # a single answer string is accepted under "answer"
    assert to_sample({**CTXS_RECORD, "answers": None, "answer": "Reyne"}, "r", "t", 0).answers == ["Reyne"]


@pytest.mark.parametrize("record, says", [
    ({"question": "Q?", "ctxs": [{"text": "x"}]}, "'answers'"),
    ({"question": "Q?", "answers": [], "ctxs": [{"text": "x"}]}, "'answers'"),
    ({"question": "", "answers": ["a"], "ctxs": [{"text": "x"}]}, "question"),
    ({"question": "Q?", "answers": ["a"], "ctxs": []}, "'ctxs'"),
    ({"question": "Q?", "answers": ["a"], "ctxs": [{"title": "t"}]}, "passage 0"),
    ({"question": "Q?", "answers": ["a"], "ctxs": [{"text": "x", "title": 3}]}, "'title'"),
    ({"input": "Q?", "answers": ["a"], "context": ""}, "'context'"),
    ({"query": "Q?", "docs": []}, "neither"),
    (["not", "an", "object"], "JSON object"),
])
def test_bad_records_are_named(tmp_path, record, says):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps([CTXS_RECORD, record]))
    with pytest.raises(InputError) as e:
        load_dataset(str(path))
    assert "record 1" in str(e.value) and says in str(e.value) and str(path) in str(e.value)


def test_jsonl_gzip_and_line_numbers(tmp_path):
    path = tmp_path / "qa.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.write(json.dumps(CTXS_RECORD) + "\n\n" + json.dumps(LONGBENCH_RECORD) + "\n")
    samples = load_dataset(str(path))
    assert [s.task for s in samples] == ["qa", "qa"] and [s.meta["index"] for s in samples] == [0, 1]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(CTXS_RECORD) + "\n{not json\n")
    with pytest.raises(InputError, match="line 2"):
        load_dataset(str(bad))
    with pytest.raises(InputError, match="neither a file"):
        load_dataset(str(tmp_path / "missing.json"))
    (tmp_path / "empty.json").write_text("")
    with pytest.raises(InputError, match="empty"):
        load_dataset(str(tmp_path / "empty.json"))


def test_bundled_musique_and_ranges():
    samples = load_dataset("musique")
    assert len(samples) == 150 and all(len(s.chunks) == 10 for s in samples)
    assert samples[0].meta["raw_question"] == "Where was the author of Hannibal and Scipio educated at?"
    assert samples[0].answers == ["Exeter College"]
    part = load_dataset("musique", 50, 53)
    assert [s.meta["index"] for s in part] == [50, 51, 52]
    assert parse_range("50:") == (50, None) and parse_range(":50") == (0, 50) and parse_range("") == (0, None)
    with pytest.raises(InputError):
        parse_range("5-9")
    with pytest.raises(InputError, match="outside"):
        load_dataset("musique", 200, 210)


def test_eval_on_a_dataset_scores_f1_em_and_correctness(smollm_tokenizer, tmp_path):
    engine = make_tiny_engine("llama", smollm_tokenizer)
    path = tmp_path / "mini.json"
    path.write_text(json.dumps([CTXS_RECORD, LONGBENCH_RECORD]))
    cfg = EvalConfig(tasks=[], lengths=[], methods=["random"], ratios=[0.5], max_new_tokens=4,
                     dataset=str(path), overlap=False)
    rows = run_eval(engine, cfg, tmp_path / "out", progress=False)
    assert len(rows) == 2 * 3  # full, naive, random@0.5 per record
    for r in rows:
        assert r["task"] == "mini" and 0.0 <= r["score"] <= 1.0 and r["em"] in (0.0, 1.0)
        assert isinstance(r["correct"], bool) and r["n_chunks"] == 2
    assert cfg.protocol()["dataset"]["name"] == "mini"
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "real passages" in summary and "correct answers kept" in summary
    # resumable: nothing left to do, the log unchanged
    again = run_eval(engine, cfg, tmp_path / "out", progress=False)
    assert len(again) == 6 and len(read_jsonl(tmp_path / "out" / RESULTS)) == 6
