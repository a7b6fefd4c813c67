"""`kvstitch bench ttft`: full prefill vs warm-store vs cold-store stitched TTFT, in one run."""

import json

from kvstitch.bench.ttft import COLD, HALF, bench_ttft, ttft_table, write_results

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


def test_bench_ttft_breakdown_attention_mlp_and_causal_work(smollm_tokenizer):
    """The stage breakdown: attention-kernel and MLP time are measured inside the TTFT, the hooks are
    removed afterwards, and the causal-work model is exact for full prefill (1.0) and counts positions."""
    from transformers import AttentionInterface

    from kvstitch.core.attention import ATTN_IMPL, kvstitch_attention
    from kvstitch.bench.ttft import causal_work

    eng = make_tiny_engine("llama", smollm_tokenizer)
    rows = bench_ttft(eng, [300], ["random"], ratio=0.2, repeats=1, chunk_tokens=64, progress=False)
    by = {r["method"]: r for r in rows}
    for r in rows:
        assert 0 < r["attn_s"] < r["ttft_median_s"] and 0 < r["mlp_s"] < r["ttft_median_s"]
    assert by["full"]["attn_work"] == 1.0 and by["full"]["token_frac"] == 1.0 and by["full"]["work_bound"] == 1.0
    rnd = by["random"]
    assert 0.2 <= rnd["token_frac"] < 0.5 and 0 < rnd["attn_work"] < 1 and rnd["work_bound"] > 1
    assert AttentionInterface()[ATTN_IMPL] is kvstitch_attention  # the timing wrapper is gone
    assert not any(layer.mlp._forward_hooks or layer.mlp._forward_pre_hooks for layer in eng.adapter.backbone.layers)

    layout = eng.layout("q?", ["a b c d e f g h", "i j k l m n o p"])
    n, c0, nc = layout.n_total, layout.context_start, layout.n_context
    last = causal_work(layout, [nc - 1])  # one context token, the last: it attends to every earlier key
    suffix = list(range(c0 + nc, n))
    expect = ((c0 + nc) + sum(p + 1 for p in suffix)) / (n * (n + 1) / 2)
    assert abs(last["attn_work"] - expect) < 1e-12 and last["pos_mean"] == 1.0
    assert causal_work(layout, [0])["attn_work"] < last["attn_work"]  # earlier tokens: less causal work


def test_warm_rows_stay_warm_for_an_anchor_method_after_the_cold_rows(smollm_tokenizer, monkeypatch):
    """The cold and half-warm rows evict the prompt's chunks every repeat; the chunks are stored again with the
    anchors qcfuse reads, so qcfuse's timed warm rows never compute anchors."""
    eng = make_tiny_engine("llama", smollm_tokenizer)
    added = []
    generate = eng.generate

    def spy(*args, **kwargs):
        res = generate(*args, **kwargs)
        added.append((kwargs.get("method"), res.stats.to_dict().get("anchors_added", 0)))
        return res

    monkeypatch.setattr(eng, "generate", spy)
    bench_ttft(eng, [300], ["random", "qcfuse"], ratio=0.2, repeats=2, chunk_tokens=64, progress=False, cold=True)
    qcfuse = [n for m, n in added if m == "qcfuse"]
    assert len(qcfuse) == 3 and all(n == 0 for n in qcfuse[1:])  # repeat 0 may add them; the timed ones never
