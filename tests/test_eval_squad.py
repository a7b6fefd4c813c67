"""SQuAD as multi-passage RAG: the reader (v1.1, v2.0, bad records), passage assembly deterministic per seed,
the official EM / F1, abstentions, the one sample-selection flag, and the eval end to end on a tiny model."""

from __future__ import annotations

import gzip
import json

import pytest

from kvstitch.core.errors import InputError
from kvstitch.eval.runner import EvalConfig, run_eval
from kvstitch.tasks import squad
from kvstitch.tasks.datasets import load_dataset, sample_range
from kvstitch.tasks.grading import squad_correct, squad_em, squad_f1

from .conftest import make_tiny_engine


def _squad_file(tmp_path, paragraphs=5, version="squad2", extra_qas=None):
    """One article of `paragraphs` paragraphs; paragraph i says "Fact i is V{i}." and asks for it."""
    paras = []
    for i in range(paragraphs):
        qas = [{"id": f"q{i}", "question": f"What is fact {i}?", "answers": [{"text": f"V{i}"}, {"text": f"V{i}"}]}]
        if i == 0:
            qas.append({"id": "imp", "question": "What is fact 99?", "answers": []})
        paras.append({"context": f"Fact {i} is V{i}. " + "Filler words here. " * 3, "qas": qas})
    if extra_qas:
        paras[0]["qas"].append(extra_qas)
    path = tmp_path / f"{version}.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"version": "x", "data": [{"title": "A", "paragraphs": paras}]}, f)
    return str(path)


def test_bundled_sets_have_the_official_counts():
    v1 = squad.read_squad("squad")
    v2 = squad.read_squad("squad2")
    assert len(v1.questions) == 10_570 and len(v1.articles) == 48
    assert sum(len(a) for a in v1.articles) == 2_067
    assert len(v2.questions) == 11_873 and sum(not q.answers for q in v2.questions) == 5_945
    assert all(q.answers for q in v1.questions)


def test_samples_hold_the_gold_paragraph_at_its_recorded_position_deterministically():
    a = load_dataset("squad", 100, 110, passages=10, seed=0)
    b = load_dataset("squad", 100, 110, passages=10, seed=0)
    c = load_dataset("squad", 100, 110, passages=10, seed=1)
    v1 = squad.read_squad("squad")
    assert [s.chunks for s in a] == [s.chunks for s in b]
    assert [s.chunks for s in a] != [s.chunks for s in c]  # the seed draws other distractors / order
    for s in a:
        q = v1.questions[s.meta["index"]]
        paras = v1.articles[q.article]
        assert s.task == "squad_p10" and s.meta["qid"] == q.qid and len(s.chunks) == min(10, len(paras))
        assert s.chunks[s.meta["gold_position"]] == paras[q.paragraph]
        assert len(set(s.chunks)) == len(s.chunks) and all(ch in paras for ch in s.chunks)
        assert s.meta["depth"] == pytest.approx(s.meta["gold_position"] / (len(s.chunks) - 1))
        assert s.question.startswith(q.text) and squad.INSTRUCTION in s.question
        assert squad.ABSTAIN_INSTRUCTION not in s.question
    # a sample does not depend on which others are loaded with it
    assert load_dataset("squad", 105, 106, passages=10)[0].chunks == a[5].chunks


def test_an_article_with_fewer_paragraphs_uses_all_and_merge_joins_adjacent_passages(tmp_path):
    path = _squad_file(tmp_path, paragraphs=5)
    s = squad.load_squad("squad2", passages=40, path=path)
    assert all(len(x.chunks) == 5 for x in s)
    m = squad.load_squad("squad2", passages=40, merge=2, path=path)
    assert [len(x.chunks) for x in m] == [3] * len(s) and m[0].task == "squad2_p40_m2"
    assert m[0].chunks[0] == "\n\n".join(s[0].chunks[:2]) and m[0].chunks[2] == s[0].chunks[4]
    assert m[0].meta["n_passages"] == 5 and m[0].meta["gold_position"] == s[0].meta["gold_position"]


def test_v2_has_unanswerable_questions_and_asks_to_abstain(tmp_path):
    samples = squad.load_squad("squad2", passages=3, path=_squad_file(tmp_path))
    imp = [s for s in samples if not s.meta["answerable"]]
    assert len(imp) == 1 and imp[0].answers == [] and squad.ABSTAIN_INSTRUCTION in imp[0].question


