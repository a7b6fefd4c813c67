"""Summary table, plots (PNG files written) and resumable JSON-lines logs."""

from __future__ import annotations

import gzip
import json
import math

import pytest

from kvstitch.eval.rows import append_jsonl, has_jsonl, read_jsonl
from kvstitch.eval.report import (plot_accuracy_vs_ratio, plot_niah_heatmap,
                                  summary_table)

PNG = b"\x89PNG\r\n\x1a\n"


def _rows() -> list[dict]:
    rows = []
    for task in ("niah_multikey", "vt"):
        for length in (1024, 2048):
            for depth in (0.0, 0.5, 1.0):
                rows.append(dict(task=task, method="full", ratio=None, length=length, depth=depth, score=1.0,
                                 kl=0.0, ttft_s=2.0))
                rows.append(dict(task=task, method="naive", ratio=0.0, length=length, depth=depth, score=0.0,
                                 kl=0.4, nll_recovery=0.0, ttft_s=0.1))
                for ratio in (0.1, 0.2):
                    rows.append(dict(task=task, method="prophet", ratio=ratio, length=length, depth=depth,
                                     score=1.0 if depth < 1.0 else 0.0, kl=0.1 / ratio / 10,
                                     nll_recovery=2 * ratio, ttft_s=0.5))
    return rows


def _cells(table: str, task: str, method: str, ratio: str, with_ci: bool = False) -> list[str]:
    """A row's cells; the 95% bootstrap intervals (" [lo, hi]") stripped unless ``with_ci``."""
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[:3] == [task, method, ratio]:
            return cells if with_ci else [c.split(" [")[0] for c in cells]
    raise AssertionError(f"no row {task}/{method}/{ratio} in\n{table}")


def test_summary_table_values():
    table = summary_table(_rows())
    assert table.splitlines()[0].startswith("| task | method | ratio |")
    full = _cells(table, "vt", "full", "–")
    assert full[3:6] == ["6", "100.0", "100.0"]
    naive = _cells(table, "vt", "naive", "0.00")
    assert naive[4:7] == ["0.0", "0.0", "0.4000"]
    prophet = _cells(table, "niah_multikey", "prophet", "0.20")
    assert prophet[4] == "66.7" and prophet[5] == "66.7"  # 2 of 3 depths answered; full scores 100
    assert prophet[6] == "0.0500" and prophet[7] == "0.40" and prophet[8] == "0.500"
    avg = _cells(table, "avg", "prophet", "0.10")
    assert avg[3] == "12" and avg[4] == "66.7"
    # methods are ordered full, naive, then the rest
    methods = [line.split("|")[2].strip() for line in table.splitlines()[2:] if line.split("|")[1].strip() == "vt"]
    assert methods[:2] == ["full", "naive"]


def test_ttft_cells_are_medians():
    """One row of a cell slowed 100x (the process was paused) must not move its TTFT, as it would a mean."""
    rows = _rows()
    slow = next(r for r in rows if r["task"] == "vt" and r["method"] == "prophet" and r["ratio"] == 0.2)
    slow["ttft_s"] = 50.0
    table = summary_table(rows)
    assert _cells(table, "vt", "prophet", "0.20")[8] == "0.500"
    assert _cells(table, "avg", "prophet", "0.20")[8] == "0.500"
    assert _cells(table, "vt", "full", "–")[8] == "2.000"


def test_ttft_speedup_is_the_median_of_per_sample_ratios():
    """One paused sample (100x its others) must not move the speed-up, as it would a ratio of means."""
    from kvstitch.eval.rows import ratio_of_means, ttft_speedup

    rows = [{"ttft_full_s": 4.0, "ttft_s": 1.0}, {"ttft_full_s": 6.0, "ttft_s": 2.0},
            {"ttft_full_s": 10.0, "ttft_s": 2.0}, {"ttft_full_s": 5.0, "ttft_s": None}]
    assert ttft_speedup(rows) == 4.0  # samples 4x, 3x, 5x; the untimed one left out
    rows[0]["ttft_s"] = 100.0
    assert ttft_speedup(rows) == 3.0
    assert ratio_of_means([r["ttft_full_s"] for r in rows[:3]], [r["ttft_s"] for r in rows[:3]]) < 0.2
    assert math.isnan(ttft_speedup([{"ttft_full_s": 1.0}]))


def test_summary_table_without_full_leaves_percent_empty():
    rows = [r for r in _rows() if r["method"] != "full"]
    assert _cells(summary_table(rows), "vt", "naive", "0.00")[5] == "–"


