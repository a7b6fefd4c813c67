"""`kvstitch eval-compare`: two eval runs of the same samples side by side (the README's int8 table)."""

from __future__ import annotations

import json
import math

import pytest
from typer.testing import CliRunner

from kvstitch.core.errors import InputError
from kvstitch.eval.compare import compare_runs, compare_table, write_comparison
from kvstitch.eval.rows import append_jsonl


def _row(index, method, ratio, score, nll, nll_full, kl, pred, task="niah_multikey"):
    return {"task": task, "seed": 0, "index": index, "length": 2048, "chunk_tokens": 256, "method": method,
            "ratio": ratio, "score": score, "nll": nll, "nll_full": nll_full, "kl": kl, "pred": pred}


def _runs():
    base, other = [], []
    for i, (full, naive) in enumerate([(1.0, 3.0), (2.0, 3.0)]):
        base += [_row(i, "full", None, 1.0, full, full, 0.0, f"a{i}"),
                 _row(i, "naive", None, 0.0, naive, full, 0.5, f"n{i}"),
                 _row(i, "prophet", 0.2, 1.0, full + 0.5, full, 0.1, f"p{i}")]
        # the other run: the same full row; naive and prophet a little worse; prophet's answer differs on i=1
        other += [_row(i, "full", None, 1.0, full, full, 0.0, f"a{i}"),
                  _row(i, "naive", None, 0.0, naive + 0.3, full, 0.6, f"n{i}"),
                  _row(i, "prophet", 0.2, float(i == 0), full + 0.8, full, 0.2, "p0" if i == 0 else "other")]
    other.append(_row(7, "prophet", 0.2, 1.0, 0.0, 0.0, 0.0, "x"))  # a sample the base run lacks: ignored
    return base, other


def test_compare_runs_definitions():
    base, other = _runs()
    rows = {(r["method"], r["ratio"]): r for r in compare_runs(base, other)}
    assert list(rows) == [("full", None), ("naive", None), ("prophet", 0.2)]  # the summary's method order
    p = rows[("prophet", 0.2)]
    assert p["n"] == 2
    assert p["score_base"] == 100.0 and p["score_other"] == 50.0
    gap = (3.0 - 1.0) + (3.0 - 2.0)
    assert math.isclose(p["nll_rec_base"], ((3.0 - 1.5) + (3.0 - 2.5)) / gap)
    # the other run's recovery is measured against the BASE run's naive/full gap
    assert math.isclose(p["nll_rec_other"], ((3.0 - 1.8) + (3.0 - 2.8)) / gap)
    assert math.isclose(rows[("naive", None)]["nll_rec_other"], -0.6 / gap)
    assert math.isclose(p["kl_base"], 0.1) and math.isclose(p["kl_other"], 0.2)
    assert p["same_answer"] == 0.5 and rows[("full", None)]["same_answer"] == 1.0
    # identical rows: the full rows are; prophet's NLL moved by 0.3 (same answer text on i=0 is not enough)
    assert rows[("full", None)]["identical"] == 1.0 and rows[("full", None)]["max_dnll"] == 0.0
    assert p["identical"] == 0.0 and math.isclose(p["max_dnll"], 0.3)
    table = compare_table(list(rows.values()), "fp16", "int8")
    assert "| prophet | 0.2 | 2 | 100.0 | 50.0 | 0.67 | 0.47 | 0.100 | 0.200 | 50% | 0% | 3.0e-01 |" in table
    assert table.splitlines()[0].startswith("| method | r | n | score fp16 | score int8 |")


