"""`kvstitch calibrate`: measurement, perfect-signal frontier, the config it writes and who reads it."""

import json

import pytest
import typer
from typer.testing import CliRunner

from kvstitch.eval.calibrate import Config, calibrate, configs, frontier_at, parse_auto, perfect_frontier, write_config
from kvstitch.cli.main import app
from kvstitch.core.errors import BadAutoOption, InputError, KVStitchDeprecationWarning
from kvstitch.engine.budget import AutoBudget
from kvstitch.tasks.datasets import load_dataset
from kvstitch.serve.config import load_toml, read_answer_settings, read_config

from .conftest import SAMPLE_CHUNKS, make_tiny_engine


def _dataset(tmp_path, n=2):
    recs = [{"question": f"What is the special magic number for Carol? ({i})", "answers": ["74123"],
             "ctxs": [{"title": f"p{j}", "text": c} for j, c in enumerate(SAMPLE_CHUNKS)]} for i in range(n)]
    p = tmp_path / "mine.json"
    p.write_text(json.dumps(recs))
    return p


def _serve_params(path):
    """What `kvstitch serve --config path` parses (callbacks run, the server does not start)."""
    cmd = typer.main.get_command(app).commands["serve"]
    return cmd.make_context("serve", ["--config", str(path)]).params


def test_calibrate_writes_a_config_serve_and_ask_read(tmp_path, smollm_tokenizer):
    eng = make_tiny_engine("llama", smollm_tokenizer)
    samples = load_dataset(str(_dataset(tmp_path)))
    cfgs = configs(["prophet", "deltaprop"], [0.2, 0.5], [parse_auto("schedule=0.2/0.5,tol=0.5,min_context=0")])
    conf = tmp_path / "kvstitch.toml"
    conf.write_text('port = 9001\nmethod = "naive"\n')  # a user's file: its other keys stay
    rep = calibrate(eng, samples, cfgs, tmp_path / "out", target=0.5, config_path=conf, model="smollm2",
                    dataset="mine.json")
    assert (tmp_path / "out" / "frontier.png").stat().st_size > 0
    assert "perfect" in (tmp_path / "out" / "calibration.md").read_text().lower()
    rows = [json.loads(x) for x in (tmp_path / "out" / "rows.jsonl").read_text().splitlines()]
    assert len(rows) == 2 * (1 + len(cfgs))  # full + every configuration, per sample
    chosen = rep["chosen"]
    data = load_toml(conf)
    assert data["port"] == 9001 and data["model"] == "smollm2"
    assert data["calibration"]["agreement"] == pytest.approx(chosen["agreement"], abs=1e-4)
    assert data["calibration"]["n"] == 2 and data["calibration"]["configuration"] == chosen["config"]
    c = next(c for c in cfgs if c.label == chosen["config"])
    assert data["method"] == c.method
    params = _serve_params(conf)  # serve accepts the file (the [calibration] record is not an option)
    assert params["method"] == c.method and params["port"] == 9001
    assert str(params["ratio"]) == str(c.ratio if c.ratio == "auto" else float(c.ratio))
    if c.ratio == "auto":  # the [auto] table reaches serve as its auto spec
        assert params["auto"] == AutoBudget.of(c.auto).spec
    assert read_answer_settings(conf)["method"] == c.method  # ask --config
    # a rerun resumes: nothing measured again
    again = calibrate(eng, samples, cfgs, tmp_path / "out", target=0.5, config_path=None)
    assert len((tmp_path / "out" / "rows.jsonl").read_text().splitlines()) == len(rows)
    assert again["chosen"]["config"] == chosen["config"]


def test_an_auto_table_reaches_serve_as_its_auto_option(tmp_path):
    conf = tmp_path / "c.toml"
    write_config(conf, {"method": "deltaprop", "ratio": "auto", "auto": {"schedule": [0.05, 0.1], "tol": 0.02}},
                 {"agreement": 0.9, "n": 3})
    params = _serve_params(conf)
    assert params["ratio"] == "auto" and params["auto"] == "auto(tol=0.02)"  # the table as its canonical spec
    from kvstitch.cli.serve import parse_auto_option

    assert parse_auto_option(params["auto"]) == AutoBudget(schedule=(0.05, 0.1), tol=0.02)
    assert parse_auto_option("tol=0.02") == parse_auto_option("auto:tol=0.02") == AutoBudget(tol=0.02)
    with pytest.warns(KVStitchDeprecationWarning, match="--auto as JSON is deprecated"):
        assert parse_auto_option('{"tol": 0.02}') == AutoBudget(tol=0.02)  # JSON: still read, once more
    with pytest.raises(BadAutoOption, match="--auto: unknown auto option"):
        parse_auto_option("auto(bogus=1)")
    # choosing a fixed ratio later drops the stale auto table
    write_config(conf, {"method": "prophet", "ratio": 0.2, "auto": None}, {"agreement": 0.5, "n": 3})
    data = load_toml(conf)
    assert data["ratio"] == 0.2 and "auto" not in data
    with pytest.raises(InputError, match="unknown option"):
        read_config(conf, {"method"})  # names a command does not know are still refused (the record is not one)


def test_calibrate_rejects_a_dataset_it_cannot_parse(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('[{"question": "q?", "answers": []}]')
    res = CliRunner().invoke(app, ["calibrate", "--dataset", str(bad), "--out", str(tmp_path / "o")])
    assert res.exit_code == 2 and "answers" in res.output
    assert not (tmp_path / "o").exists()  # refused before the model loads or anything is written
    res = CliRunner().invoke(app, ["calibrate", "--dataset", str(tmp_path / "missing.json")])
    assert res.exit_code == 2
    res = CliRunner().invoke(app, ["calibrate", "--dataset", "musique", "--auto", "schedule=0.2,nope=1"])
    assert res.exit_code == 2 and "nope" in res.output


def test_perfect_signal_frontier():
    """Two samples: A agrees at 0.1 (1 s), B agrees at nothing fixed (full prefill, 10 s); 0.1 costs 1 s, 0.2 2 s."""
    def row(s, c, t, a):
        return {"sample": s, "config": c, "ttft_s": t, "agree": a}

    rows = [row("A", "full", 10, True), row("A", "m@0.1", 1, True), row("A", "m@0.2", 2, True),
            row("B", "full", 10, True), row("B", "m@0.1", 1, False), row("B", "m@0.2", 2, False)]
    pts = perfect_frontier(rows, ["m@0.1", "m@0.2"])
    assert pts[0] == pytest.approx((1.0, 10 / 5.5))  # agreement 1: A at 1 s, B by full prefill
    assert pts[1] == pytest.approx((0.5, 10 / 1.0))  # give B up: both at the cheapest ratio
    assert len(pts) == 2
    assert frontier_at(pts, 0.7) == pytest.approx(10 / 5.5) and frontier_at(pts, 0.5) == pytest.approx(10.0)


def test_configs_and_auto_settings_are_checked():
    assert [c.label for c in configs(["prophet"], [0.2], [{"schedule": [0.05, 0.1]}])] == \
        ["prophet@0.2", "prophet@auto(schedule=0.05/0.1)"]
    with pytest.raises(InputError):
        configs(["nope"], [0.2], [])
    with pytest.raises(InputError):
        configs(["prophet"], [1.5], [])
    with pytest.raises(InputError):
        parse_auto("schedule=0.2/0.1")  # not increasing
    assert parse_auto('{"tol": 0.02}') == {"tol": 0.02}
    assert Config("deltaprop", 0.2).label == "deltaprop@0.2"
