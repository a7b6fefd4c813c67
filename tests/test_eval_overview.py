"""`kvstitch eval-overview`: one table over runs of several datasets, the own method against its best rival."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from kvstitch.eval.overview import overview
from kvstitch.eval.rows import append_jsonl

OWN = "deltaprop(base=infoflow)"


def _row(i, method, ratio, correct, ttft=1.0, agree=None, task="niah_multikey"):
    return {"task": task, "seed": 0, "index": i, "length": 8192, "chunk_tokens": 256, "method": method,
            "ratio": ratio, "correct": correct, "score": float(correct), "ttft_s": ttft, "ttft_full_s": 10.0,
            "agree_words": correct if agree is None else agree, "select_s": 0.1}


def _dataset(n=20, own_keeps=16, prophet_keeps=12, infoflow_keeps=10, own_ttft=2.0, low_keeps=14):
    """Full prefill right on every sample but the last; each method keeps its first `*_keeps` of those."""
    rows = []
    for i in range(n):
        right = i < n - 1
        rows.append(_row(i, "full", None, right, ttft=10.0))
        rows.append(_row(i, "naive", None, False, ttft=0.5))
        for ratio, keeps in ((0.2, own_keeps), (0.1, low_keeps)):
            rows.append(_row(i, OWN, ratio, right and i < keeps, ttft=own_ttft))
        rows.append(_row(i, "prophet", 0.2, right and i < prophet_keeps, ttft=2.0))
        rows.append(_row(i, "infoflow", 0.2, right and i < infoflow_keeps, ttft=2.0))
        rows.append(_row(i, "epic", 0.2, right and i < low_keeps + 1, ttft=2.0))
    return rows


def test_the_rival_is_the_one_keeping_most_and_ahead_needs_margin_interval_and_speed():
    figs = overview({"a": _dataset(), "slow": _dataset(own_ttft=2.5), "close": _dataset(own_keeps=12)}, OWN,
                    ["prophet", "infoflow"])
    stats = {(m["method"], m["ratio"]): m for m in figs["a"]["methods"]}
    assert stats[(OWN, 0.2)]["full_right"] == 19 and stats[(OWN, 0.2)]["kept"] == pytest.approx(16 / 19)
    assert stats[(OWN, 0.2)]["speedup"] == pytest.approx(5.0) and stats[("naive", None)]["kept"] == 0.0
    assert stats[("prophet", 0.2)]["score_pct_of_full"] == pytest.approx(100 * 12 / 19)
    ahead = {name: next(t for t in f["targets"] if t["kind"] == "ahead") for name, f in figs.items()}
    assert ahead["a"]["rival"] == "prophet" and ahead["a"]["diff"] == pytest.approx(4 / 19)
    assert ahead["a"]["diff_ci"][0] > 0 and ahead["a"]["met"]
    assert ahead["slow"]["speed_ratio"] == pytest.approx(0.8) and not ahead["slow"]["met"]  # 4 vs 5x: too slow
    assert not ahead["close"]["met"]  # as many kept as prophet
    low = next(t for t in figs["a"]["targets"] if t["kind"] == "low_vs_high")
    # at 10% (14 kept) against the best other family at 20%: epic (15) beats prophet (12) there
    assert (low["ratio"], low["rival"], low["rival_ratio"]) == (0.1, "epic", 0.2) and not low["met"]


def test_eval_overview_command_writes_table_json_and_one_panel_per_dataset(tmp_path):
    from kvstitch.cli.main import app

    for name, rows in (("squad", _dataset()), ("niah", _dataset(own_keeps=12))):
        for r in rows:
            append_jsonl(tmp_path / name / "results.jsonl", r)
    out = tmp_path / "o"
    r = CliRunner().invoke(app, ["eval-overview", f"squad={tmp_path / 'squad'}", f"niah={tmp_path / 'niah'}",
                                 "--rivals", "prophet,infoflow", "--out", str(out)])
    assert r.exit_code == 0, r.output
    md = (out / "overview.md").read_text()
    assert f"| squad | {OWN} vs prophet at 0.20 | 19 | 0.84 | 0.63 |" in md and "| met |" in md
    assert f"| niah | {OWN} vs prophet at 0.20 |" in md and "| missed |" in md
    js = json.loads((out / "overview.json").read_text())
    assert js["command"].startswith("kvstitch eval-overview squad=") and set(js["datasets"]) == {"squad", "niah"}
    assert (out / "overview.png").stat().st_size > 0
    bad = CliRunner().invoke(app, ["eval-overview", str(tmp_path / "squad"), "--out", str(out)])
    assert bad.exit_code == 2 and "NAME=DIRECTORY" in bad.output
    bad = CliRunner().invoke(app, ["eval-overview", f"squad={tmp_path / 'squad'}", "--rivals", "qcfuse",
                                   "--out", str(out)])
    assert bad.exit_code == 2 and "'qcfuse'" in bad.output
    bad = CliRunner().invoke(app, ["eval-overview", f"squad={tmp_path / 'nope'}", "--out", str(out)])
    assert bad.exit_code == 2 and "no results.jsonl" in bad.output


def test_the_agreement_pareto_reads_agreement_for_every_method(monkeypatch, tmp_path):
    """Each method's point is its agreement with full prefill, not its correctness, for the second method too."""
    from kvstitch.eval import plots

    seen = []
    real = plots.mean_of
    monkeypatch.setattr(plots, "mean_of", lambda xs: seen.append(list(xs)) or real(seen[-1]))
    rows = [_row(i, "full", None, True) for i in range(3)]
    for m in ("prophet", "infoflow"):
        rows += [_row(i, m, 0.2, True, agree=False) for i in range(3)]  # right, but never full prefill's words
    plots.plot_pareto(rows, tmp_path / "p.png")
    assert seen == [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
