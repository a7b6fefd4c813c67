"""The eval harness end to end on a tiny random model: JSON lines, resume, fidelity fields, table, plots."""

from __future__ import annotations

import copy
import json
import math
import re
import sys

import pytest
import torch
import typer
from typer.testing import CliRunner

import kvstitch
from kvstitch.eval.rows import read_jsonl
from kvstitch.eval.runner import (RESULTS, EvalConfig, combos, run_eval, run_method, sample_layout,
                                  to_original_order)
from kvstitch.tasks.tasks import generate

from .conftest import make_tiny_engine

PNG = b"\x89PNG\r\n\x1a\n"
TASKS = ["niah_single_essay", "two_hop"]


def _methods() -> list[str]:
    """Two stitched methods: prophet (query-driven) when registered, and the random control."""
    return ["random", "prophet" if "prophet" in kvstitch.methods() else "naive"][:2]


@pytest.fixture
def engine(smollm_tokenizer):
    return make_tiny_engine("llama", smollm_tokenizer)


def _cfg(**kw) -> EvalConfig:
    base = dict(tasks=TASKS, lengths=[160], methods=_methods(), ratios=[0.2], n=2, chunk_tokens=64,
                max_new_tokens=5)
    return EvalConfig(**{**base, **kw})


def test_tiny_end_to_end_resumes_and_reports(engine, tmp_path):
    cfg = _cfg()
    rows = run_eval(engine, cfg, tmp_path, progress=False, command="kvstitch eval (test)")
    per_sample = len(combos(cfg.methods, cfg.ratios))
    assert per_sample == 2 + len(set(cfg.methods) - {"full", "naive"})
    assert len(rows) == len(TASKS) * cfg.n * per_sample
    logged = read_jsonl(tmp_path / RESULTS)
    assert len(logged) == len(rows)
    keys = {(r["task"], r["index"], r["method"], r["ratio"]) for r in logged}
    assert len(keys) == len(logged)  # one row per (sample, method, ratio)

    from kvstitch.engine.engine import cpu_name

    for r in logged:
        for f in ("score", "kl", "kl_first", "nll", "ttft_s", "recomputed", "answer_tokens", "depth", "n_tokens"):
            assert r.get(f) is not None, (f, r["method"])
        assert r["cpu"] == cpu_name() and r["cpu"]  # the machine that timed it: runs resumed elsewhere mix them
        assert 0.0 <= r["score"] <= 1.0
        assert r["kl"] >= 0.0 and r["kl_first"] >= 0.0 and r["nll"] >= 0.0
        assert r["ttft_s"] > 0.0
        if r["method"] == "full":
            assert r["kl"] == 0.0 and r["kl_first"] == 0.0  # KL(full || full)
            assert r["answer_ids"] and len(r["answer_ids"]) == r["answer_tokens"]
            assert r["recomputed"] == r["n_tokens"]
            assert r["nll"] == pytest.approx(r["nll_full"])
            if r["nll_recovery"] is not None:
                assert r["nll_recovery"] == pytest.approx(1.0)
        elif r["method"] == "naive":
            assert r["recomputed"] == 0
            if r["nll_recovery"] is not None:
                assert r["nll_recovery"] == pytest.approx(0.0)
            assert r["overlap"] is None  # naive has no budget / ratio
        else:
            assert r["recomputed"] == round(0.2 * r["n_tokens"])
            if "oracle" in kvstitch.methods():
                assert 0.0 <= r["overlap"] <= 1.0
            assert "select_s" in r and "recompute_s" in r
    # naive loses something on a random model: its KL vs full is strictly positive
    assert all(r["kl"] > 0 for r in logged if r["method"] == "naive")

    summary = (tmp_path / "summary.md").read_text()
    assert "| task | method | ratio |" in summary and "% full" in summary
    for t in TASKS:
        assert f"| {t} | full |" in summary
    for m in cfg.methods:
        assert f"| {m} | 0.20 |" in summary  # fidelity table
    for png in ("accuracy_vs_ratio_160.png", "fidelity_vs_ratio_160.png", "niah_heatmap.png"):
        assert (tmp_path / png).read_bytes()[:8] == PNG
    meta = json.loads((tmp_path / "run.json").read_text())
    assert meta["commands"] == ["kvstitch eval (test)"] and meta["rows"] == len(rows)

    # resume: nothing left to do, no row added
    again = run_eval(engine, cfg, tmp_path, progress=False)
    assert len(again) == len(rows) and len(read_jsonl(tmp_path / RESULTS)) == len(rows)

    # an interrupted run: drop the last rows (and leave a torn line); the rerun restores exactly them
    lines = (tmp_path / RESULTS).read_text().splitlines(keepends=True)
    (tmp_path / RESULTS).write_text("".join(lines[:-3]) + lines[-3][: len(lines[-3]) // 2])
    resumed = read_jsonl(tmp_path / RESULTS)
    assert len(resumed) == len(rows) - 3
    run_eval(engine, cfg, tmp_path, progress=False)
    final = read_jsonl(tmp_path / RESULTS)
    assert len(final) == len(rows)
    by_key = {(r["task"], r["index"], r["method"], r["ratio"]): r for r in logged}
    for r in final[-3:]:  # recomputed against the stored target: same answer and fidelity
        old = by_key[(r["task"], r["index"], r["method"], r["ratio"])]
        assert r["pred"] == old["pred"] and r["score"] == old["score"]
        assert r["kl"] == pytest.approx(old["kl"], rel=1e-4, abs=1e-7)
        if old["nll_recovery"] is not None:
            assert r["nll_recovery"] == pytest.approx(old["nll_recovery"], rel=1e-4, abs=1e-6)


def test_resume_refuses_another_protocol(engine, tmp_path):
    """Rows of a run with another answer budget / prompt are not comparable: refuse to mix them."""
    cfg = _cfg(tasks=TASKS[:1], n=0, methods=["random"])
    run_eval(engine, cfg, tmp_path, progress=False)  # n=0: writes run.json only
    (tmp_path / RESULTS).write_text('{"task": "niah_single_essay", "method": "full"}\n')
    run_eval(engine, cfg, tmp_path, progress=False)  # same protocol: fine
    with pytest.raises(kvstitch.InputError, match="protocol"):
        run_eval(engine, _cfg(tasks=TASKS[:1], n=0, methods=["random"], max_new_tokens=9), tmp_path, progress=False)
    with pytest.raises(kvstitch.InputError, match="protocol"):
        run_eval(engine, _cfg(tasks=TASKS[:1], n=0, methods=["random"], answer_prefix=False), tmp_path, progress=False)


def test_resume_refuses_a_method_whose_default_changed(engine, tmp_path):
    """A label means what its options were when the rows were written: after a default changes, resuming under
    the old label would mix two methods in one row group, so it is refused, naming both."""
    import json

    cfg = _cfg(tasks=TASKS[:1], n=0, methods=["deltaprop"])
    run_eval(engine, cfg, tmp_path, progress=False)
    (tmp_path / RESULTS).write_text('{"task": "niah_single_essay", "method": "full"}\n')
    meta_path = tmp_path / "run.json"
    meta = json.loads(meta_path.read_text())
    now = meta["method_specs"]["deltaprop"]
    assert now.startswith("deltaprop(base=prophet(),alpha_v=1.0,alpha_k=0.25,")
    run_eval(engine, cfg, tmp_path, progress=False)  # unchanged: resumes
    # rows written when deltaprop's default alpha_k was 0.5
    meta["method_specs"]["deltaprop"] = now.replace("alpha_k=0.25", "alpha_k=0.5")
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(kvstitch.InputError, match=r"'deltaprop' was run as .*alpha_k=0.5.* now means .*alpha_k=0.25"):
        run_eval(engine, cfg, tmp_path, progress=False)
    run_eval(engine, _cfg(tasks=TASKS[:1], n=0, methods=["random"]), tmp_path, progress=False)  # other labels: fine


def test_storage_dtype_is_part_of_the_protocol(engine, smollm_tokenizer, tmp_path):
    """An int8 (KIVI) store gives other numbers than a float32/float16 one: its rows go to another log."""
    from kvstitch.engine import Engine
    from kvstitch.store import MemoryStore

    cfg = _cfg(tasks=TASKS[:1], n=0, methods=["random"])
    run_eval(engine, cfg, tmp_path, progress=False)
    assert cfg.storage_dtype == "float32"  # taken from the engine's store
    assert json.loads((tmp_path / "run.json").read_text())["protocol"]["storage_dtype"] == "float32"
    (tmp_path / RESULTS).write_text('{"task": "niah_single_essay", "method": "full"}\n')
    int8 = Engine(engine.model, engine.tokenizer, weights_id="tiny-llama", store=MemoryStore(storage_dtype="int8"))
    with pytest.raises(kvstitch.InputError, match="protocol"):
        run_eval(int8, _cfg(tasks=TASKS[:1], n=0, methods=["random"]), tmp_path, progress=False)
    assert "storage_dtype" not in EvalConfig(tasks=[], lengths=[], methods=[], ratios=[]).protocol()  # float16


@pytest.mark.parametrize("method,ratio", [("naive", None), ("random", 0.3)])
def test_fused_run_matches_generate_and_answer_logits(engine, method, ratio):
    """The harness's one-prefill path gives the engine's greedy answer and teacher-forced logits."""
    s = generate("niah_single_essay", 1, 160, 64, 0, lambda t: len(engine.tokenizer.encode(t)))[0]
    layout = sample_layout(engine, s)
    ref = engine.generate("", [], method="full", max_new_tokens=8, layout=layout)
    target = torch.tensor(ref.token_ids)
    run = run_method(engine, layout, method, ratio, 8, target)
    gen = engine.generate("", [], method=method, recompute_ratio=ratio or 0.0, max_new_tokens=8, layout=layout)
    assert run.tokens == gen.token_ids
    logits, idx, _ = engine.answer_logits(layout, target, method, ratio or 0.0)
    torch.testing.assert_close(run.logits, logits.float(), rtol=1e-4, atol=1e-4)
    assert run.indices.tolist() == idx.tolist()
    full = run_method(engine, layout, "full", None, 8)
    assert full.tokens == ref.token_ids


def _counting_forward(engine, calls: list):
    real = engine.forward
    engine.forward = lambda cache, ids, *a, **k: (calls.append(len(ids)), real(cache, ids, *a, **k))[1]
    return real


@pytest.mark.parametrize("oracle", ["oracle", "oracle_ideal"])
def test_oracles_reuse_the_samples_full_prefill(engine, oracle):
    """The oracles score from the full prefill the harness already ran: the same scores and set as their own
    prefill of the context, that prefill's time charged to them, and the context not prefilled twice."""
    from kvstitch.eval.runner import SampleFullPrefill

    s = generate("niah_single_essay", 1, 160, 64, 0, lambda t: len(engine.tokenizer.encode(t)))[0]
    layout = sample_layout(engine, s)
    full = SampleFullPrefill(engine, layout)
    with full.recording():
        ref = run_method(engine, layout, "full", None, 6)
    assert full.cache is not None and full.seconds > 0 and engine.hooks.full_prefill is None  # set for the block only
    own, shared = {}, {}
    a = run_method(engine, layout, oracle, 0.3, 6, ref.tokens, score_cache=own)
    calls: list = []
    real = _counting_forward(engine, calls)
    try:
        b = run_method(engine, layout, oracle, 0.3, 6, ref.tokens, score_cache=shared, full=full)
    finally:
        engine.forward = real
    torch.testing.assert_close(shared[oracle][0], own[oracle][0], rtol=1e-5, atol=1e-6)
    assert b.indices.tolist() == a.indices.tolist() and b.tokens == a.tokens
    assert layout.context_end not in calls and layout.n_total not in calls  # nothing prefilled again
    assert b.stats["select_cached"] and b.stats["select_s"] >= full.seconds and "select_cached" not in a.stats
    assert shared[oracle][1] >= full.seconds  # a second ratio reusing these scores is charged the prefill too


def test_auto_fallback_reuses_the_samples_full_prefill(engine):
    """`auto` that falls back to full prefill gets the sample's full prefill (already run for the reference):
    the same answer and logits as computing it again, its time charged, no second full prefill."""
    from kvstitch.eval.runner import SampleFullPrefill

    s = generate("niah_single_essay", 1, 160, 64, 0, lambda t: len(engine.tokenizer.encode(t)))[0]
    layout = sample_layout(engine, s)
    full = SampleFullPrefill(engine, layout)
    with full.recording():
        ref = run_method(engine, layout, "full", None, 6)
    never = {"schedule": [0.1], "tol": 0.0, "min_context": 0}  # tol 0: no round converges -> full prefill
    a = run_method(engine, layout, "random", "auto", 6, ref.tokens, auto=never)
    calls: list = []
    real = _counting_forward(engine, calls)
    try:
        b = run_method(engine, layout, "random", "auto", 6, ref.tokens, auto=never, full=full)
        c = run_method(engine, layout, "random", "auto", 6, ref.tokens, auto=never, full=full)  # reused twice
    finally:
        engine.forward = real
    assert a.stats["ratio_used"] == b.stats["ratio_used"] == 1.0
    assert layout.n_total not in calls
    for run in (b, c):
        assert run.tokens == a.tokens == ref.tokens and run.text == a.text
        torch.testing.assert_close(run.logits, a.logits, rtol=1e-5, atol=1e-5)
        assert run.stats["fallback_reused"] and run.stats["fallback_s"] >= full.seconds
        assert run.ttft_s >= full.seconds
    assert "fallback_reused" not in a.stats and full.take_charge() == 0.0


def test_rows_timed_while_paused_are_timed_again(engine, monkeypatch):
    """A prefill whose process got almost no CPU while the wall clock ran (a paused job) is measured again: the
    same answer, logits and set, the row marked ``retimed`` with the new run's CPU share; other rows untouched."""
    import time

    from kvstitch.eval import sample as sample_mod
    from kvstitch.eval import timing

    s = generate("niah_single_essay", 1, 160, 64, 0, lambda t: len(engine.tokenizer.encode(t)))[0]
    cfg = _cfg(methods=["random"], ratios=[0.2, 0.4])
    todo = combos(cfg.methods, cfg.ratios)
    frozen = [0]

    def clock():  # a frozen clock while a pause is armed, else the wall clock (so every other run reads busy)
        if frozen[0]:
            frozen[0] -= 1
            return 0.0
        return time.perf_counter()

    monkeypatch.setattr(sample_mod, "cpu_clock", clock)
    calm = {(r["method"], r["ratio"]): r for r in sample_mod.eval_sample(engine, s, todo, {}, cfg)}
    assert not any(r.get("retimed") for r in calm.values()) and all(r["cpu_share"] >= 1.0 for r in calm.values())

    monkeypatch.setattr(timing, "PAUSED_MIN_S", 0.0)  # the tiny model's prefills take milliseconds
    pause = {("full", None), ("random", 0.4)}
    arm = lambda _s, m, r: frozen.__setitem__(0, 2 if (m, r) in pause else 0)  # the first run's two clock reads
    paused = {(r["method"], r["ratio"]): r for r in sample_mod.eval_sample(engine, s, todo, {}, cfg, on_start=arm)}
    assert paused.keys() == calm.keys()
    for key, row in paused.items():
        assert bool(row.get("retimed")) == (key in pause), key
        assert row["cpu_share"] >= 1.0  # the kept run's, not the paused one's
        for f in ("pred", "kl", "nll", "recomputed", "score"):
            assert row[f] == calm[key][f], (key, f)
    assert paused[("full", None)]["answer_ids"] == calm[("full", None)]["answer_ids"]


def test_to_original_order_maps_reordered_chunks():
    lens = [3, 2, 4]  # original chunks: 0 -> [0,1,2], 1 -> [3,4], 2 -> [5,6,7,8]
    order = [2, 0, 1]  # reordered context: chunk 2, chunk 0, chunk 1
    idx = torch.tensor([0, 5, 8])  # first of chunk 2, second of chunk 0, last of chunk 1
    assert to_original_order(idx, order, lens).tolist() == [1, 4, 5]
    assert to_original_order(idx, [0, 1, 2], lens).tolist() == [0, 5, 8]


def test_eval_command_wiring(engine, tmp_path, monkeypatch):
    """`kvstitch eval` as the CLI will mount it (the model load is replaced by the tiny engine)."""
    from kvstitch.engine import Engine
    from kvstitch.cli.eval import eval_command

    monkeypatch.setattr(Engine, "load", classmethod(lambda cls, *a, **k: engine))
    app = typer.Typer()
    app.command("eval")(eval_command)
    app.command("noop")(lambda: None)  # a second command keeps `eval` a sub-command, as in kvstitch.cli.main
    out = tmp_path / "o"
    r = CliRunner().invoke(app, ["eval", "--tasks", "niah_single_essay", "--length", "160", "--chunk-tokens", "64",
                                 "--methods", "random", "--ratios", "0.2", "--n", "1", "--max-new-tokens", "4",
                                 "--out", str(out)])
    assert r.exit_code == 0, r.output
    rows = read_jsonl(out / RESULTS)
    assert sorted(r["method"] for r in rows) == ["full", "naive", "random"]
    assert (out / "summary.md").exists()
    assert not any(math.isnan(r["kl"]) for r in rows)


def test_precompute_mode_flag_reaches_the_engine_rows_and_protocol(engine, tmp_path, monkeypatch):
    """`--precompute-mode isolated` loads an isolated-precompute engine; its rows say so, and its protocol
    keeps them out of a shared-prefix log."""
    from kvstitch.engine import Engine
    from kvstitch.cli.eval import eval_command
    from kvstitch.store import MemoryStore

    seen = {}

    def load(cls, *a, **k):
        seen.update(k)
        return Engine(engine.model, engine.tokenizer, weights_id="tiny-llama",
                      store=MemoryStore(storage_dtype="float32"), precompute=k.get("precompute", "shared_prefix"))

    monkeypatch.setattr(Engine, "load", classmethod(load))
    app = typer.Typer()
    app.command("eval")(eval_command)
    app.command("noop")(lambda: None)
    out = tmp_path / "iso"
    args = ["eval", "--tasks", "niah_single_essay", "--length", "160", "--chunk-tokens", "64", "--methods", "epic",
            "--ratios", "0.2", "--n", "1", "--max-new-tokens", "4", "--out", str(out)]
    r = CliRunner().invoke(app, [*args, "--precompute-mode", "isolated"])
    assert r.exit_code == 0, r.output
    assert seen["precompute"] == "isolated"
    rows = {x["method"]: x for x in read_jsonl(out / RESULTS)}
    assert rows["epic"]["precompute"] == "isolated" and rows["naive"]["precompute"] == "isolated"
    assert json.loads((out / "run.json").read_text())["protocol"]["precompute_mode"] == "isolated"
    r = CliRunner().invoke(app, args)  # the same directory with shared-prefix chunks: refused
    assert r.exit_code != 0 and "protocol" in str(r.exception or r.output)
    r = CliRunner().invoke(app, [*args[:-1], str(tmp_path / "bad"), "--precompute-mode", "nope"])
    assert r.exit_code != 0 and "precompute" in str(r.exception or r.output)


def test_haystack_flag_is_resolved_and_part_of_the_protocol(engine, tmp_path):
    cfg = _cfg(tasks=["niah_multikey"], n=1, methods=["random"], haystack="auto", lengths=[160])
    rows = run_eval(engine, cfg, tmp_path, progress=False, max_samples=1)
    assert cfg.haystack == "essays"  # installed by scripts/setup.sh
    assert json.loads((tmp_path / "run.json").read_text())["protocol"]["haystack"] == "essays"
    assert rows and all(r["task"] == "niah_multikey" for r in rows)
    with pytest.raises(kvstitch.InputError, match="protocol"):  # a synthetic-haystack run into the same log
        run_eval(engine, _cfg(tasks=["niah_multikey"], n=0, methods=["random"], haystack="synthetic"), tmp_path,
                 progress=False)
    with pytest.raises(kvstitch.InputError, match="haystack"):
        run_eval(engine, _cfg(haystack="novels", n=0), tmp_path / "x", progress=False)


def test_a_run_logged_to_a_file_prints_a_line_per_sample(engine, tmp_path):
    """No live bar in a log file (nohup): one plain line per sample says where the run is and what is left."""
    import io

    from rich.console import Console

    from kvstitch.eval.runner import sample_log_line

    buf = io.StringIO()
    cfg = _cfg(tasks=["niah_single_essay"], n=2, methods=["random"])
    run_eval(engine, cfg, tmp_path, console=Console(file=buf, force_terminal=False, width=200))
    lines = [l for l in buf.getvalue().splitlines() if l.startswith("eval: sample")]
    assert [l.split(" (")[0] for l in lines] == ["eval: sample 1/2", "eval: sample 2/2"]
    assert "niah_single_essay#0" in lines[0] and "~0m00s left" in lines[1]
    if sys.platform == "linux":  # the process's memory, and the store's share, on every line
        assert all(re.search(r"left; \d+\.\d GiB resident, \d+\.\d GiB of it in the chunk store$", l) for l in lines)
    assert sample_log_line(1, 4, "t#0", 75, 75) == "eval: sample 1/4 (t#0) done in 1m15s; elapsed 1m15s, ~3m45s left"
    assert sample_log_line(2, 4, "t#1", 10, 3700).endswith("elapsed 1h01m40s, ~1h01m40s left")
    assert sample_log_line(2, 4, "t#1", 10, 3700, 5 << 30, 3 << 29).endswith(
        "~1h01m40s left; 5.0 GiB resident, 1.5 GiB of it in the chunk store")
    assert sample_log_line(2, 4, "t#1", 10, 3700, 5 << 30).endswith("left; 5.0 GiB resident")


def test_resident_bytes_reads_the_process_memory_now():
    """The figure is current memory (it falls when memory is released), not the peak."""
    from kvstitch.core.memory import resident_bytes

    if sys.platform != "linux":
        assert resident_bytes() is None or resident_bytes() > 0
        return
    before = resident_bytes()
    block = torch.ones(64 << 20, dtype=torch.uint8)  # 64 MiB, touched
    during = resident_bytes()
    del block
    assert during - before > 48 << 20 and resident_bytes() < during - (48 << 20)


def test_fidelity_table_has_bootstrap_intervals():
    from kvstitch.eval.report import fidelity_table, pooled_recovery, pooled_recovery_ci

    rows = []
    for i in range(12):
        key = dict(task="t", seed=0, index=i, length=100, chunk_tokens=10)
        rows.append({**key, "method": "naive", "ratio": None, "nll": 2.0, "nll_full": 1.0, "kl": 0.4, "kl_first": 0.5})
        rows.append({**key, "method": "m", "ratio": 0.2, "nll": 1.5 - 0.04 * i, "nll_full": 1.0, "kl": 0.1 + 0.01 * i,
                     "kl_first": 0.2, "overlap": 0.5 + 0.02 * i, "nll_recovery": 0.5 + 0.04 * i})
    table = fidelity_table(rows)
    line = next(x for x in table.splitlines() if x.startswith("| m | 0.20 |"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[3] == "0.2000 [0.2000, 0.2000]"  # constant: zero width
    lo, hi = (float(v) for v in cells[4].split(" [")[1].rstrip("]").split(", "))
    assert lo < 0.155 < hi  # mean KL 0.155
    naive = {(r["task"], 0, r["index"], 100, 10): 2.0 for r in rows if r["method"] == "naive"}
    m_rows = [r for r in rows if r["method"] == "m"]
    p = pooled_recovery(m_rows, naive)
    plo, phi = pooled_recovery_ci(m_rows, naive)
    assert plo < p < phi and cells[7].startswith(f"{p:.2f} [")
    assert " [" in cells[8]  # overlap too


@pytest.mark.parametrize("failing", ["all", "one"])
def test_eval_exit_code_when_samples_fail(engine, tmp_path, monkeypatch, failing):
    """`kvstitch eval` exits 1 when every sample of the run failed; one failed sample of two is logged
    and the run still succeeds (a long run must not stop for one broken sample)."""
    import kvstitch.eval.runner as runner
    from kvstitch.cli.main import app
    from kvstitch.engine import Engine

    real = runner.eval_sample

    def flaky(eng, sample, *a, **k):
        if failing == "all" or sample.meta["index"] == 0:
            raise RuntimeError("boom")
        return real(eng, sample, *a, **k)

    monkeypatch.setattr(Engine, "load", classmethod(lambda cls, *a, **k: engine))
    monkeypatch.setattr(runner, "eval_sample", flaky)
    out = tmp_path / "o"
    r = CliRunner().invoke(app, ["eval", "--tasks", "niah_single_essay", "--length", "160", "--chunk-tokens", "64",
                                 "--methods", "random", "--ratios", "0.2", "--n", "2", "--max-new-tokens", "4",
                                 "--out", str(out)])
    meta = json.loads((out / "run.json").read_text())
    if failing == "all":
        assert r.exit_code == 1, r.output
        assert "every sample" in r.output and "boom" in r.output
        assert len(meta["errors_last_run"]) == 2
        assert not (out / RESULTS).exists() or not read_jsonl(out / RESULTS)
    else:
        assert r.exit_code == 0, r.output
        assert len(meta["errors_last_run"]) == 1
        assert {row["index"] for row in read_jsonl(out / RESULTS)} == {1}


def test_auto_options_that_are_off_stay_out_of_the_protocol():
    """A log written before `min_p` / `verify_chunks` existed resumes under the defaults (its protocol has
    neither key); switching one on is another protocol."""
    before = {"schedule": [0.05, 0.1], "max_ratio": 1.0, "tol": 0.01, "probe_tokens": 16, "patience": 1,
              "mode": "refresh", "min_context": 1024}  # the auto protocol of the first Qwen NIAH 8K log
    assert _cfg(auto_methods=["prophet"]).protocol()["auto"] == before
    assert _cfg(auto_methods=["prophet"], auto={"verify_chunks": 2}).protocol()["auto"] == {**before, "verify_chunks": 2}
    assert _cfg(auto_methods=["prophet"], auto={"min_p": 0.5}).protocol()["auto"] == {**before, "min_p": 0.5}


def test_auto_rows_report_agreement_cost_and_resume(engine, tmp_path):
    """ratio 'auto' next to fixed ratios: rows carry the rounds, the real recomputed fraction and the agreement
    with full prefill's answer; the auto options are part of the protocol; the summary has an agreement table."""
    cfg = _cfg(tasks=["niah_single_essay"], methods=["prophet"], ratios=[0.2, "auto"], n=2,
               auto={"tol": 1e9, "schedule": [0.05, 0.1], "min_context": 0})
    rows = run_eval(engine, cfg, tmp_path, progress=False)
    auto = [r for r in rows if r["ratio"] == "auto"]
    fixed = [r for r in rows if r["ratio"] == 0.2]
    full = {r["index"]: r for r in rows if r["method"] == "full"}
    assert len(auto) == len(fixed) == 2
    for r in auto:
        assert r["rounds"] >= 1 and isinstance(r["converged"], bool) and r["round_ratios"]
        assert 0.0 < r["ratio_used"] <= 1.0 and r["recompute_cost"] >= r["ratio_used"] - 1e-9
        assert r["agree_words"] == (r["pred"].split()[:12] == full[r["index"]]["pred"].split()[:12]) or r["agree_words"]
        assert r["ttft_full_s"] > 0
    for r in rows:
        assert isinstance(r["agree_words"], bool) and isinstance(r["agree_first"], bool)
    assert all(r["agree_words"] and r["agree_first"] for r in full.values())  # full agrees with itself
    assert json.loads((tmp_path / "run.json").read_text())["protocol"]["auto"]["tol"] == 1e9
    summary = (tmp_path / "summary.md").read_text()
    assert "agreement with full prefill" in summary.lower() and "| prophet | auto |" in summary
    assert (tmp_path / "pareto_160.png").read_bytes()[:8] == PNG
    again = run_eval(engine, cfg, tmp_path, progress=False)  # resumes: nothing left to run
    assert again == [] or len(read_jsonl(tmp_path / RESULTS)) == len(rows)


def test_eval_report_pools_several_runs(engine, tmp_path):
    """`kvstitch eval-report A B --out C`: one summary over the union of the runs' rows, naming their commands."""
    from kvstitch.cli.main import app

    a, b = tmp_path / "a", tmp_path / "b"
    run_eval(engine, _cfg(tasks=["niah_single_essay"], n=1, methods=["random"]), a, progress=False, command="cmd-a")
    run_eval(engine, _cfg(tasks=["two_hop"], n=1, methods=["random"]), b, progress=False, command="cmd-b")
    r = CliRunner().invoke(app, ["eval-report", str(a), str(b), "--out", str(tmp_path / "c")])
    assert r.exit_code == 0, r.output
    text = (tmp_path / "c" / "summary.md").read_text()
    assert "`cmd-a`" in text and "`cmd-b`" in text and "niah_single_essay" in text and "two_hop" in text
    assert "Agreement with full prefill" in text
    bad = CliRunner().invoke(app, ["eval-report", str(tmp_path / "nothing"), "--out", str(tmp_path / "d")])
    assert bad.exit_code == 2 and "results.jsonl" in bad.output


def test_shards_split_a_run_and_merge_into_the_whole(engine, tmp_path):
    """`--shard k/n` runs disjoint samples whose union is the unsharded run, row for row; a resumed shard
    keeps its own samples; `kvstitch eval-merge` joins the shards (shared rows once) into a resumable run."""
    from kvstitch.cli.main import app
    from kvstitch.eval.runner import row_key

    cfg = _cfg(n=3, methods=["random"])
    whole = run_eval(engine, cfg, tmp_path / "whole", progress=False)
    seed_rows = read_jsonl(tmp_path / "whole" / RESULTS)[:3]  # a run both shards continue (full/naive/random
    for k in (0, 1):                                           # of its first sample)
        (tmp_path / f"s{k}").mkdir()
        (tmp_path / f"s{k}" / RESULTS).write_text("".join(json.dumps(r) + "\n" for r in seed_rows))
    s0 = run_eval(engine, cfg, tmp_path / "s0", progress=False, shard=(0, 2), max_samples=1)  # stopped early
    s0 = run_eval(engine, cfg, tmp_path / "s0", progress=False, shard=(0, 2))                 # and resumed
    s1 = run_eval(engine, cfg, tmp_path / "s1", progress=False, shard=(1, 2))
    samples = lambda rows: {row_key(r)[:5] for r in rows}  # noqa: E731
    first = samples(seed_rows)
    assert (samples(s0) - first).isdisjoint(samples(s1) - first)
    assert samples(s0) | samples(s1) == samples(whole)
    # 6 samples in run order; shard 0 has places 0, 2, 4 (place 0 is the seeded, done one), shard 1 has 1, 3, 5
    assert len(samples(s0) - first) == 2 and len(samples(s1) - first) == 3

    r = CliRunner().invoke(app, ["eval-merge", str(tmp_path / "s0"), str(tmp_path / "s1"), "--out",
                                 str(tmp_path / "m")])
    assert r.exit_code == 0, r.output
    assert "3 found in more than one run" in r.output and "part of their rows" not in r.output
    merged = read_jsonl(tmp_path / "m" / RESULTS)
    by_key = {row_key(x): x for x in whole}
    assert sorted(map(row_key, merged), key=str) == sorted(by_key, key=str)  # each row once, none missing
    for x in merged:  # the same answers as the unsharded run (a deterministic tiny model)
        assert x["pred"] == by_key[row_key(x)]["pred"] and abs(x["nll"] - by_key[row_key(x)]["nll"]) < 1e-5
    assert "eval-merge" in (tmp_path / "m" / "summary.md").read_text()
    assert run_eval(engine, cfg, tmp_path / "m", progress=False) == merged  # nothing left to run

    (tmp_path / "p").mkdir()  # a shard merged while it still writes its last sample: merged, and said
    (tmp_path / "p" / "run.json").write_text((tmp_path / "whole" / "run.json").read_text())
    stopped = read_jsonl(tmp_path / "whole" / RESULTS)[:-1]
    (tmp_path / "p" / RESULTS).write_text("".join(json.dumps(x) + "\n" for x in stopped))
    r = CliRunner().invoke(app, ["eval-merge", str(tmp_path / "p"), "--out", str(tmp_path / "pm")])
    assert r.exit_code == 0 and "has 1 sample with only part of their rows" in r.output, r.output

    with pytest.raises(kvstitch.InputError, match="k/n"):
        run_eval(engine, cfg, tmp_path / "x", progress=False, shard=(2, 2))


def test_merge_refuses_conflicting_rows_and_other_protocols(engine, tmp_path):
    """Two runs with different answers for one row, or of different protocols, are not merged, and the
    target keeps what it had."""
    from kvstitch.cli.main import app

    cfg = _cfg(n=1, tasks=["two_hop"], methods=["random"])
    run_eval(engine, cfg, tmp_path / "a", progress=False)
    rows = read_jsonl(tmp_path / "a" / RESULTS)
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "run.json").write_text((tmp_path / "a" / "run.json").read_text())
    (tmp_path / "b" / RESULTS).write_text("".join(json.dumps({**x, "pred": x["pred"] + " changed"}) + "\n"
                                                  for x in rows))
    before = (tmp_path / "a" / RESULTS).read_bytes()
    r = CliRunner().invoke(app, ["eval-merge", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "a")])
    assert r.exit_code == 2 and "another answer" in r.output
    assert (tmp_path / "a" / RESULTS).read_bytes() == before

    run_eval(engine, _cfg(n=1, tasks=["two_hop"], methods=["random"], answer_slack=3), tmp_path / "c", progress=False)
    r = CliRunner().invoke(app, ["eval-merge", str(tmp_path / "a"), str(tmp_path / "c"), "--out", str(tmp_path / "d")])
    assert r.exit_code == 2 and "protocol" in r.output and not (tmp_path / "d").exists()
    bad = CliRunner().invoke(app, ["eval", "--shard", "1of2", "--out", str(tmp_path / "e")])
    assert bad.exit_code == 2 and "k/n" in bad.output


def test_a_run_can_gain_the_auto_ratio_on_resume_and_keeps_its_options(engine, tmp_path):
    """Only auto rows depend on the auto options: a run without them may add `--auto-methods` later (and a
    resume without auto keeps the options its auto rows were made with); changing them is still refused."""
    base = dict(tasks=["niah_single_essay"], methods=["prophet"], ratios=[0.2], n=1)
    rows = run_eval(engine, _cfg(**base), tmp_path, progress=False)
    assert "auto" not in json.loads((tmp_path / "run.json").read_text())["protocol"]
    auto = {"schedule": [0.2], "min_p": 0.5, "tol": 0.0, "min_context": 0}
    more = run_eval(engine, _cfg(**base, auto_methods=["prophet"], auto=auto), tmp_path, progress=False)
    assert sorted(map(str, (r["ratio"] for r in more if r["method"] == "prophet"))) == ["0.2", "auto"]
    assert len(more) == len(rows) + 1  # only the auto row was run
    proto = json.loads((tmp_path / "run.json").read_text())["protocol"]
    assert proto["auto"]["min_p"] == 0.5 and proto["auto"]["schedule"] == [0.2]
    run_eval(engine, _cfg(**base), tmp_path, progress=False)  # a resume without auto: fine, options kept
    assert json.loads((tmp_path / "run.json").read_text())["protocol"]["auto"]["min_p"] == 0.5
    with pytest.raises(kvstitch.InputError, match="protocol"):
        run_eval(engine, _cfg(**base, auto_methods=["prophet"], auto={**auto, "min_p": 0.9}), tmp_path, progress=False)
    assert len(read_jsonl(tmp_path / RESULTS)) == len(more)
    assert "min_p" not in EvalConfig(tasks=[], lengths=[], methods=[], ratios=["auto"]).protocol()["auto"]


def test_dtype_flag_reaches_the_engine_and_a_run_keeps_one_dtype(engine, tmp_path, monkeypatch):
    """`--dtype bfloat16` loads a bf16 engine; its run directory then refuses a float32 engine (the dtype is part
    of the model fingerprint), with a message naming both dtypes."""
    from kvstitch.engine import Engine
    from kvstitch.cli.eval import eval_command
    from kvstitch.store import MemoryStore

    seen = []

    def load(cls, *a, **k):
        seen.append(k.get("dtype"))
        model = copy.deepcopy(engine.model).to(torch.bfloat16) if k.get("dtype") == "bfloat16" else engine.model
        return Engine(model, engine.tokenizer, weights_id="tiny-llama", store=MemoryStore(storage_dtype="float32"))

    monkeypatch.setattr(Engine, "load", classmethod(load))
    app = typer.Typer()
    app.command("eval")(eval_command)
    app.command("noop")(lambda: None)
    args = ["eval", "--tasks", "niah_single_essay", "--length", "160", "--chunk-tokens", "64", "--methods", "random",
            "--ratios", "0.2", "--n", "1", "--max-new-tokens", "4", "--out", str(tmp_path / "bf")]
    r = CliRunner().invoke(app, [*args, "--dtype", "bfloat16"])
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "bf" / "run.json").read_text())["model"]["dtype"] == "bfloat16"
    r = CliRunner().invoke(app, args)
    assert seen == ["bfloat16", None]
    assert r.exit_code != 0 and "bfloat16" in str(r.exception) and "float32" in str(r.exception)
