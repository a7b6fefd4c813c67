"""scripts/time_attention_backward.py: one layer's training attention, bfloat16 against the float32 path."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "time_attention_backward.py"


def test_prints_both_timings_and_their_ratio(capsys):
    spec = importlib.util.spec_from_file_location("time_attention_backward", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--keys", "300", "--queries", "8", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| bfloat16") or line.startswith("| float32")]
    assert len(rows) == 2 and all(float(r.split("|")[2]) > 0 for r in rows)
    assert "ratio: " in out
