"""`kvstitch` CLI end to end on the embedded model, and its one-line errors."""

import pytest
from typer.testing import CliRunner

from kvstitch.cli import app

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
    assert "auto: " in r.output and ("converged in" in r.output or "no convergence" in r.output)


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


def test_demo_answers_bundled_questions_with_full_and_stitched():
    """The README's first command: every bundled question, both answers marked against the expected text,
    TTFT side by side. SmolLM2 with full prefill gets at least the two plainly stated facts."""
    r = runner.invoke(app, ["demo", "--method", "prophet", "--ratio", "0.2"], env={"COLUMNS": "250"})
    assert r.exit_code == 0, r.output
    assert "Carn Dubh" in r.output and "TTFT prophet" in r.output and "speedup" in r.output
    line = next(x for x in r.output.splitlines() if x.startswith("answers containing the expected text"))
    n_full = int(line.split("full ")[1].split("/")[0])
    assert n_full >= 2, line
    assert r.output.count("✓") + r.output.count("✗") == 2 * 4
