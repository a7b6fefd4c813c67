"""scripts/prkv_static_sweep.py names its outputs by page size and records the command that wrote them
(`--page-size 8` writes `prkv_static_sweep_page8`); the sweep itself runs the real model and is not run here."""

from __future__ import annotations

import json

from tests.scripts_loader import load_script


def _script():
    return load_script("prkv_static_sweep")


def test_outputs_are_named_by_page_size_and_record_the_command(tmp_path):
    m = _script()
    assert m.output_name(16) == "prkv_static_sweep"  # the default page size
    assert m.output_name(8) == "prkv_static_sweep_page8"  # any other page size is in the name
    assert m.output_name(8, "custom") == "custom"
    rows = [{"static_ratio": "0.25", "budget": 1024, "page_size": 8, "context_tokens": 7946, "recall": 0.9176,
             "oracle_recall": 0.9743, "recall_min": 0.1, "top1_agreement": 0.875, "mean_chosen_ratio": 0.25},
            {"static_ratio": "auto", "budget": 1024, "page_size": 8, "context_tokens": 7946, "recall": 0.9249,
             "oracle_recall": 0.9745, "recall_min": 0.1, "top1_agreement": 0.90625, "mean_chosen_ratio": None}]
    cmd = "python scripts/prkv_static_sweep.py --page-size 8"
    js, md = m.write(rows, tmp_path, m.output_name(8), cmd)
    assert js.name == "prkv_static_sweep_page8.json" and md.name == "prkv_static_sweep_page8.md"
    data = json.loads(js.read_text())
    assert data["meta"]["command"] == cmd and data["rows"] == rows
    lines = md.read_text().splitlines()
    assert lines[2] == "| 0.25 | 1024 | 8 | 7946 | 0.918 | 0.974 | 0.88 | 0.25 |"
    assert lines[3].endswith("| 0.925 | 0.975 | 0.91 | - |")
