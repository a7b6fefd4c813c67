"""`kvstitch bench serve` on a tiny setting: a real loopback server, batched vs serial, answers vs alone."""

import json

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
