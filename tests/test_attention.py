"""The registered attention function on subsets of query slots, against an explicit dense reference."""

from types import SimpleNamespace

import pytest
import torch

from kvstitch.core import attention
from kvstitch.core.attention import ForwardPlan, kvstitch_attention


def _reference(q, k, v, slots, scaling, window=None, softcap=None):
    """softmax over keys at slots <= p (and > p - window), GQA by repeating K/V: [1, q, Hq, d]."""
    rep = q.shape[1] // k.shape[1]
    kk, vv = k[0].double().repeat_interleave(rep, 0), v[0].double().repeat_interleave(rep, 0)
    s = q[0].double() @ kk.transpose(-1, -2) * scaling
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    keys = torch.arange(k.shape[2])
    seen = keys[None, :] <= slots[:, None]
    if window:
        seen &= keys[None, :] > slots[:, None] - window
    out = torch.softmax(s.masked_fill(~seen, float("-inf")), dim=-1) @ vv
    return out.transpose(0, 1)[None]


def _slots(n_keys, n_sel, seed):
    g = torch.Generator().manual_seed(seed)
    body = torch.randperm(n_keys - 8, generator=g)[:n_sel]
    return torch.sort(torch.cat([body, torch.arange(n_keys - 8, n_keys)])).values  # a suffix block at the end


@pytest.mark.parametrize("split", [True, False], ids=["split-lse", "masked-sdpa"])
@pytest.mark.parametrize("window,softcap", [(None, None), (40, None), (None, 30.0)])
@pytest.mark.parametrize("group", [0, 5, 32])
def test_grouped_subset_attention_equals_dense_reference(split, window, softcap, group, monkeypatch):
    if not split:
        monkeypatch.setattr(attention, "_CPU_FLASH", None)
    torch.manual_seed(0)
    Hq, Hkv, d, n = 6, 2, 16, 300
    slots = _slots(n, 70, seed=group)
    q = torch.randn(1, Hq, slots.numel(), d)
    k, v = torch.randn(1, Hkv, n, d), torch.randn(1, Hkv, n, d)
    out, _ = kvstitch_attention(SimpleNamespace(layer_idx=0), q, k, v, scaling=d ** -0.5, sliding_window=window,
                                softcap=softcap, kvstitch_plan=ForwardPlan(q_slots=slots, group_queries=group))
    ref = _reference(q, k, v, slots, d ** -0.5, window, softcap)
    assert out.shape == ref.shape
    assert (out.double() - ref).abs().max().item() < 1e-5


def test_split_handles_groups_whose_tail_is_empty_or_fully_masked():
    """Singleton groups (no tail) and a group whose first query is its only early one (the tail holds keys
    no query of the group before the last may see) take the log-sum-exp merge's edge cases."""
    torch.manual_seed(1)
    Hq, Hkv, d, n = 4, 4, 8, 64
    slots = torch.tensor([3, 40, 41, 50, 63])
    q = torch.randn(1, Hq, slots.numel(), d)
    k, v = torch.randn(1, Hkv, n, d), torch.randn(1, Hkv, n, d)
    ref = _reference(q, k, v, slots, 0.3)
    for group in (1, 2, 5):
        out, _ = kvstitch_attention(SimpleNamespace(layer_idx=0), q, k, v, scaling=0.3,
                                    kvstitch_plan=ForwardPlan(q_slots=slots, group_queries=group))
        assert (out.double() - ref).abs().max().item() < 1e-5, group


def test_half_precision_attention_with_gradients_runs_in_float32_on_a_cpu(monkeypatch):
    """Training through bfloat16 attention on a CPU: the kernels see float32 (torch's half flash-attention backward
    is a scalar kernel there), the output is the half path's up to its rounding and stays in bfloat16, and the
    gradient reaches the queries. Without gradients (inference) the half path runs as before."""
    seen = []
    real = attention._CPU_FLASH

    def recording(q, k, v, *a, **kw):
        seen.append(q.dtype)
        return real(q, k, v, *a, **kw)

    monkeypatch.setattr(attention, "_CPU_FLASH", recording)
    torch.manual_seed(2)
    Hq, Hkv, d, n = 4, 2, 16, 200
    slots = _slots(n, 40, seed=3)
    q = torch.randn(1, Hq, slots.numel(), d).bfloat16()
    k, v = torch.randn(1, Hkv, n, d).bfloat16(), torch.randn(1, Hkv, n, d).bfloat16()
    plan = ForwardPlan(q_slots=slots)
    half, _ = kvstitch_attention(SimpleNamespace(layer_idx=0), q, k, v, scaling=d ** -0.5, kvstitch_plan=plan)
    assert seen and set(seen) == {torch.bfloat16}
    seen.clear()
    qg = q.clone().requires_grad_(True)
    out, _ = kvstitch_attention(SimpleNamespace(layer_idx=0), qg, k, v, scaling=d ** -0.5, kvstitch_plan=plan)
    assert seen and set(seen) == {torch.float32} and out.dtype == torch.bfloat16
    ref = _reference(q.float(), k.float(), v.float(), slots, d ** -0.5)
    assert (out.double() - ref).abs().max().item() < 2e-2 and (half.double() - ref).abs().max().item() < 2e-2
    out.float().sum().backward()
    assert qg.grad is not None and qg.grad.dtype == torch.bfloat16 and qg.grad.abs().sum() > 0