def test_plots_are_written_as_png(tmp_path):
    rows = _rows()
    for fn, name in ((plot_accuracy_vs_ratio, "acc.png"), (plot_niah_heatmap, "sub/heat.png")):
        path = fn(rows, tmp_path / name)
        data = path.read_bytes()
        assert path == tmp_path / name
        assert data[:8] == PNG and len(data) > 5_000


def test_heatmap_needs_depth_rows(tmp_path):
    rows = [dict(r, task="vt") for r in _rows()]  # no niah rows
    with pytest.raises(ValueError):
        plot_niah_heatmap(rows, tmp_path / "h.png")
    assert plot_niah_heatmap(rows, tmp_path / "h.png", tasks=["vt"]).stat().st_size > 0


def test_jsonl_roundtrip_and_missing_file(tmp_path):
    path = tmp_path / "runs" / "r.jsonl"
    assert read_jsonl(path) == []
    rows = [{"task": "vt", "score": 1.0, "kl": math.nan}, {"task": "cwe", "score": 0.5, "ids": (1, 2)}]
    for r in rows:
        append_jsonl(path, r)
    back = read_jsonl(path)
    assert back[1] == {"task": "cwe", "score": 0.5, "ids": [1, 2]}
    assert math.isnan(back[0]["kl"])


def test_jsonl_tolerates_truncated_last_line_and_resumes_cleanly(tmp_path):
    path = tmp_path / "r.jsonl"
    append_jsonl(path, {"i": 0})
    append_jsonl(path, {"i": 1})
    with open(path, "a") as f:
        f.write('{"i": 2, "sco')  # the run was killed mid-write
    assert read_jsonl(path) == [{"i": 0}, {"i": 1}]
    append_jsonl(path, {"i": 2})
    assert read_jsonl(path) == [{"i": 0}, {"i": 1}, {"i": 2}]
    assert all(json.loads(line) for line in path.read_text().splitlines())


