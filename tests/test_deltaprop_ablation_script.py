"""scripts/deltaprop_ablation.py's table (its figures are cited in docs/results/own-method): pooled NLL-gap
recovery, agreement, speed-up and the share recomputed, from its rows."""

import argparse
import importlib.util
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "deltaprop_ablation.py"


def test_report_pools_the_nll_gap_and_skips_incomplete_samples(tmp_path):
    spec = importlib.util.spec_from_file_location("deltaprop_ablation", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    try:
        spec.loader.exec_module(mod)
        row = lambda i, v, nll, agree, s, rec=None: {  # noqa: E731
            "task": "t", "index": i, "variant": v, "nll": nll, "agree": agree, "prefill_s": s, "full_s": 4.0,
            **({} if rec is None else {"recomputed": rec, "work": 2 * rec})}
        rows = [row(0, "full", 1.0, True, 4.0, 1.0), row(0, "naive", 3.0, False, 1.0, 0.0),
                row(0, "x", 2.0, True, 1.0, 0.2), row(0, "y", 1.5, False, 2.0),
                row(1, "full", 0.0, True, 4.0, 1.0), row(1, "naive", 4.0, False, 1.0, 0.0),
                row(1, "x", 1.0, False, 1.0, 0.3), row(1, "y", 0.0, True, 2.0),
                row(2, "full", 0.0, True, 4.0), row(2, "naive", 9.0, False, 1.0)]  # no variant rows: left out
        args = argparse.Namespace(model=None, length=2048, n=2, seed=5, ratio=0.2, variants="x;y", out=str(tmp_path))
        mod.report(rows, ["x", "y"], args, tmp_path)
        table = (tmp_path / "ablation.md").read_text()
    finally:
        del sys.modules[spec.name]
    assert "n = 2" in table and "--variants 'x;y'" in table
    # pooled: naive 7, full 1; x 3 -> (7 - 3) / 6; y 1.5 -> 5.5 / 6
    assert "| x | 0.667 | 0.50 | 4.00 | 0.250 | 0.500 |" in table
    assert "| y | 0.917 | 0.50 | 2.00 | - | - |" in table  # rows without the share: not made up
    # per task and paired against the first variant (no deltaprop here): y agrees on #1 where x does not, and
    # the reverse on #0
    assert "| x | 1 / 2 |  |" in table and "| y | 1 / 2 | 1 / 1 |" in table
