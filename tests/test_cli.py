"""`kvstitch` CLI end to end on the embedded model, and its one-line errors."""

import pytest
from typer.testing import CliRunner

from kvstitch.cli.main import app

from .conftest import SAMPLE_CHUNKS, SAMPLE_QUESTION

runner = CliRunner()


@pytest.fixture(scope="module")
def chunk_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("chunks")
    paths = []
    for i, text in enumerate(SAMPLE_CHUNKS):
        p = d / f"c{i}.txt"
        p.write_text(text)
        paths.append(str(p))
    return paths


def _chunk_args(paths):
    return [a for p in paths for a in ("--chunk", p)]


def test_methods_lists_registry():
    r = runner.invoke(app, ["methods"])
    assert r.exit_code == 0
    for name in ("full", "naive", "random"):
        assert name in r.output


def test_ask_end_to_end_with_compare(chunk_files):
    r = runner.invoke(app, ["ask", SAMPLE_QUESTION, *_chunk_args(chunk_files), "--method", "random",
                            "--ratio", "0.5", "--compare", "full", "--max-new-tokens", "16"])
    assert r.exit_code == 0, r.output
    assert "74123" in r.output  # SmolLM2 finds the number with full prefill
    assert "speedup of random over full" in r.output and "TTFT" in r.output


def test_ask_auto_reports_the_budget_it_used(chunk_files):
    r = runner.invoke(app, ["ask", SAMPLE_QUESTION, *_chunk_args(chunk_files), "--method", "prophet",
                            "--ratio", "auto", "--max-new-tokens", "16"], env={"COLUMNS": "250"})
    assert r.exit_code == 0, r.output
    assert "auto: " in r.output and any(x in r.output for x in ("converged in", "no convergence", "short context"))


@pytest.mark.parametrize("args,message", [
    (["", "--method", "random"], "question is empty"),
    (["Q?", "--method", "nope"], "unknown method 'nope'; known methods:"),
    (["Q?", "--ratio", "1.5", "--method", "random"], "recompute_ratio must be a number in [0, 1] or 'auto'"),
    (["Q?", "--ratio", "fast", "--method", "random"], "recompute_ratio must be a number in [0, 1] or 'auto'"),
    (["Q?", "--ratio", "auto", "--method", "naive"], "does not rank context tokens"),
])
def test_ask_bad_input_is_one_clear_line(args, message, chunk_files):
    r = runner.invoke(app, ["ask", *args, *_chunk_args(chunk_files)])
    assert r.exit_code == 2
    assert message in r.output
    assert "Traceback" not in r.output


def test_ask_missing_chunk_file(tmp_path):
    r = runner.invoke(app, ["ask", "Q?", "--chunk", str(tmp_path / "missing.txt"), "--method", "random"])
    assert r.exit_code == 2 and "does not exist" in r.output and "Traceback" not in r.output


def test_ask_unreadable_model_path(chunk_files, tmp_path):
    r = runner.invoke(app, ["ask", "Q?", *_chunk_args(chunk_files), "--method", "random",
                            "--model", str(tmp_path / "nowhere.gguf")])
    assert r.exit_code == 2 and "does not exist" in r.output


@pytest.mark.long
def test_demo_answers_bundled_questions_with_full_and_stitched():
    """The README's first command, here on SmolLM2 (its default model is Qwen2.5 0.5B, too slow for this suite):
    every bundled question, full prefill and the default stitched setting (deltaprop, auto verified by a short
    full prefill) side by side with the budget each used, agreement with full prefill, and a fixed-20% contrast
    line, legible in 80 columns."""
    import json
    from importlib import resources

    bundled = json.loads(resources.files("kvstitch").joinpath("data/samples/demo.json").read_text())["questions"]
    n = 3  # of the six: enough for every line, half the time
    r = runner.invoke(app, ["demo", "--model", "smollm2", "--questions", str(n)], env={"COLUMNS": "80"})
    assert r.exit_code == 0, r.output
    assert max(len(x) for x in r.stdout.splitlines()) <= 80  # legible in an 80-column terminal (progress bars: stderr)
    assert "Larkspur" in r.output and "full prefill" in r.output and "recomputed" in r.output
    from kvstitch.engine.engine import fast_dtype

    assert f"smollm2 ({fast_dtype()})" in r.output  # the dtype it ran in: the CPU's fast one
    assert bundled[n - 1]["question"] in " ".join(r.output.split()) and bundled[n]["question"] not in r.output
    line = " ".join(r.output.split())
    full_right = int(line.split("answers containing the expected text: full ")[1].split("/")[0])
    assert 0 <= full_right <= n
    agree = int(line.split("deltaprop auto says what full prefill says (first 12 words) in ")[1].split("/")[0])
    assert 0 <= agree <= n and "at a fixed 20%: says what full prefill says in " in line
    assert line.count("same answer") + line.count("DIFFERENT answer") == n
    assert r.output.count("✓") + r.output.count("✗") == 2 * n
    # every stitched answer was decided by the verification: confirmed (a round) or overruled (full prefill)
    assert line.count("confirmed by a full prefill of 2 passages") + line.count(": full prefill answered") == n


