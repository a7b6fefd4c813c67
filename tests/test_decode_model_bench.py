"""`kvstitch bench decode` (kvstitch.bench.decode) on tiny random models: rows, recall, CLI, errors."""

import json

import pytest
import torch
from typer.testing import CliRunner

from kvstitch import InputError
from kvstitch.cli.main import app
from kvstitch.bench.decode import bench_decode_model
from kvstitch.bench.decode_table import decode_table

from .conftest import SAMPLE_CHUNKS, SAMPLE_QUESTION, make_tiny_engine

POLICIES = ["prkv", "quest", "snapkv", "arkvale", "shadowkv"]
runner = CliRunner()


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_rows_for_every_policy_and_budget_and_dense_budget_recall_is_one(family, smollm_tokenizer):
    eng = make_tiny_engine(family, smollm_tokenizer)
    full_rank = {"shadowkv": {"rank": eng.adapter.num_kv_heads * eng.adapter.head_dim}}  # exact at 4096
    rows, meta = bench_decode_model(eng, context=320, budgets=[96, 4096], policies=POLICIES, n_niah=2,
                                    new_tokens=4, page_size=8, warmup=1, progress=False, policy_options=full_rank)
    assert rows[0]["policy"] == "dense" and rows[0]["budget"] is None
    assert rows[0]["tpot_ms"] > 0 and rows[0]["niah_n"] == 2
    # a floor row per sparse budget (dense decode over k + window tokens), none for the dense budget
    assert [(r["budget"], r["policy"]) for r in rows[1:]] == (
        [(96, "floor")] + [(b, p) for b in (96, 4096) for p in POLICIES])
    floor = rows[1]
    assert floor["mean_selected_tokens"] == 96 + 64 and floor["tpot_ms"] > 0 and floor["recall"] is None
    assert floor["tpot_vs_full"] == pytest.approx(floor["tpot_ms"] / floor["full_tpot_ms"])
    assert "| floor | 96 |" in decode_table(rows, meta)
    assert not meta["capped"] and meta["prompt_tokens"] > meta["context_tokens"] > 250
    for r in rows[2:]:
        assert 0.0 <= r["recall"] <= r["oracle_recall"] + 1e-5 <= 1.0 + 2e-5
        # no per-KV-head choice beats the shared top-k; sharing cannot beat each query head choosing alone
        assert r["recall"] <= r["oracle_recall_kv"] + 1e-5 <= r["oracle_recall"] + 2e-5
        assert 0.0 <= r["top1_agreement"] <= 1.0
        if r["budget"] == 4096:  # covers prompt + new tokens: every policy attends densely
            assert abs(r["recall"] - 1.0) < 1e-5 and r["max_abs_err_vs_dense"] < 1e-4
            assert r["tpot_ms"] is None and r["niah_acc"] is None and "dense" in r["note"]
        else:
            assert r["recall"] < 1.0 and r["mean_selected_tokens"] <= 96 + 64  # k + the local window
            assert r["tpot_ms"] > 0 and r["tpot_vs_full"] > 0 and r["niah_n"] == 2
            assert r["tpot_vs_full"] == pytest.approx(r["tpot_ms"] / r["full_tpot_ms"])
            # the TPOT-ratio floor of the bytes read: weights + k + window tokens over weights + the cache
            assert r["bound_attended"] == 96 + 64 and 0 < r["bound_tpot"] < 1
            assert r["bound_context"] == meta["prompt_tokens"] + 2  # + half the 4 decode steps
    assert rows[1]["bound_tpot"] == pytest.approx(rows[2]["bound_tpot"])  # the floor row attends as many
    assert "bytes bound" in decode_table(rows, meta)
    assert "| prkv | 96 |" in decode_table(rows, meta) and "counted as the PRKV paper counts it" in decode_table(rows, meta)
    assert meta["observation_window"] == 64 and meta["page_size"] == 8
    assert len(meta["reference_tokens"]) == 5


