"""scripts/adapter_table.py: adapters side by side on the same questions, with what each one's whole line of
training cost (a run started from another adapter adds that adapter's cost)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.scripts_loader import load_script


def _load():
    return load_script("adapter_table")


def _eval_dir(path: Path, digest: str | None, kept: dict, methods=(("naive", None), ("x", 0.1))) -> Path:
    """An eval directory over questions q0..q3, full prefill right on q0..q2; `kept` names the questions each
    method gets right."""
    path.mkdir(parents=True)
    rows = []
    for i in range(4):
        q = f"q{i}"
        rows.append({"qid": q, "method": "full", "ratio": None, "correct": i < 3, "kl": 0.0, "agree_words": True,
                     "nll": 1.0, "nll_full": 1.0, "ttft_s": 10.0})
        for m, r in methods:
            rows.append({"qid": q, "method": m, "ratio": r, "correct": q in kept.get(m, ()), "kl": 0.5,
                         "agree_words": q in kept.get(m, ()), "nll": 1.5, "nll_full": 1.0, "ttft_s": 2.0})
    (path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    adapter = {"form": "writer(r=8)", "sha256": digest} if digest else None
    (path / "run.json").write_text(json.dumps({"config": {"stitch_adapter": adapter}}))
    return path


def _train_dir(path: Path, steps: int, cpu_hours: float, init: str | None) -> Path:
    path.mkdir(parents=True)
    card = {"form": "writer(r=8)", "steps": steps, "cpu_hours": cpu_hours, "parameters": 1000, "bytes": 4000,
            "config": {"init": init} if init else {}}
    (path / "adapter.json").write_text(json.dumps(card))
    (path / "loss.jsonl").write_text(json.dumps({"step": 0, "val": 0.2}) + "\n" + json.dumps({"step": steps, "val": 0.1}))
    return path


def test_a_run_started_from_an_evaluated_adapter_adds_its_cost_and_the_curve_is_drawn(tmp_path):
    mod = _load()
    none = _eval_dir(tmp_path / "none", None, {"x": {"q0"}}, methods=(("naive", None), ("x", 0.1), ("other", 0.1)))
    a = _eval_dir(tmp_path / "a", "aaaa", {"naive": {"q0"}, "x": {"q0", "q1"}})
    b = _eval_dir(tmp_path / "b", "bbbb", {"naive": {"q0", "q1"}, "x": {"q0", "q1", "q2"}})
    c = _eval_dir(tmp_path / "c", "cccc", {})
    ta = _train_dir(tmp_path / "ta", 10, 1.0, None)
    tb = _train_dir(tmp_path / "tb", 5, 0.5, "aaaa")
    tc = _train_dir(tmp_path / "tc", 7, 0.25, "zzzz")  # from an adapter the table did not evaluate
    out = tmp_path / "out"
    mod.main(["--eval", f"none={none}", "--eval", f"a={a}:{ta}", "--eval", f"b={b}:{tb}", "--eval", f"c={c}:{tc}",
              "--out", str(out)])
    text = (out / "adapters.md").read_text()
    assert text.startswith("Written by `python scripts/adapter_table.py")
    assert "n = 4 questions, 3 answered right by full prefill." in text
    assert "| other |" not in text  # a setting only the adapter-free run has is left out
    assert "| b | x | 0.10 | 4 | 0.500 | 0.75" in text  # kept 3 of 3 after the 0.75 agreement cell
    data = json.loads((out / "adapters.json").read_text())
    assert data["lineage"]["none"] == {"from": None, "steps": 0, "cpu_hours": 0.0}
    assert data["lineage"]["a"] == {"from": None, "steps": 10, "cpu_hours": 1.0}
    assert data["lineage"]["b"] == {"from": "a", "steps": 15, "cpu_hours": 1.5}
    assert data["lineage"]["c"] == {"from": "zzzz", "steps": None, "cpu_hours": None}
    assert "| b | writer(r=8) | a | 5 | 0.50 | 15 | 1.50 |" in text
    assert "| c | writer(r=8) | zzzz | 7 | 0.25 | – | – |" in text
    kept = {(r["adapter"], r["method"]): r["kept"] for r in data["rows"]}
    assert kept[("none", "x")] == 1 / 3 and kept[("b", "x")] == 1.0 and kept[("c", "naive")] == 0.0
    assert (out / "kept_vs_cpu_hours.png").stat().st_size > 1000
    assert "kept_vs_cpu_hours.png" in text


def test_a_line_of_training_that_loops_or_has_one_cost_draws_no_curve(tmp_path):
    mod = _load()
    totals = mod.lineage(["a", "b"], {"a": "aaaa", "b": "bbbb"},
                         {"a": {"steps": 1, "cpu_hours": 1.0, "config": {"init": "bbbb"}},
                          "b": {"steps": 1, "cpu_hours": 1.0, "config": {"init": "aaaa"}}})
    assert totals["a"]["steps"] is None and totals["b"]["steps"] is None  # a cycle is never summed
    rows = [{"adapter": "a", "method": "naive", "ratio": None, "kept": 0.5, "kl": 0.1}]
    assert mod.plot_curve(rows, {"a": {"from": None, "steps": 3, "cpu_hours": 1.0}}, tmp_path / "p.png") is None
    assert not (tmp_path / "p.png").exists()
