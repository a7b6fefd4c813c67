"""`kvstitch bench serve` on a tiny setting: a real loopback server, batched vs serial, answers vs alone."""

import json

import pytest

from typer.testing import CliRunner

from kvstitch.bench.ttft import write_results
from kvstitch.bench.serve import bench_serve, request_mix, serve_table

from .conftest import make_tiny_engine


def test_bench_serve_rows_tiny(smollm_tokenizer, tmp_path):
    eng = make_tiny_engine("llama", smollm_tokenizer)
    bodies = request_mix(eng, 6, docs=4, doc_tokens=48, docs_per_request=2, max_tokens=8)
    assert len({json.dumps(b["documents"]) for b in bodies}) > 1 and {b["method"] for b in bodies} == {"prophet", "random"}
    rows = bench_serve(eng, [1, 3], n_requests=6, docs=4, doc_tokens=48, docs_per_request=2, max_tokens=8,
                       max_batch=4, max_queue=1)
    assert [(r["server"].split()[0], r["concurrency"]) for r in rows] == [("batched", 1), ("batched", 3), ("serial", 3)]
    for r in rows:
        assert r["answered"] == r["requests"] == 6 and r["lost"] == 0
        assert r["answers_equal_alone"] is True and r["mismatches"] == 0
        assert r["completion_tokens"] > 0 and r["completion_tokens_per_s"] > 0 and r["requests_per_s"] > 0
        assert 0 < r["ttft_p50_s"] <= r["ttft_p95_s"] and 0.0 <= r["rate_429"] < 1.0
    # the serial server with max_queue=1 refuses some of 3 concurrent clients: retried, none lost
    assert rows[2]["n_429"] > 0 and rows[2]["rate_429"] > 0
    assert "speedup_vs_serial" in rows[1] and "speedup_vs_serial" not in rows[0]
    assert rows[0]["prefill_batch"] == 1.0 and rows[2]["prefill_batch"] == 1.0 == rows[2]["decode_batch"]
    assert rows[1]["prefill_batch"] >= 1.0 and rows[1]["decode_batch"] >= 1.0
    table = serve_table(rows)
    assert table.count("\n") == 1 + len(rows) and "yes" in table
    write_results(rows, tmp_path, "bench_serve", table)
    assert json.loads((tmp_path / "bench_serve.json").read_text())["rows"][1]["concurrency"] == 3


def test_bench_serve_cli_help():
    from kvstitch.cli.main import app

    r = CliRunner().invoke(app, ["bench", "serve", "--help"])
    assert r.exit_code == 0 and "--concurrency" in r.output and "--max-batch" in r.output
    assert "--decode" in r.output and "--context" in r.output and "--kv-pool-bytes" in r.output
    r = CliRunner().invoke(app, ["bench", "serve", "--dtype", "int3", "--out", "/nowhere"])
    assert r.exit_code == 2 and "unknown dtype" in r.output  # --dtype reaches Engine.load, checked before the model


def test_bench_serve_long_context_sparse_vs_dense(smollm_tokenizer, tmp_path):
    """Long-context mode: documents of each request's own, a sweep per decode policy, each policy's answers
    compared with its own concurrency-1 answers, recall / selected fraction / memory on the sparse rows."""
    from kvstitch.bench.serve import DENSE, long_context_mix

    eng = make_tiny_engine("llama", smollm_tokenizer)
    bodies = long_context_mix(eng, 3, context=600, doc_tokens=100, max_tokens=6)
    chunk_sets = [set(b["documents"]) for b in bodies]
    assert all(not (chunk_sets[i] & chunk_sets[j]) for i in range(3) for j in range(i + 1, 3))  # nothing shared
    assert all(b["max_tokens"] == b["min_tokens"] == 6 and sum(len(d) for d in b["documents"]) > 1000 for b in bodies)
    rows = bench_serve(eng, [1, 3], n_requests=3, doc_tokens=100, max_tokens=6, methods=("random",),
                       max_batch=4, decode=(DENSE, "prkv"), context=600, kv_budget=128, recall_sample=0.5,
                       kv_pool_bytes=1 << 30)
    assert [(r["decode"], r["server"].split()[0], r["concurrency"]) for r in rows] == [
        (DENSE, "batched", 1), (DENSE, "batched", 3), (DENSE, "serial", 3), ("prkv", "batched", 1), ("prkv", "batched", 3)]
    for r in rows:
        assert r["answered"] == 3 and r["lost"] == 0 and r["answers_equal_alone"] is True
        assert r["completion_tokens"] == 3 * 6  # min_tokens: every answer as long as max_tokens
        assert r["tpot_p50_s"] > 0 and r["tpot_p50_s"] <= r["tpot_p95_s"]
        assert r["peak_rss_bytes"] > 0 and 0 < r["kv_pool_peak_bytes"] <= r["kv_pool_limit_bytes"] == 1 << 30
        assert r["vs_dense"] > 0 and r["decode_vs_dense"] > 0 and r["decode_tok_per_s"] > 0, r
    dense, sparse = rows[0], rows[3]
    assert dense["recall"] != dense["recall"] and dense["selected_fraction"] != dense["selected_fraction"]  # NaN
    assert 0.0 < sparse["recall"] <= 1.0 + 1e-6 and 0.0 < sparse["selected_fraction"] < 1.0
    assert rows[0]["vs_dense"] == 1.0 and rows[4]["decode_batch"] >= 1.0
    # the bytes-read bound beside each sparse row: its mean batch, context + half the answer, k + window
    assert "bound" not in dense and sparse["bound_batch"] == sparse["decode_batch"] and sparse["bound_context"] == 603
    assert sparse["bound_attended"] == 128 + 64 and sparse["bound"] > 1.0
    assert sparse["bound"] == pytest.approx(sparse["bound_dense_bytes"] / sparse["bound_sparse_bytes"])
    table = serve_table(rows)
    assert table.count("\n") == 1 + len(rows) and "prkv" in table and "recall" in table.splitlines()[0]
    assert "bytes bound" in table.splitlines()[0] and f"| {sparse['bound']:.2f} |" in table


def test_bench_serve_refuses_bad_sweeps(smollm_tokenizer):
    from kvstitch.core.errors import InputError

    eng = make_tiny_engine("llama", smollm_tokenizer)
    for kw in ({"concurrency": [0]}, {"concurrency": [1], "decode": ()}):
        with pytest.raises(InputError):
            bench_serve(eng, **{"n_requests": 1, **kw})
