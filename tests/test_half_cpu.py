"""Half precision on a CPU without a native half GEMM (`kvstitch.models.half_cpu`): the upcast linear layer gives
the numbers of torch's own half-precision linear, only the layers of a half model are switched, and
`load_model` switches them exactly where the CPU lacks native support."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kvstitch.models import half_cpu
from kvstitch.models.half_cpu import UPCAST_MIN_ROWS, UpcastLinear, multiplies_natively, upcast_linears

from .conftest import make_tiny_engine


def _ulp(x: torch.Tensor) -> torch.Tensor:
    """One unit in the last place of each half-precision value of ``x`` (as float32)."""
    mant = {torch.bfloat16: 7, torch.float16: 10}[x.dtype]
    exp = torch.floor(torch.log2(x.float().abs().clamp_min(1e-30)))
    return torch.exp2(exp - mant)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
def test_upcast_linear_rounds_like_torchs_half_linear(dtype, bias):
    """Many rows: float32 products and sum, one rounding to the half dtype, as torch's half GEMM (oneDNN or the
    scalar fallback): every element within one half-precision ulp of it and almost all identical. Few rows
    (decode): torch's own kernel, bit for bit."""
    g = torch.Generator().manual_seed(0)
    layer = nn.Linear(96, 80, bias=bias).to(dtype)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(80, 96, generator=g) * 0.1)
    ref = copy.deepcopy(layer)
    upcast_linears(layer)
    assert type(layer) is UpcastLinear and type(ref) is nn.Linear
    x = torch.randn(2, 64, 96, generator=g).to(dtype)
    with torch.no_grad():
        got, want = layer(x), ref(x)
    assert got.dtype == dtype and got.shape == want.shape
    diff = (got.float() - want.float()).abs()
    # one ulp of the output, or of the bias where torch rounds the product before adding it (float16 addmm)
    scale = want.float().abs() if layer.bias is None else torch.maximum(want.float().abs(), layer.bias.float().abs())
    assert bool((diff <= _ulp(scale.to(dtype)) * 1.01).all())
    assert (diff == 0).float().mean() > 0.99
    # and no further from exact arithmetic than torch's kernel
    exact = F.linear(x.double(), layer.weight.double(), None if layer.bias is None else layer.bias.double())
    assert (got.double() - exact).abs().mean() <= (want.double() - exact).abs().mean() * 1.001
    small = x[:, : UPCAST_MIN_ROWS // 4]
    with torch.no_grad():
        assert torch.equal(layer(small), ref(small))


def test_upcast_linears_switches_only_half_precision_linears():
    model = nn.Sequential(nn.Linear(8, 8).to(torch.bfloat16), nn.Linear(8, 8), nn.Embedding(4, 8).to(torch.bfloat16))
    ptrs = [p.data_ptr() for p in model.parameters()]
    assert upcast_linears(model) == 1
    assert [type(m) for m in model] == [UpcastLinear, nn.Linear, nn.Embedding]
    assert [p.data_ptr() for p in model.parameters()] == ptrs  # weights untouched: still bfloat16, not copied
    assert model[0].weight.dtype == torch.bfloat16


def test_multiplies_natively_reads_the_cpus_features(monkeypatch):
    monkeypatch.delenv("KVSTITCH_NATIVE_HALF", raising=False)
    cpu = torch.device("cpu")
    assert multiplies_natively(torch.float32, cpu)
    for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported", "_is_amx_fp16_supported"):
        monkeypatch.setattr(torch.cpu, name, lambda: False, raising=False)
    assert not multiplies_natively(torch.bfloat16, cpu) and not multiplies_natively(torch.float16, cpu)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    assert multiplies_natively(torch.bfloat16, cpu) and not multiplies_natively(torch.float16, cpu)
    monkeypatch.setattr(torch.cpu, "_is_amx_fp16_supported", lambda: True)
    assert multiplies_natively(torch.float16, cpu)
    monkeypatch.delattr(torch.cpu, "_is_amx_tile_supported")
    monkeypatch.delattr(torch.cpu, "_is_avx512_bf16_supported")
    assert not multiplies_natively(torch.bfloat16, cpu)  # private probes gone: assume emulated


@pytest.mark.parametrize("forced", ["0", "1"])
def test_the_environment_forces_either_path(monkeypatch, forced):
    for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported", "_is_amx_fp16_supported"):
        monkeypatch.setattr(torch.cpu, name, lambda: forced == "0", raising=False)  # the CPU says the opposite
    monkeypatch.setenv("KVSTITCH_NATIVE_HALF", forced)
    for dtype in (torch.bfloat16, torch.float16):
        assert multiplies_natively(dtype, torch.device("cpu")) is (forced == "1")
    assert multiplies_natively(torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("native", [True, False])
def test_load_model_upcasts_exactly_where_the_cpu_lacks_native_half(monkeypatch, native):
    from kvstitch.models import loader

    monkeypatch.setattr(loader, "multiplies_natively", lambda dtype, dev: native)
    model, _, _ = loader.load_model("smollm2", "cpu", torch.bfloat16)
    kinds = {type(m) for m in model.modules() if isinstance(m, nn.Linear)}
    assert kinds == ({nn.Linear} if native else {UpcastLinear})
    model32, _, _ = loader.load_model("smollm2", "cpu", torch.float32)  # float32 is never touched
    assert {type(m) for m in model32.modules() if isinstance(m, nn.Linear)} == {nn.Linear}


def test_an_upcast_model_predicts_as_the_native_half_model(smollm_tokenizer, monkeypatch):
    """A whole (tiny) bfloat16 model: logits within bfloat16's rounding of the model run by torch's own half
    kernels, so each greedy token is the native model's or one within that rounding of its top logit (two
    kernels may order a near tie differently)."""
    eng = make_tiny_engine("qwen2", smollm_tokenizer)
    native = copy.deepcopy(eng.model).to(torch.bfloat16)
    upcast = copy.deepcopy(native)
    assert upcast_linears(upcast) > 0
    ids = torch.randint(10, 1000, (1, 3 * UPCAST_MIN_ROWS), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a = native(input_ids=ids).logits.float()
        b = upcast(input_ids=ids).logits.float()
    tol = 0.05 * a.abs().max()
    assert (a - b).abs().max() <= tol
    top_a = a.max(-1).values
    assert (a.gather(-1, b.argmax(-1, keepdim=True)).squeeze(-1) >= top_a - 2 * tol).all()
    monkeypatch.setattr(half_cpu, "UPCAST_MIN_ROWS", 10**9)  # every input below the threshold: torch's kernel
    with torch.no_grad():
        assert torch.equal(upcast(input_ids=ids).logits, native(input_ids=ids).logits)


@pytest.mark.parametrize("forced", ["0", "1"])
def test_the_cpu_name_eval_rows_carry_tells_native_half_from_emulated(monkeypatch, forced):
    # one model name ("AMD EPYC") covers AVX2 parts and AVX512-BF16 ones whose half prefill is ~4x faster
    from kvstitch.engine.device import cpu_name

    monkeypatch.setenv("KVSTITCH_NATIVE_HALF", forced)
    cpu_name.cache_clear()
    try:
        name = cpu_name()
    finally:
        cpu_name.cache_clear()
    assert name.endswith(")") and torch.backends.cpu.get_cpu_capability() in name
    assert ("native bf16" in name) is (forced == "1")