def test_context_above_the_model_limit_is_capped_and_reported(smollm_tokenizer, monkeypatch):
    eng = make_tiny_engine("llama", smollm_tokenizer)
    monkeypatch.setattr(eng.adapter.config, "max_position_embeddings", 600)
    rows, meta = bench_decode_model(eng, context=5000, budgets=[96], policies=["quest"], n_niah=0,
                                    new_tokens=2, page_size=8, progress=False)
    assert meta["capped"] and meta["context_requested"] == 5000
    assert meta["context_tokens"] <= 600 - 256 + 20 and rows[-1]["context_tokens"] == meta["context_tokens"]
    assert "capped" in decode_table(rows, meta) and rows[0]["niah_acc"] is None


@pytest.mark.parametrize("kwargs,message", [
    (dict(budgets=[]), "at least one kv budget"),
    (dict(budgets=[0]), "kv budget must be an integer"),
    (dict(budgets=[16]), "smaller than the sink"),
    (dict(policies=["bogus"]), "unknown decode policy"),
    (dict(policies=["full"]), "at least one sparse decode policy"),
    (dict(context=0), "context must be"),
    (dict(new_tokens=0), "new_tokens must be"),
    (dict(n_niah=-1), "n_niah must be"),
    (dict(batch=0), "batch must be"),
    (dict(task="nope"), "unknown task"),
    (dict(method="ape"), "changes decode attention"),
    (dict(policy_options={"prkv": {"bogus": 1}}), "bad options for decode policy"),
])
def test_bad_input_is_refused_before_any_work(kwargs, message, smollm_tokenizer):
    eng = make_tiny_engine("llama", smollm_tokenizer)
    args = dict(context=300, budgets=[128], policies=["prkv"], n_niah=1, new_tokens=2, progress=False)
    with pytest.raises(InputError, match=message):
        bench_decode_model(eng, **{**args, **kwargs})


@pytest.mark.parametrize("tiny_engine", ["llama"], indirect=True)
def test_generate_diagnostic_option_reports_recall(tiny_engine):
    res = tiny_engine.generate(SAMPLE_QUESTION, SAMPLE_CHUNKS * 3, method="full", max_new_tokens=4, decode="quest",
                               kv_budget=96, decode_options={"diagnostic": True, "page_size": 8})
    assert 0 < res.stats["decode_recall"]["recall"] <= res.stats["decode_recall"]["oracle_recall"] + 1e-6
    assert res.stats["decoder"]["page_size"] == 8 and res.stats["kv_budget"] == 96
    plain = tiny_engine.generate(SAMPLE_QUESTION, SAMPLE_CHUNKS * 3, method="full", max_new_tokens=4,
                                 decode="quest", kv_budget=96, decode_options={"page_size": 8})
    assert plain.token_ids == res.token_ids and "decode_recall" not in plain.stats
    for opts, message in [({"diagnostic": "yes"}, "diagnostic"), ({"bogus": 1}, "bad options"),
                          ({"page_size": 64}, "smaller than the sink")]:
        with pytest.raises(InputError, match=message):
            tiny_engine.generate(SAMPLE_QUESTION, SAMPLE_CHUNKS, method="full", decode="quest", kv_budget=96,
                                 decode_options=opts)
    with pytest.raises(InputError, match="decode='dense'"):
        tiny_engine.generate(SAMPLE_QUESTION, SAMPLE_CHUNKS, method="full", decode_options={"diagnostic": True})


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory, smollm_tokenizer):
    d = tmp_path_factory.mktemp("tiny-llama")
    eng = make_tiny_engine("llama", smollm_tokenizer)
    eng.model.save_pretrained(str(d))
    smollm_tokenizer.save_pretrained(str(d))
    return d


def test_cli_writes_json_and_markdown(tiny_model_dir, tmp_path):
    r = runner.invoke(app, ["bench", "decode", "--context", "300", "--budget", "96,128", "--policies", "prkv,quest",
                            "--niah", "1", "--new-tokens", "3", "--page-size", "8",
                            "--policy-option", "prkv.group_reduce=max", "-o", "prkv.static_ratio=0.5",
                            "--model", str(tiny_model_dir), "--out", str(tmp_path)])
    assert r.exit_code == 0, r.output
    data = json.loads((tmp_path / "bench_decode.json").read_text())
    assert [(row["policy"], row["budget"]) for row in data["rows"]] == [
        ("dense", None), ("floor", 96), ("prkv", 96), ("quest", 96), ("floor", 128), ("prkv", 128), ("quest", 128)]
    assert data["meta"]["model_name"] == str(tiny_model_dir)
    assert data["meta"]["policy_options"] == {"prkv": {"group_reduce": "max", "static_ratio": 0.5}}
    md = (tmp_path / "bench_decode.md").read_text()
    assert "| quest | 128 |" in md and "TPOT" in md