@pytest.mark.parametrize("qa, says", [
    ({"id": "x", "question": "", "answers": [{"text": "a"}]}, "non-empty 'question'"),
    ({"id": "x", "question": "Q?", "answers": "a"}, "'answers'"),
    ({"id": "x", "question": "Q?", "answers": [{"txt": "a"}]}, "'answers'"),
])
def test_bad_records_are_named(tmp_path, qa, says):
    with pytest.raises(InputError, match=says):
        squad.read_squad("squad2", _squad_file(tmp_path, extra_qas=qa))


def test_v1_refuses_an_unanswerable_question_and_bad_files_are_errors(tmp_path):
    with pytest.raises(InputError, match="only SQuAD v2.0"):
        squad.read_squad("squad", _squad_file(tmp_path, version="squad"))
    bad = tmp_path / "bad.json"
    bad.write_text("{\"data\": 3}")
    with pytest.raises(InputError, match="SQuAD's shape"):
        squad.read_squad("squad", str(bad))
    with pytest.raises(InputError, match="outside"):
        load_dataset("squad", 20_000, 20_001)
    with pytest.raises(InputError, match="--passages"):
        load_dataset("squad", 0, 1, passages=0)
    with pytest.raises(InputError, match="--passages builds"):
        load_dataset("musique", 0, 1, passages=10)


def test_official_em_f1_on_fixed_examples():
    # SQuAD's evaluate-v2.0.py: normalise (case, punctuation, articles, spaces), token F1, max over the golds
    assert squad_em("The Denver Broncos.", ["Denver Broncos", "Broncos"]) == 1.0
    assert squad_em("Denver", ["Denver Broncos"]) == 0.0
    assert squad_f1("Denver", ["Denver Broncos"]) == pytest.approx(2 / 3)
    assert squad_f1("the Carolina Panthers won", ["Carolina Panthers"]) == pytest.approx(0.8)
    assert squad_f1("Denver Broncos\nbecause they won", ["Denver Broncos"]) == 1.0  # first line only
    # unanswerable: only an abstention scores; an abstention on an answerable question scores 0
    assert squad_f1("unanswerable", []) == 1.0 and squad_em("The passages do not mention it.", []) == 1.0
    assert squad_f1("1979", []) == 0.0 and squad_em("Unanswerable", ["1979"]) == 0.0
    assert squad_correct("It was in 1979.", ["1979"]) and not squad_correct("unanswerable", ["1979"])
    assert squad_correct("Not mentioned in the passages", []) and not squad_correct("1979", [])


@pytest.mark.parametrize("text, abstains", [
    ("unanswerable", True), ("The passages do not mention this.", True), ("Not provided", True),
    ("Unknown", True), ("No answer", True), ("1979", False), ("Cannot be determined.", True),
    ("He did not know the answer", False), ("Knowledge", False)])
def test_abstention_is_read_off_the_first_line(text, abstains):
    assert squad.abstains(text) is abstains
    assert squad.abstains("1979\nunanswerable") is False


def test_one_flag_selects_samples_of_every_dataset():
    assert sample_range("", None) == (0, None) and sample_range("", 5) == (0, 5)
    assert sample_range("100:", 50) == (100, 150) and sample_range("100:150", 50) == (100, 150)
    with pytest.raises(InputError, match="give one"):
        sample_range("100:120", 50)
    with pytest.raises(InputError, match="--n"):
        sample_range("", 0)


def test_eval_on_squad2_records_gold_position_abstention_and_official_scores(smollm_tokenizer, tmp_path,
                                                                             monkeypatch):
    path = _squad_file(tmp_path, paragraphs=3)
    real = squad.read_squad
    monkeypatch.setattr(squad, "read_squad", lambda version, p=None: real(version, path))
    engine = make_tiny_engine("llama", smollm_tokenizer)
    cfg = EvalConfig(tasks=[], lengths=[], methods=["random"], ratios=[0.5], max_new_tokens=4, dataset="squad2",
                     passages=3, samples=(0, 2), overlap=False)
    rows = run_eval(engine, cfg, tmp_path / "out", progress=False)
    assert len(rows) == 2 * 3
    for r in rows:
        assert r["task"] == "squad2_p3" and 0 <= r["gold_position"] < 3 and isinstance(r["abstained"], bool)
        assert isinstance(r["answerable"], bool) and r["em"] in (0.0, 1.0) and 0.0 <= r["score"] <= 1.0
    assert cfg.protocol()["dataset"] == {"name": "squad2", "instruction": squad.INSTRUCTION + squad.ABSTAIN_INSTRUCTION,
                                         "split_seed": squad.SPLIT_SEED, "passages": 3, "merge": 1}


