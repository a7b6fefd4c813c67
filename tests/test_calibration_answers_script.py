"""scripts/calibration_answers.py: answers kept and same answer per configuration of a calibrate run."""

from __future__ import annotations


from tests.scripts_loader import load_script


def _load():
    return load_script("calibration_answers")


def _row(sample, config, pred, agree=False, ratio=0.1, used=0.1):
    return {"sample": sample, "config": config, "pred": pred, "agree": agree, "ratio": ratio, "ratio_used": used,
            "ttft_s": 1.0 if config != "full" else 4.0, "ttft_full_s": 4.0,
            "converged": (used < 1.0) if ratio == "auto" else None}


def test_counts_kept_same_answer_and_fallbacks():
    rows = [_row("s#0", "full", "Paris"), _row("s#1", "full", "1979"), _row("s#2", "full", "no idea"),
            _row("s#0", "m@0.1", "paris.", agree=True), _row("s#1", "m@0.1", "1980"), _row("s#2", "m@0.1", "no idea"),
            _row("s#0", "m@auto", "Paris", ratio="auto", used=1.0), _row("s#1", "m@auto", "1979", ratio="auto"),
            _row("s#2", "m@auto", "x", ratio="auto")]
    answers = {"s#0": ["Paris"], "s#1": ["1979"], "s#2": ["Rome"]}
    t = _load().table(rows, answers)
    fixed = next(line for line in t.splitlines() if line.startswith("| m@0.1 |"))
    auto = next(line for line in t.splitlines() if line.startswith("| m@auto |"))
    # full right on s#0, s#1; m@0.1 keeps s#0 only; same answer on s#0 and s#2 of 3
    assert fixed.startswith("| m@0.1 | 3 | 2 | 0.50 [") and "| 0.67 [" in fixed and fixed.endswith("| 0 | – | 4.00 |")
    # auto accepted its rounds' answers on s#1 ("1979", full's) and s#2 ("x", not full's "no idea")
    assert auto.startswith("| m@auto | 3 | 2 | 1.00 [") and auto.endswith("| 1 | 1 of 2 | 4.00 |")


def test_configurations_are_compared_on_the_samples_all_of_them_ran():
    """A configuration added to a resumed run has fewer samples: every row of the table counts only the samples
    every configuration ran, so their speed-ups and shares are over one set."""
    rows = [_row(f"s#{i}", "full", "Paris") for i in range(3)]
    rows += [_row(f"s#{i}", "m@0.1", "Paris") for i in range(3)]
    rows += [_row("s#0", "m@auto(max_ratio=0.3)", "Rome", ratio="auto", used=0.3)]  # fell back to a 30% recompute
    rows[-1]["converged"] = False
    t = _load().table(rows, {f"s#{i}": ["Paris"] for i in range(3)})
    fixed = next(line for line in t.splitlines() if line.startswith("| m@0.1 |"))
    capped = next(line for line in t.splitlines() if line.startswith("| m@auto(max_ratio=0.3) |"))
    assert fixed.startswith("| m@0.1 | 1 | 1 | 1.00 ") and capped.startswith("| m@auto(max_ratio=0.3) | 1 | 1 | 0.00 ")
    assert capped.endswith("| 1 | – | 4.00 |")  # one fallback (to max_ratio), nothing accepted