@pytest.mark.parametrize("args,message", [
    (["--budget", "a,b"], "--budget takes comma-separated integers"),
    (["--policies", "nope"], "unknown decode policy"),
    (["--threads", "0"], "--threads must be"),
    (["--policy-option", "static_ratio=0.5"], "--policy-option takes POLICY.FIELD=VALUE"),
    (["--policies", "prkv", "-o", "quest.window=32"], "not benchmarked"),
    (["--policy-option", "quest.static_ratio=0.5"], "bad options for decode policy 'quest'"),
    (["--policy-option", "prkv.bogus=1"], "bad options for decode policy"),
])
def test_cli_bad_input_is_one_clear_line(args, message, tiny_model_dir, tmp_path):
    r = runner.invoke(app, ["bench", "decode", "--context", "300", "--model", str(tiny_model_dir),
                            "--out", str(tmp_path), *args])
    assert r.exit_code == 2, r.output
    assert message in r.output and "Traceback" not in r.output
    assert not (tmp_path / "bench_decode.json").exists()


def test_floor_cache_holds_the_prompts_last_tokens(smollm_tokenizer):
    """The floor runner's cache is the prompt's last n tokens, and dense decode over it attends n + 1 keys."""
    from kvstitch.bench.decode import _Sample
    from kvstitch.tasks.tasks import generate

    eng = make_tiny_engine("llama", smollm_tokenizer)
    count = lambda t: len(eng.tokenizer.encode(t, add_special_tokens=False))  # noqa: E731
    smp = generate("niah_multikey", 1, 200, 64, 0, count)[0]
    s = _Sample(eng, smp, "full", 0.2, 8, None)
    cache, dec = s.floor_runner(40, 4)
    assert dec is None and cache.length == 40
    for mine, full in zip(cache.layers, s.cache.layers):
        assert torch.equal(mine.keys[0, :, :40], full.keys[0, :, s.n - 40:s.n])
        assert torch.equal(mine.values[0, :, :40], full.values[0, :, s.n - 40:s.n])
    eng.decode_step(cache, 5)
    assert cache.length == 41


def test_batch_times_batched_steps_of_distinct_rows(smollm_tokenizer):
    """``batch=2``: every timed step of dense, the floor and each policy is one batched step of two rows, each
    row with its own cache (and decoder), and the bound is the one for two rows."""
    from kvstitch.bench.bound import bytes_bound, model_bytes

    eng = make_tiny_engine("llama", smollm_tokenizer)
    calls = []
    run = eng.decode_batch

    def spy(steps, *args, **kwargs):
        calls.append([(id(s.cache), id(s.decoder) if s.decoder is not None else None) for s in steps])
        return run(steps, *args, **kwargs)

    eng.decode_batch = spy
    rows, meta = bench_decode_model(eng, context=320, budgets=[96], policies=["prkv", "quest"], n_niah=0,
                                    new_tokens=4, page_size=8, warmup=1, batch=2, progress=False)
    assert meta["batch"] == 2 and "batched steps of 2 copies" in decode_table(rows, meta)
    assert len(calls) == 4 * 4  # dense, floor, prkv, quest x 4 steps
    assert all(len(c) == 2 and len({row[0] for row in c}) == 2 for c in calls)
    sparse = [c for c in calls if c[0][1] is not None]
    assert len(sparse) == 2 * 4 and all(len({row[1] for row in c}) == 2 for c in sparse)
    for r in rows[1:]:
        assert r["tpot_ms"] > 0 and r["bound_batch"] == 2
        bound = bytes_bound(model_bytes(eng), r["bound_context"], 2, r["bound_attended"])
        assert r["bound_tpot"] == pytest.approx(bound["bound_tpot"])
