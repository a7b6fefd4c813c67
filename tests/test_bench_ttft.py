"""`kvstitch bench ttft`: full prefill vs warm-store vs cold-store stitched TTFT, in one run."""

import json

from kvstitch.bench import COLD, HALF, bench_ttft, ttft_table, write_results

from .conftest import make_tiny_engine


def test_bench_ttft_rows_warm_cold_full(smollm_tokenizer, tmp_path):
    eng = make_tiny_engine("llama", smollm_tokenizer)
    rows = bench_ttft(eng, [300], ["random"], ratio=0.2, repeats=1, chunk_tokens=64, progress=False, cold=True)
    by = {r["method"]: r for r in rows}
    assert list(by) == ["full", "random", "random" + COLD, "random" + HALF]
    assert by["full"]["speedup"] == 1.0 and by["random"]["ideal_speedup"] == 5.0
    assert by["random"]["store"] == "warm" and by["random" + COLD]["store"] == "cold"
    assert by["random" + HALF]["store"] == "half"
    assert by["random"]["cold_path"] == "stitched" and by["random" + COLD]["cold_path"] == "stitched"
    ctx = by["full"]["context_tokens"]
    assert 200 <= ctx <= 400  # a context of about the requested length
    for r in rows:
        assert r["ttft_min_s"] <= r["ttft_median_s"]
        assert abs(r["speedup"] - by["full"]["ttft_median_s"] / r["ttft_median_s"]) < 1e-9
    # the cold request really computed its chunks (and the warm one did not): load time includes precompute
    assert by["random" + COLD]["chunk_load_s"] > by["random"]["chunk_load_s"]
    table = ttft_table(rows)
    assert table.count("\n") == 1 + len(rows) and "cold" in table and "warm" in table
    write_results(rows, tmp_path, "bench_ttft", table)
    assert json.loads((tmp_path / "bench_ttft.json").read_text())["rows"][2]["method"] == "random" + COLD