def _row(i, method, ratio, correct, pred, answerable=True, abstained=False, depth=0.5):
    return {"task": "squad2_p10", "seed": 0, "index": i, "length": 0, "chunk_tokens": 0, "method": method,
            "ratio": ratio, "correct": correct, "pred": pred, "answerable": answerable, "abstained": abstained,
            "score": float(correct), "em": float(correct), "depth": depth, "ttft_s": 1.0, "ttft_full_s": 4.0,
            "select_s": 0.25 if method == "deltaprop" else None}


def test_answers_kept_abstentions_and_paired_tables_count_what_they_say(tmp_path):
    from kvstitch.eval.qa_report import abstention_table, answers_table, paired_kept_table, squad_sections

    rows = []
    for i in range(4):  # full right on 0..2, wrong on 3; deltaprop keeps 0, 1; "b" keeps 0 only
        rows.append(_row(i, "full", None, i < 3, f"Answer {i}"))
        rows.append(_row(i, "deltaprop", 0.2, i < 2, f"answer {i}." if i < 2 else "other"))
        rows.append(_row(i, "b", 0.2, i < 1, f"Answer {i}" if i < 1 else "other"))
    for i in range(4, 8):  # unanswerable: full abstains on 4..6; deltaprop invents on 4
        rows.append(_row(i, "full", None, i < 7, "unanswerable", answerable=False, abstained=i < 7))
        rows.append(_row(i, "deltaprop", 0.2, i > 4, "x" if i == 4 else "unanswerable", answerable=False,
                         abstained=i > 4))
    t = answers_table(rows)
    a_line = next(l for l in t.splitlines() if l.startswith("| deltaprop |"))
    assert "| 4 | 3 | 0.67 [" in a_line and "| 0.50 [" in a_line  # kept 2 of 3; same answer on 0, 1 of 4
    assert "| 400% |" not in a_line and a_line.endswith("| 4.00 | 0.250 |")  # speed-up, then selection seconds
    ab = abstention_table(rows)
    a_ab = next(l for l in ab.splitlines() if l.startswith("| deltaprop |"))
    assert "| 4 | 3 | 0.667" in a_ab and "| 0.333" in a_ab
    pk = paired_kept_table(rows)
    assert "| 0.20 | deltaprop | b | 3 | 0.67 | 0.33 | 0.33" in pk and "| b | deltaprop |" not in pk
    parts, plots = squad_sections(rows, tmp_path, "squad2_p10")
    assert plots["kept_by_position_squad2_p10"].is_file() and plots["kept_vs_speedup_squad2_p10"].is_file()


def test_the_auto_bound_pays_each_question_its_cheapest_agreeing_ratio_or_full_prefill():
    """Full prefill costs 10 s; the 10% row 1 s, the 20% row 2 s. Question 0 agrees at 10%, question 1 only at
    20%, question 2 at neither: clairvoyant 1 + 2 + 10 s, cascade 1 + (1 + 2) + (1 + 2 + 10) s."""
    from kvstitch.eval.qa_report import auto_bound_table

    rows = []
    for i, agree_at in enumerate([0.1, 0.2, None]):
        rows.append(dict(_row(i, "full", None, True, f"Answer {i}"), ttft_s=10.0))
        for ratio, t in ((0.1, 1.0), (0.2, 2.0)):
            same = agree_at is not None and ratio >= agree_at
            rows.append(dict(_row(i, "deltaprop", ratio, same, f"Answer {i}" if same else "other"), ttft_s=t))
    line = next(l for l in auto_bound_table(rows).splitlines() if l.startswith("| deltaprop |"))
    assert line.startswith("| deltaprop | 0.10, 0.20 | 3 | 0.33 [")
    assert line.endswith(f"| {30 / 13:.2f} | {30 / 17:.2f} |")
    assert auto_bound_table([r for r in rows if r["ratio"] != 0.2]) == ""  # one ratio: nothing to adapt over


def test_the_kept_pareto_counts_only_the_questions_full_prefill_gets_right(monkeypatch, tmp_path):
    from kvstitch.eval import plots

    seen = {}
    real = plots.ratio_of_means
    monkeypatch.setattr(plots, "mean_of", lambda xs: seen.setdefault("y", list(xs)) and 0.5)
    monkeypatch.setattr(plots, "ratio_of_means", lambda a, b: real(a, b))
    rows = [_row(i, "full", None, i < 2, "a") for i in range(4)]
    rows += [_row(i, "deltaprop", 0.2, i in (0, 3), "a") for i in range(4)]  # right on 0 (full right) and 3 (not)
    plots.plot_pareto(rows, tmp_path / "k.png", y="kept")
    assert seen["y"] == [1.0, 0.0]  # questions 0 and 1 only: kept on 0, lost on 1
    with pytest.raises(ValueError):
        plots.plot_pareto(rows, tmp_path / "k.png", y="score")
