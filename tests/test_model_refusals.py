"""The README's refusals, each on a tiny random model: length-dependent RoPE (dynamic NTK, longrope) and
unsupported architectures fail to load with `ModelLoadError`; a position-recovery self-check above its
tolerance raises `PositionRecoveryError` instead of stitching with wrong positions."""

from __future__ import annotations

import copy

import pytest
import torch

from kvstitch import ModelLoadError, PositionRecoveryError
from kvstitch.core.attention import ATTN_IMPL, register
from kvstitch.engine import Engine
from kvstitch.models.adapter import ModelAdapter, adapter_for
from kvstitch.core.rope import SELF_CHECK_RTOL, self_check

from .conftest import _COMMON, make_tiny_engine


def _tiny_model(cfg, tokenizer):
    from transformers import AutoModelForCausalLM

    register()
    cfg.vocab_size = len(tokenizer)
    cfg.pad_token_id = cfg.bos_token_id = tokenizer.bos_token_id
    cfg.eos_token_id = tokenizer.eos_token_id
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation=ATTN_IMPL, dtype=torch.float32).eval()


def _llama(rope_parameters):
    from transformers import LlamaConfig

    return LlamaConfig(**_COMMON, rope_parameters=rope_parameters)


HALF = _COMMON["head_dim"] // 2
LENGTH_DEPENDENT = {
    "dynamic": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
    "longrope": {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 1024,
                 "short_factor": [1.0] * HALF, "long_factor": [4.0] * HALF, "factor": 4.0},
}


@pytest.mark.parametrize("rope_type", sorted(LENGTH_DEPENDENT))
def test_length_dependent_rope_is_refused(rope_type, smollm_tokenizer):
    model = _tiny_model(_llama(LENGTH_DEPENDENT[rope_type]), smollm_tokenizer)
    assert model.config.rope_parameters["rope_type"] == rope_type  # transformers kept the type we asked for
    with pytest.raises(ModelLoadError, match=f"RoPE type '{rope_type}'.*depends on sequence length"):
        Engine(model, smollm_tokenizer, weights_id=f"tiny-{rope_type}")


def test_dynamic_rope_is_refused_by_engine_load(smollm_tokenizer, tmp_path):
    """The same refusal through the public loader (an HF directory on disk), as a user meets it."""
    model = _tiny_model(_llama(LENGTH_DEPENDENT["dynamic"]), smollm_tokenizer)
    model.save_pretrained(tmp_path)
    smollm_tokenizer.save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="'dynamic'.*depends on sequence length"):
        Engine.load(str(tmp_path))


def test_static_rope_types_load(smollm_tokenizer):
    """The control: every static type the README lists loads and passes its self-check."""
    for name in ("llama", "llama-linear", "llama-llama3", "llama-yarn"):
        eng = make_tiny_engine(name, smollm_tokenizer)
        assert eng.rope_error is not None and eng.rope_error < SELF_CHECK_RTOL


def test_unsupported_architecture_is_refused(smollm_tokenizer):
    from transformers import GPT2Config, PhiConfig

    gpt2 = _tiny_model(GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=256), smollm_tokenizer)
    with pytest.raises(ModelLoadError, match="unsupported architecture 'gpt2'; supported: .*llama"):
        Engine(gpt2, smollm_tokenizer, weights_id="tiny-gpt2")
    phi = _tiny_model(PhiConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                max_position_embeddings=256), smollm_tokenizer)  # RoPE, but not a known family
    with pytest.raises(ModelLoadError, match="unsupported architecture 'phi'"):
        adapter_for(phi)


class _WrongBase(ModelAdapter):
    """An adapter that re-rotates with a different RoPE base than the model uses (scale of inv_freq)."""

    scale: float = 1.0

    def inv_freq(self, layer: int) -> torch.Tensor:
        return super().inv_freq(layer) * self.scale


def test_position_recovery_error_above_tolerance(smollm_tokenizer):
    eng = make_tiny_engine("llama", smollm_tokenizer)
    probe = eng.tokenizer("The quick brown fox jumps over the lazy dog again and again.",
                          return_tensors="pt").input_ids[0][:16]
    right = _WrongBase(model=eng.model, family="llama")
    assert self_check(eng.model, right, probe) < SELF_CHECK_RTOL  # the real frequencies pass
    slightly = _WrongBase(model=eng.model, family="llama")
    slightly.scale = 1 + 1e-9
    assert self_check(eng.model, slightly, probe) < SELF_CHECK_RTOL  # rounding-level change: still fine
    wrong = _WrongBase(model=eng.model, family="llama")
    wrong.scale = 1.05  # a wrong base: keys land at the wrong angles
    with pytest.raises(PositionRecoveryError, match=r"relative error .* > 0\.01 .*refusing to stitch"):
        self_check(eng.model, wrong, probe)


def test_engine_refuses_to_stitch_when_self_check_fails(smollm_tokenizer, monkeypatch):
    """At load (Engine construction) the self-check runs on the model itself and its failure propagates."""
    import kvstitch.engine.engine as engine_mod

    model = _tiny_model(_llama({"rope_type": "default", "rope_theta": 10000.0}), smollm_tokenizer)
    real = engine_mod.adapter_for

    def wrong_adapter(m):
        ad = real(m)
        bad = _WrongBase(model=ad.model, family=ad.family)
        bad.scale = 1.05
        return bad

    monkeypatch.setattr(engine_mod, "adapter_for", wrong_adapter)
    with pytest.raises(PositionRecoveryError, match="refusing to stitch"):
        Engine(model, smollm_tokenizer, weights_id="tiny-wrong-base")
    monkeypatch.setattr(engine_mod, "adapter_for", real)
    assert Engine(model, smollm_tokenizer, weights_id="tiny-right-base").rope_error < SELF_CHECK_RTOL


def test_self_check_tolerance_follows_the_model_dtype(smollm_tokenizer):
    """A bfloat16 model (CUDA's default dtype) rounds its own RoPE: the exact re-rotation must still pass,
    and a wrong base must still fail."""
    from kvstitch.core.rope import self_check_rtol

    assert self_check_rtol(torch.float32) == SELF_CHECK_RTOL
    assert self_check_rtol(torch.bfloat16) == pytest.approx(0.0625)
    eng = make_tiny_engine("llama", smollm_tokenizer)
    model = copy.deepcopy(eng.model).to(torch.bfloat16)  # a copy: the tiny model is shared
    probe = eng.tokenizer("The quick brown fox jumps over the lazy dog again and again.",
                          return_tensors="pt").input_ids[0][:16]
    assert self_check(model, _WrongBase(model=model, family="llama"), probe) < self_check_rtol(torch.bfloat16)
    wrong = _WrongBase(model=model, family="llama")
    wrong.scale = 1.05
    with pytest.raises(PositionRecoveryError, match="refusing to stitch"):
        self_check(model, wrong, probe)


def test_unknown_dtype_is_an_input_error():
    from kvstitch.core.errors import InputError

    with pytest.raises(InputError, match="unknown dtype 'float8'"):
        Engine.load(dtype="float8")