def test_qa_runs_of_two_models_compare_answers_kept_against_each_runs_own_full_prefill():
    """Two models on the same questions: each run's kept share counts the questions *its* full prefill got right."""
    def qa(index, method, ratio, correct, pred):
        return dict(_row(index, method, ratio, float(correct), 1.0, 1.0, 0.0, pred, task="squad_p10"), correct=correct)

    small = [qa(0, "full", None, True, "Paris"), qa(1, "full", None, False, "Lyon"), qa(2, "full", None, True, "1905"),
             qa(0, "prophet", 0.1, False, "Rome"), qa(1, "prophet", 0.1, False, "Lyon"), qa(2, "prophet", 0.1, True, "1905")]
    large = [qa(0, "full", None, True, "Paris"), qa(1, "full", None, True, "Nice"), qa(2, "full", None, True, "1905"),
             qa(0, "prophet", 0.1, True, "Paris"), qa(1, "prophet", 0.1, True, "Nice"), qa(2, "prophet", 0.1, False, "1906")]
    rows = {(r["method"], r["ratio"]): r for r in compare_runs(small, large)}
    p = rows[("prophet", 0.1)]
    assert (p["right_base"], p["right_other"]) == (2, 3)
    assert math.isclose(p["kept_base"], 0.5) and math.isclose(p["kept_other"], 2 / 3)
    assert math.isclose(p["agree_base"], 2 / 3) and math.isclose(p["agree_other"], 2 / 3)  # "Lyon" = full's wrong one
    assert math.isnan(p["nll_rec_own_base"])  # every NLL is 1.0 here: no gap
    # each run's recovery against its own naive-full gap: (3 - 2) / (3 - 1) and (1.5 - 0.75) / (1.5 - 0.5)
    nll = {("small", "full"): 1.0, ("small", "naive"): 3.0, ("small", "prophet"): 2.0,
           ("large", "full"): 0.5, ("large", "naive"): 1.5, ("large", "prophet"): 0.75}
    small2 = small + [qa(i, "naive", None, False, "x") for i in range(3)]
    large2 = large + [qa(i, "naive", None, False, "x") for i in range(3)]
    for run, rs in (("small", small2), ("large", large2)):
        for r in rs:
            r["nll"] = nll[(run, r["method"])]
    own = {(r["method"], r["ratio"]): r for r in compare_runs(small2, large2)}[("prophet", 0.1)]
    assert math.isclose(own["nll_rec_own_base"], 0.5) and math.isclose(own["nll_rec_own_other"], 0.75)
    lo, hi = p["kept_other_ci"]
    assert 0.0 <= lo <= 2 / 3 <= hi <= 1.0  # a bootstrap interval around the kept share
    table = compare_table(list(rows.values()), "0.5B", "1.5B")
    line = next(x for x in table.splitlines() if x.startswith("| prophet | 0.1 | 3 | 2 | 0.50 ["))
    assert "| 0.67 | 0.67 | " in line and "| – | – | 0.33 | 0.67 | 0.33 [" in line  # no TTFT recorded: no speed-up
    # correct over all 3 questions, whatever full prefill said: 1 of 3 against 2 of 3; paired per question +1, +1, -1
    assert math.isclose(p["correct_base"], 1 / 3) and math.isclose(p["correct_other"], 2 / 3)
    assert math.isclose(p["correct_diff"], 1 / 3)
    lo, hi = p["correct_diff_ci"]
    assert -1.0 <= lo < 1 / 3 < hi <= 1.0
    assert "identical rows" in table  # by default both tables
    assert "identical rows" not in compare_table(list(rows.values()), "0.5B", "1.5B", same_model=False)
    # each run's TTFT speed-up over its own full prefill: the median over samples of full TTFT / method TTFT
    for rs, full_s in ((small, 2.0), (large, 6.0)):
        for r in rs:
            r.update(ttft_full_s=full_s, ttft_s=full_s if r["method"] == "full" else full_s / (2 + r["index"]))
    timed = {(r["method"], r["ratio"]): r for r in compare_runs(small, large)}[("prophet", 0.1)]
    assert math.isclose(timed["speedup_base"], 3.0)  # samples 2x, 3x, 4x
    assert math.isclose(timed["speedup_other"], timed["speedup_base"])
    base, other = _runs()
    assert "kept" not in compare_table(compare_runs(base, other))  # no QA rows: no such table


def test_identical_rows_tolerate_float_rounding_only():
    base, _ = _runs()
    other = [dict(r, nll=r["nll"] + 1e-8) for r in base]  # summation-order noise: still identical
    assert all(r["identical"] == 1.0 for r in compare_runs(base, other))
    base = [dict(r, recomputed=4) for r in base]
    other = [dict(r, recomputed=5) if r["method"] == "prophet" else r for r in base]  # another selection size
    assert {(r["method"], r["identical"]) for r in compare_runs(base, other)} >= {("prophet", 0.0), ("full", 1.0)}


def test_eval_compare_command(tmp_path):
    from kvstitch.cli.main import app

    base, other = _runs()
    for name, rows in (("a", base), ("b", other)):
        (tmp_path / name).mkdir()
        for r in rows:
            append_jsonl(tmp_path / name / "results.jsonl", r)
    r = CliRunner().invoke(app, ["eval-compare", str(tmp_path / "a"), str(tmp_path / "b" / "results.jsonl"),
                                 "--out", str(tmp_path / "o"), "--base-label", "fp16", "--other-label", "int8"])
    assert r.exit_code == 0, r.output
    md = (tmp_path / "o" / "compare.md").read_text()
    js = json.loads((tmp_path / "o" / "compare.json").read_text())
    assert md == compare_table(compare_runs(base, other), "fp16", "int8")
    assert [x["method"] for x in js["rows"]] == ["full", "naive", "prophet"]
    assert js["meta"]["command"].startswith("kvstitch eval-compare") and js["meta"]["rows_matched"] == 6
    bad = CliRunner().invoke(app, ["eval-compare", str(tmp_path / "nope"), str(tmp_path / "b"),
                                   "--out", str(tmp_path / "o")])
    assert bad.exit_code == 2 and "no results.jsonl" in bad.output


def test_compare_refuses_runs_without_common_rows(tmp_path):
    base, _ = _runs()
    other = [dict(r, seed=1) for r in base]
    for name, rows in (("a", base), ("b", other)):
        (tmp_path / name).mkdir()
        for r in rows:
            append_jsonl(tmp_path / name / "results.jsonl", r)
    with pytest.raises(InputError, match="share no"):
        write_comparison(tmp_path / "a", tmp_path / "b", tmp_path / "o")


