"""Locks what sparse decode selects and recalls on a fixed synthetic stream, so that speed work on the
decoder cannot change results: the page tables of every step and layer (hashed) and the
per-step recall must equal the recorded ones; outputs must match to float tolerance.

The golden file was recorded with the decoder before the CPU fast path; regenerate it only for an
intended change of behaviour: ``python -m tests.test_decode_golden``.
"""

import hashlib
import json
from pathlib import Path

import pytest
import torch

from kvstitch.decode import make_decoder
from kvstitch.bench.decode_synthetic import synthetic_stream

GOLDEN = Path(__file__).parent / "data" / "decode_golden.json"
POLICIES = ("prkv", "quest", "arkvale", "snapkv")
CONTEXT, STEPS, BUDGET = 1500, 136, 256  # 136 steps: one refresh at T = 128


def trace(policy: str, attrs: dict | None = None, **options) -> dict:
    s = synthetic_stream(CONTEXT, STEPS, num_layers=2, num_q_heads=8, num_kv_heads=2, head_dim=32, obs_window=64,
                         seed=1)
    steps, L, Hq = s.step_queries.shape[:3]
    H, _, D = s.prefill_keys[0].shape
    dec = make_decoder(policy, BUDGET, num_layers=L, num_q_heads=Hq, num_kv_heads=H, head_dim=D, **options)
    for name, value in (attrs or {}).items():
        setattr(dec, name, value)
    for layer in range(L):
        dec.load_prefill(layer, s.prefill_keys[layer], s.prefill_values[layer], s.obs_queries[layer],
                         scaling=s.scaling)
    dec.diagnostic = True
    sha, outs = hashlib.sha256(), []
    for t in range(steps):
        for layer in range(L):
            dec.append(layer, s.step_keys[t, layer], s.step_values[t, layer])
            out = dec.attend(layer, s.step_queries[t, layer], s.scaling)
            sha.update(dec.layers[layer].selected.to(torch.int64).contiguous().numpy().tobytes())
            outs.append(round(out.abs().sum().item(), 4))
        dec.end_step()
    recall = dec.recall.steps().mean(dim=(1, 2))  # [steps]
    return {"selected_sha256": sha.hexdigest(), "recall": [round(x, 6) for x in recall.tolist()],
            "out_abs_sum": outs, "static_refreshes": dec.stats()["static_refreshes"]}


@pytest.mark.parametrize("offload", ["direct", "pool"])
@pytest.mark.parametrize("policy", POLICIES)
def test_selection_and_recall_equal_the_recorded_ones(policy, offload):
    want = json.loads(GOLDEN.read_text())[policy]
    got = trace(policy, offload=offload)
    assert got["selected_sha256"] == want["selected_sha256"]
    assert got["recall"] == pytest.approx(want["recall"], abs=2e-6)
    assert got["out_abs_sum"] == pytest.approx(want["out_abs_sum"], rel=1e-4, abs=1e-3)
    assert got["static_refreshes"] == want["static_refreshes"]


@pytest.mark.parametrize("policy", ["prkv", "quest"])
def test_working_set_variant_selects_and_recalls_the_same(policy):
    """The in-place working set (CPU variant that copies only newly selected pages) attends the same tokens."""
    want = json.loads(GOLDEN.read_text())[policy]
    got = trace(policy, attrs={"working_set": True})
    assert got["selected_sha256"] == want["selected_sha256"]
    assert got["recall"] == pytest.approx(want["recall"], abs=2e-6)
    assert got["out_abs_sum"] == pytest.approx(want["out_abs_sum"], rel=1e-4, abs=1e-3)


def test_decoder_ops_run_on_one_thread_and_restore_the_global_count():
    seen = []
    dec = make_decoder("quest", 128, num_layers=1, num_q_heads=4, num_kv_heads=2, head_dim=8)
    dec.load_prefill(0, torch.randn(2, 300, 8), torch.randn(2, 300, 8))
    inner = dec._attend
    dec._attend = lambda *a: (seen.append(torch.get_num_threads()), inner(*a))[1]
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        dec.append(0, torch.randn(2, 1, 8), torch.randn(2, 1, 8))
        dec.attend(0, torch.randn(4, 1, 8), 0.3)
        assert seen == [1] and torch.get_num_threads() == 2
        everything = make_decoder("quest", 128, num_layers=1, num_q_heads=4, num_kv_heads=2, head_dim=8, op_threads=0)
        assert everything.op_threads is None
    finally:
        torch.set_num_threads(before)


if __name__ == "__main__":
    GOLDEN.parent.mkdir(exist_ok=True)
    GOLDEN.write_text(json.dumps({p: trace(p) for p in POLICIES}, indent=0) + "\n")
    print(f"written {GOLDEN}")


@pytest.mark.parametrize("working_set", [False, True])
def test_bfloat16_cache_decodes_on_the_cpu_paths(working_set):
    """A half-precision cache goes through the direct gather / working set and attends in float32."""
    dec = make_decoder("prkv", 128, num_layers=1, num_q_heads=4, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16)
    dec.working_set = working_set
    g = torch.Generator().manual_seed(0)
    dec.load_prefill(0, torch.randn(2, 400, 8, generator=g), torch.randn(2, 400, 8, generator=g),
                     torch.randn(4, 64, 8, generator=g))
    for _ in range(3):
        dec.append(0, torch.randn(2, 1, 8, generator=g), torch.randn(2, 1, 8, generator=g))
        out = dec.attend(0, torch.randn(4, 1, 8, generator=g), 0.35)
        dec.end_step()
    assert out.shape == (4, 1, 8) and torch.isfinite(out).all()