@pytest.mark.parametrize("args, message", [(["--auto-schedule", "0.1,x"], "--auto-schedule"),
                                           (["--auto-verify-chunks", "-1"], "verify_chunks"),
                                           (["--ratio", "2"], "recompute_ratio"),
                                           (["--questions", "0"], "--questions"),
                                           (["--dtype", "int3"], "unknown dtype")])
def test_demo_rejects_bad_options_before_loading(args, message):
    r = runner.invoke(app, ["demo", "--model", "/nowhere/model.gguf", *args])
    assert r.exit_code == 2 and message in r.output and "Traceback" not in r.output


REYNE = ["The Reyne Tower in Alder Bay was designed and built by the engineer Tomas Reyne.",
         "Construction of the Reyne Tower finished in 1891, after six years of work.",
         "Alder Bay is a fishing town known for its winter market and its lighthouse."]


def test_ask_conversation_with_system_and_messages(tmp_path):
    import json

    history = tmp_path / "history.json"
    history.write_text(json.dumps([{"role": "user", "content": "Who built the Reyne Tower?"},
                                   {"role": "assistant", "content": "Tomas Reyne."}]))
    files = []
    for i, text in enumerate(REYNE):
        (tmp_path / f"r{i}.txt").write_text(text)
        files += ["--chunk", str(tmp_path / f"r{i}.txt")]
    r = runner.invoke(app, ["ask", "When?", "--messages", str(history), "--system",
                            "You are a helpful assistant. Answer briefly.", *files, "--method", "random",
                            "--ratio", "1.0", "--max-new-tokens", "16"])
    assert r.exit_code == 0, r.output
    assert "1891" in r.output  # the history says what "When?" is about


@pytest.mark.parametrize("args,message", [
    ([], "pass a QUESTION"),
    (["--messages", "MISSING"], "does not exist"),
    (["--messages", "BADJSON"], "is not valid JSON"),
    (["--messages", "SYSTEM", "--system", "x"], "already starts with a system message"),
    (["--messages", "SYSTEM"], "no 'user' message"),
    (["Q?", "--system", "x", "--compare", "full"], "--compare needs passages"),
    (["Q?", "--system", "x", "--dtype", "int3"], "unknown dtype"),  # --dtype reaches Engine.load, checked first
])
def test_ask_conversation_errors_are_one_clear_line(args, message, tmp_path):
    (tmp_path / "bad.json").write_text("[{")
    (tmp_path / "sys.json").write_text('[{"role": "system", "content": "s"}]')
    paths = {"MISSING": str(tmp_path / "missing.json"), "BADJSON": str(tmp_path / "bad.json"),
             "SYSTEM": str(tmp_path / "sys.json")}
    r = runner.invoke(app, ["ask", *[paths.get(a, a) for a in args]])
    assert r.exit_code == 2, r.output
    assert message in r.output and "Traceback" not in r.output


@pytest.mark.parametrize("args, says", [
    (["--dataset", "squad", "--samples", "100:120", "--n", "50"], "give one"),
    (["--dataset", "musique", "--passages", "10"], "--passages builds"),
    (["--passages", "10"], "generated tasks take --n"),
    (["--samples", "0:5"], "generated tasks take --n"),
    (["--dataset", "squad", "--samples", "20000:"], "outside"),
])
def test_eval_sample_flags_fail_before_the_model_loads(args, says):
    r = runner.invoke(app, ["eval", "--model", "/nowhere/model.gguf", *args])
    assert r.exit_code == 2 and says in r.output and "Traceback" not in r.output


def test_bench_methods_keep_the_commas_inside_a_spec(monkeypatch, tmp_path):
    """`--methods 'deltaprop(base=infoflow,alpha_k=0.5),prophet'` is two methods, as everywhere else."""
    import kvstitch.bench.ttft as ttft
    import kvstitch.cli.bench as bench_cli

    seen = {}

    def fake_bench(eng, lengths, methods, *args, **kwargs):
        seen["methods"] = methods
        return []

    monkeypatch.setattr(ttft, "bench_ttft", fake_bench)
    monkeypatch.setattr(ttft, "ttft_table", lambda rows: "")
    monkeypatch.setattr(ttft, "write_results", lambda *a, **k: None)
    monkeypatch.setattr(bench_cli, "load_engine", lambda *a, **k: type("E", (), {"cold_path": None, "adapter": None,
                                                                                  "device": "cpu", "dtype": "f",
                                                                                  "store": None})())
    res = runner.invoke(app, ["bench", "ttft", "--methods", "deltaprop(base=infoflow,alpha_k=0.5),prophet",
                              "--out", str(tmp_path)])
    assert seen["methods"] == ["deltaprop(base=infoflow,alpha_k=0.5)", "prophet"], res.output