def test_compare_filters_tasks_and_lengths(tmp_path):
    base, other = _runs()
    extra = [dict(r, task="two_hop", pred="zz") for r in other]  # two_hop: every answer differs
    for name, rows in (("a", base + [dict(r, task="two_hop") for r in base]), ("b", other + extra)):
        (tmp_path / name).mkdir()
        for r in rows:
            append_jsonl(tmp_path / name / "results.jsonl", r)
    _, _, both = write_comparison(tmp_path / "a", tmp_path / "b", tmp_path / "o")
    _, _, one = write_comparison(tmp_path / "a", tmp_path / "b", tmp_path / "o", tasks=["niah_multikey"])
    _, _, none = write_comparison(tmp_path / "a", tmp_path / "b", tmp_path / "o", lengths=[2048])
    assert [r["n"] for r in both] == [4, 4, 4] and [r["n"] for r in one] == [2, 2, 2]
    assert one[0]["same_answer"] == 1.0 and both[0]["same_answer"] == 0.5
    assert [r["n"] for r in none] == [4, 4, 4]
    with pytest.raises(InputError, match="share no"):
        write_comparison(tmp_path / "a", tmp_path / "b", tmp_path / "o", lengths=[4096])


def test_runs_of_two_models_get_only_the_answers_kept_table(tmp_path):
    """run.json names each run's weights: two different models are not matched row by row."""
    def qa(index, method, correct):
        return dict(_row(index, method, None if method == "full" else 0.1, float(correct), 1.0, 1.0, 0.0, "x",
                         task="squad_p10"), correct=correct)

    rows = [qa(i, m, c) for i in range(3) for m, c in (("full", True), ("prophet", i != 0))]
    for name, fingerprint in (("a", "small"), ("b", "large"), ("c", "small")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "run.json").write_text(json.dumps({"model": {"fingerprint": fingerprint}}))
        for r in rows:
            append_jsonl(tmp_path / name / "results.jsonl", r)
    md, js, _ = write_comparison(tmp_path / "a", tmp_path / "b", tmp_path / "o")
    assert "kept" in md.read_text() and "identical rows" not in md.read_text()
    assert json.loads(js.read_text())["meta"]["same_model"] is False
    md, js, _ = write_comparison(tmp_path / "a", tmp_path / "c", tmp_path / "o")
    assert "identical rows" in md.read_text() and json.loads(js.read_text())["meta"]["same_model"] is True


def test_across_tasks_matches_the_same_samples_prompted_two_ways(tmp_path):
    """--merge-passages renames the task (squad_p40 -> squad_p40_m4), --retrieve with another --chunk-tokens also
    changes the rows' chunk size: --across-tasks pairs their samples anyway."""
    base, other = _runs()
    for name, rows, task, size in (("a", base, "squad_p40", 256), ("b", other, "squad_p40_m4", 128)):
        (tmp_path / name).mkdir()
        for r in rows:
            append_jsonl(tmp_path / name / "results.jsonl", dict(r, task=task, chunk_tokens=size))
    with pytest.raises(InputError, match="share no"):
        write_comparison(tmp_path / "a", tmp_path / "b", tmp_path / "o")
    _, _, rows = write_comparison(tmp_path / "a", tmp_path / "b", tmp_path / "o", across_tasks=True)
    assert rows == compare_runs(base, other)  # as if the tasks had one name
    append_jsonl(tmp_path / "b" / "results.jsonl", dict(other[0], task="squad_p10"))
    with pytest.raises(InputError, match="one task per run"):
        write_comparison(tmp_path / "a", tmp_path / "b", tmp_path / "o", across_tasks=True)


def test_intervals_do_not_depend_on_the_process_hash_seed(tmp_path):
    """The bootstrap resamples rows by position: their order must be the runs', not a set's (which changes with
    PYTHONHASHSEED from one process to the next)."""
    import os
    import random
    import subprocess
    import sys

    rng = random.Random(0)
    path = tmp_path / "results.jsonl"
    for i in range(40):
        right = rng.random() < 0.6
        append_jsonl(path, dict(_row(i, "full", None, 1.0, 1.0, 1.0, 0.0, "a", task="squad_p10"), correct=True))
        append_jsonl(path, dict(_row(i, "prophet", 0.2, float(right), 1.0, 1.0, 0.0, "p", task="squad_p10"),
                                correct=right))
    code = ("import sys; from kvstitch.eval.compare import compare_runs; from kvstitch.eval.rows import read_jsonl; "
            "rows = read_jsonl(sys.argv[1]); print([r['kept_base_ci'] for r in compare_runs(rows, rows)])")
    out = [subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, check=True,
                          env={**os.environ, "PYTHONHASHSEED": seed}).stdout for seed in ("1", "3")]
    assert out[0] == out[1] and "0.625" in out[0]