def test_jsonl_corruption_in_the_middle_raises(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text('{"i": 0}\n{"i": \n{"i": 2}\n')
    with pytest.raises(ValueError, match=":2:"):
        read_jsonl(path)


def test_jsonl_reads_a_compressed_log_and_rows_appended_beside_it_once(tmp_path):
    """A published run is kept as results.jsonl.gz; a resumed run appends to results.jsonl beside it."""
    path = tmp_path / "results.jsonl"
    assert not has_jsonl(path)
    rows = [{"i": 0, "kl": 0.5}, {"i": 1, "pred": "café"}]
    for r in rows:
        append_jsonl(path, r)
    with open(path, "rb") as f, gzip.open(tmp_path / "results.jsonl.gz", "wb") as g:
        g.write(f.read())
    assert read_jsonl(path) == rows  # a copy left beside its .gz: each row once
    path.unlink()
    assert has_jsonl(path) and read_jsonl(path) == rows
    assert read_jsonl(tmp_path / "results.jsonl.gz") == rows
    append_jsonl(path, {"i": 2})
    assert read_jsonl(path) == [*rows, {"i": 2}]


def test_merge_into_a_compressed_run_keeps_it_compressed(tmp_path):
    from kvstitch.eval.merge import write_run

    with gzip.open(tmp_path / "results.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write('{"i": 0}\n')
    (tmp_path / "results.jsonl").write_text('{"i": 1}\n')
    write_run([{"i": 0}, {"i": 1}, {"i": 2}], {}, tmp_path)
    assert not (tmp_path / "results.jsonl").exists()
    assert read_jsonl(tmp_path / "results.jsonl") == [{"i": 0}, {"i": 1}, {"i": 2}]
    first = (tmp_path / "results.jsonl.gz").read_bytes()
    write_run([{"i": 0}, {"i": 1}, {"i": 2}], {}, tmp_path)
    assert (tmp_path / "results.jsonl.gz").read_bytes() == first  # no timestamp in the archive


def test_eval_report_reads_a_compressed_run(tmp_path):
    from typer.testing import CliRunner

    from kvstitch.cli import app

    run = tmp_path / "run"
    run.mkdir()
    with gzip.open(run / "results.jsonl.gz", "wt", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in _rows())
    res = CliRunner().invoke(app, ["eval-report", str(run), "--out", str(tmp_path / "out")])
    assert res.exit_code == 0, res.output
    assert "prophet" in (tmp_path / "out" / "summary.md").read_text()


def test_bootstrap_intervals():
    import numpy as np

    from kvstitch.eval.rows import bootstrap_mean_ci, bootstrap_ratio_ci, fmt_ci

    x = [0, 1] * 20  # mean 0.5, sd 0.5, n = 40: the normal 95% interval is about 0.5 +- 0.155
    lo, hi = bootstrap_mean_ci([x])
    assert lo < 0.5 < hi and 0.25 < hi - lo < 0.37
    assert bootstrap_mean_ci([x]) == (lo, hi)  # fixed seed: reproducible tables
    lo4, hi4 = bootstrap_mean_ci([x * 4])
    assert hi4 - lo4 < 0.6 * (hi - lo)  # 4x the samples: about half the width
    assert bootstrap_mean_ci([[1.0, 1.0, 1.0]]) == (1.0, 1.0)
    assert all(np.isnan(bootstrap_mean_ci([[0.3]])))  # one value: no interval
    assert all(np.isnan(bootstrap_mean_ci([[None, float("nan")]])))
    # strata: the mean of per-stratum means, each resampled on its own
    lo, hi = bootstrap_mean_ci([[0.0] * 10, [1.0] * 10])
    assert lo == hi == 0.5
    # paired ratio: num = den everywhere gives exactly 1
    assert bootstrap_ratio_ci([([1, 2, 3], [1, 2, 3])]) == (1.0, 1.0)
    lo, hi = bootstrap_ratio_ci([([0, 1] * 10, [1] * 20)])
    assert lo < 0.5 < hi
    assert fmt_ci(0.5, (0.25, 0.75), 1, 100) == "50.0 [25.0, 75.0]" and fmt_ci(0.5, (np.nan, np.nan), 2) == "0.50"


def test_summary_table_has_intervals_on_score_and_fidelity_columns():
    table = summary_table(_rows())
    assert "score [95% CI]" in table and "KL [95% CI]" in table and "NLL rec. [95% CI]" in table
    cells = _cells(table, "niah_multikey", "prophet", "0.20", with_ci=True)
    # scores 1, 1, 0 over depths, twice (two lengths): 66.7 with a wide interval that contains it
    lo, hi = (float(v) for v in cells[4].split(" [")[1].rstrip("]").split(", "))
    assert lo < 66.7 < hi and lo >= 0 and hi <= 100
    assert cells[5].split(" [")[1] == cells[4].split(" [")[1]  # full scores 100 on every sample: % full = score
    assert cells[6] == "0.0500 [0.0500, 0.0500]"  # a constant KL has a zero-width interval
    avg = _cells(table, "avg", "prophet", "0.20", with_ci=True)
    lo_a, hi_a = (float(v) for v in avg[4].split(" [")[1].rstrip("]").split(", "))
    assert hi_a - lo_a < hi - lo  # two tasks: twice the samples


def test_agreement_table_carries_pooled_recovery():
    """The agreement table has each method's pooled NLL-gap recovery beside its agreement and score."""
    from kvstitch.eval.report import agreement_table

    rows = []
    for i in range(4):
        common = dict(task="t", index=i, length=2048, nll_full=1.0, agree_first=True)
        rows.append(dict(common, method="full", ratio=None, score=1.0, nll=1.0, agree_words=True))
        rows.append(dict(common, method="naive", ratio=None, score=0.0, nll=3.0, agree_words=False))
        rows.append(dict(common, method="prophet", ratio=0.2, score=1.0, nll=1.5, agree_words=i < 2))
    table = agreement_table(rows)
    header = [c.strip() for c in table.splitlines()[0].strip("|").split("|")]
    row = next([c.strip() for c in line.strip("|").split("|")] for line in table.splitlines()
               if line.startswith("| prophet"))
    assert row[header.index("NLL rec. (pooled)")].split(" [")[0] == "0.75"  # (3 - 1.5) / (3 - 1)
    assert row[header.index("agrees with full (12 words)")].split(" [")[0] == "0.50"
    assert row[header.index("score (% full)")] == "100.0"


def test_paired_table_differences_and_their_paired_intervals():
    """Two methods on the same samples: later minus earlier, agreement and pooled NLL-gap recovery; the interval is
    paired (a constant per-sample difference has a zero-width interval even where each method's own NLL varies
    widely); auto rows, other ratios and the references are not paired."""
    from kvstitch.eval.report import paired_table

    rows = []
    for i in range(4):
        common = dict(task="t", seed=0, index=i, length=2048, chunk_tokens=256, nll_full=1.0, agree_first=True)
        rows.append(dict(common, method="full", ratio=None, score=1.0, nll=1.0, agree_words=True))
        rows.append(dict(common, method="naive", ratio=None, score=0.0, nll=3.0, agree_words=False))
        a_nll = (1.2, 2.9, 1.6, 2.5)[i]  # prophet's own NLL varies widely over the samples
        rows.append(dict(common, method="prophet", ratio=0.2, score=1.0, nll=a_nll, agree_words=i < 1))
        rows.append(dict(common, method="deltaprop", ratio=0.2, score=1.0, nll=a_nll - 0.5, agree_words=i < 2))
        rows.append(dict(common, method="deltaprop", ratio="auto", score=1.0, nll=1.0, agree_words=True))
        rows.append(dict(common, method="infoflow", ratio=0.1, score=1.0, nll=2.0, agree_words=False))
    table = paired_table(rows)
    lines = [ln for ln in table.splitlines() if ln.startswith("| ") and "−" in ln]
    assert len(lines) == 1, table  # one pair at 0.2; infoflow alone at 0.1; auto and references left out
    cells = [c.strip() for c in lines[0].strip("|").split("|")]
    assert cells[:3] == ["deltaprop − prophet", "0.20", "4"]
    assert cells[3].split(" [")[0] == "0.25"  # agrees on 2 of 4 vs 1 of 4
    assert cells[4] == "0.25 [0.25, 0.25]"  # 0.5 nats better on every sample over a gap of 2: paired, zero width
    assert paired_table([r for r in rows if r["method"] != "deltaprop"]) == ""


def test_the_summary_has_the_paired_section(tmp_path):
    from kvstitch.eval.report import write_reports

    rows = []
    for i in range(3):
        common = dict(task="t", seed=0, index=i, length=2048, chunk_tokens=256, nll_full=1.0, agree_first=True, kl=0.1)
        rows.append(dict(common, method="full", ratio=None, score=1.0, nll=1.0, agree_words=True))
        rows.append(dict(common, method="naive", ratio=None, score=0.0, nll=3.0, agree_words=False))
        rows.append(dict(common, method="prophet", ratio=0.2, score=1.0, nll=2.0, agree_words=False))
        rows.append(dict(common, method="infoflow", ratio=0.2, score=1.0, nll=1.5, agree_words=True))
    text = write_reports(rows, tmp_path)["summary"].read_text()
    assert "paired" in text and "| infoflow − prophet | 0.20 | 3 | 1.00 [1.00, 1.00] | 0.25 [0.25, 0.25] |" in text


def test_auto_table_counts_answered_rounds_and_their_agreement_per_task():
    """`auto` rows per task: a round that settled answered the sample (agreeing with full or not); a row that did
    not settle at ratio_used 1 fell back to full prefill. Fixed-ratio rows are not in it."""
    from kvstitch.eval.report import auto_table

    rows = []
    for i, (task, converged, used, agree) in enumerate([("a", True, 0.1, True), ("a", True, 0.1, False),
                                                        ("a", False, 1.0, True), ("b", False, 1.0, True)]):
        common = dict(task=task, index=i, method="deltaprop", agree_first=True)
        rows.append(dict(common, ratio="auto", converged=converged, ratio_used=used, agree_words=agree))
        rows.append(dict(common, ratio=0.2, agree_words=False))
    lines = auto_table(rows).splitlines()
    assert lines[2:] == ["| a | deltaprop | 3 | 2 | 1 | 1 |", "| b | deltaprop | 1 | 0 | 0 | 1 |"]
    assert auto_table([r for r in rows if r["ratio"] != "auto"]) == ""


def test_summary_names_the_machines_when_a_run_was_timed_on_several(tmp_path):
    """A run resumed or sharded on another CPU pools TTFTs from both: the summary says which, by samples;
    one CPU (or rows from before the field) adds nothing."""
    from kvstitch.eval.report import machines_note, write_reports

    rows = []
    for index, cpu in ((0, "Intel Xeon"), (1, "Intel Xeon"), (2, "AMD EPYC")):
        for method, ttft in (("full", 2.0), ("naive", 0.1)):
            rows.append(dict(task="niah_single", seed=0, index=index, length=1024, chunk_tokens=128, depth=0.5,
                             method=method, ratio=None if method == "full" else 0.0, score=1.0, kl=0.0,
                             ttft_s=ttft, cpu=cpu))
    note = machines_note(rows)
    assert "Timed on 2 machines" in note and "AMD EPYC: 1 samples" in note and "Intel Xeon: 2 samples" in note
    write_reports(rows, tmp_path)
    assert note in (tmp_path / "summary.md").read_text()
    assert machines_note([r for r in rows if r["cpu"] == "Intel Xeon"]) == ""
    assert machines_note([{k: v for k, v in r.items() if k != "cpu"} for r in rows]) == ""
