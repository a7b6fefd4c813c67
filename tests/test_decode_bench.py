"""The synthetic decode bench (kvstitch.bench.decode_synthetic), at toy size."""

import torch

from kvstitch.bench.decode_synthetic import POLICIES, bench_policies_synthetic, format_table, synthetic_stream

SMALL = dict(num_layers=1, num_q_heads=4, num_kv_heads=2, head_dim=16, obs_window=8)


def test_synthetic_stream_plants_needles_the_queries_find():
    s = synthetic_stream(1024, 16, **SMALL)
    keys = torch.cat([s.prefill_keys[0], s.step_keys[:, 0, :, 0].transpose(0, 1)], dim=1)
    a, b = s.needles

    def needle_mass(t, pos):
        n = 1024 + t + 1
        probs = torch.softmax(s.step_queries[t, 0] @ keys[:, :n].repeat_interleave(2, 0).transpose(1, 2)
                              * s.scaling, dim=-1)
        return probs[:, 0, pos : pos + 4].sum(-1).mean().item()

    assert needle_mass(0, a) > 0.05 > needle_mass(0, b)   # first 3/8 of the decode: needle A
    assert needle_mass(15, b) > 0.05 > needle_mass(15, a)  # then needle B


def test_bench_reports_every_policy_and_budget_with_consistent_recall():
    rows = bench_policies_synthetic(512, budgets=(128, 600), steps=12, page_size=8, warmup=2,
                                    policy_kwargs={"prkv": {"refresh_interval": 4}, "snapkv": {"refresh_interval": 4}},
                                    **SMALL)
    assert [(r["budget"], r["policy"]) for r in rows] == [(b, p) for b in (128, 600) for p in POLICIES]
    for r in rows:
        assert r["recall"] <= r["oracle_recall"] + 1e-6  # no selection beats the true top-k of its size
        assert r["attend_ms"] > 0 and r["latency_vs_full"] > 0
        if r["budget"] == 600 or r["policy"] == "dense":  # the budget covers 512 + 12 tokens: dense
            assert abs(r["recall"] - 1) < 1e-5 and r["max_abs_err_vs_dense"] < 1e-5
        else:
            assert 0 < r["recall"] < 1 and r["mean_selected_tokens"] <= 128 + 64  # k + the local window
    assert "prkv" in format_table(rows)
