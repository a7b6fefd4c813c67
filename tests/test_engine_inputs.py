"""Bad requests raise typed errors with clear messages; nothing is silently truncated."""

import pytest

from kvstitch import InputError, ModelLoadError
from kvstitch.engine import Engine

from .conftest import SAMPLE_CHUNKS, SAMPLE_QUESTION


@pytest.mark.parametrize("tiny_engine", ["llama"], indirect=True)
@pytest.mark.parametrize("kwargs,message", [
    (dict(question="  "), "question is empty"),
    (dict(chunks=[]), "no chunks"),
    (dict(chunks=["fine", " \n"]), "chunk 1 is empty"),
    (dict(method="bogus"), "unknown method 'bogus'"),
    (dict(recompute_ratio=-0.1), "recompute_ratio"),
    (dict(recompute_ratio=float("nan")), "recompute_ratio"),
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(min_new_tokens=-1), "min_new_tokens"),
])
def test_bad_requests(tiny_engine, kwargs, message):
    args = dict(question=SAMPLE_QUESTION, chunks=SAMPLE_CHUNKS, method="random", recompute_ratio=0.2)
    args.update(kwargs)
    with pytest.raises(InputError, match=message.replace("(", r"\(")):
        tiny_engine.generate(**args)


@pytest.mark.parametrize("tiny_engine", ["llama"], indirect=True)
def test_too_long_prompt_is_refused_not_truncated(tiny_engine):
    limit = tiny_engine.adapter.max_positions
    long_chunk = "word " * (limit + 10)
    with pytest.raises(InputError, match="limit of"):
        tiny_engine.generate(SAMPLE_QUESTION, [long_chunk], method="random")


def test_unreadable_model_paths(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        Engine.load(str(tmp_path / "missing"))
    (tmp_path / "x.bin").write_text("nope")
    with pytest.raises(ModelLoadError, match="neither a directory nor a .gguf"):
        Engine.load(str(tmp_path / "x.bin"))
    (tmp_path / "bad.gguf").write_bytes(b"not a gguf")
    with pytest.raises(ModelLoadError, match="cannot load GGUF"):
        Engine.load(str(tmp_path / "bad.gguf"))
    with pytest.raises(ModelLoadError, match="not a Hugging Face model directory"):
        Engine.load(str(tmp_path))


@pytest.mark.parametrize("tiny_engine", ["llama"], indirect=True)
def test_min_new_tokens_masks_eos_until_the_answer_is_that_long(tiny_engine):
    """A token the model picks first made EOS: the answer ends there, unless min_new_tokens asks for more, when it
    has that many tokens, none of them EOS (what `bench serve` uses for equal-length answers)."""
    args = dict(question=SAMPLE_QUESTION, chunks=SAMPLE_CHUNKS, method="random", recompute_ratio=0.2,
                max_new_tokens=6)
    first = tiny_engine.generate(**args).token_ids[0]
    eos = tiny_engine.eos_ids
    tiny_engine.eos_ids = set(eos) | {first}
    try:
        assert tiny_engine.generate(**args).token_ids == [first]  # stops at the (new) EOS
        for mode in ({}, {"decode": "prkv", "kv_budget": 64}):
            out = tiny_engine.generate(**args, min_new_tokens=6, **mode).token_ids
            assert len(out) == 6 and not set(out) & tiny_engine.eos_ids
    finally:
        tiny_engine.eos_ids = eos


def test_fast_dtype_is_bfloat16_only_where_the_cpu_multiplies_it_natively(monkeypatch):
    """The demo's dtype: bfloat16 on a CPU with AVX512-BF16 or AMX, float32 without, or where torch's private
    feature probes are gone (a CPU without native bf16 would emulate it, slower than float32)."""
    import torch

    from kvstitch.engine.engine import fast_dtype

    monkeypatch.delenv("KVSTITCH_NATIVE_HALF", raising=False)  # the CPU's features decide, not an override
    cpu = torch.device("cpu")
    for bf16, amx, want in ((True, False, "bfloat16"), (False, True, "bfloat16"), (False, False, "float32")):
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda v=bf16: v, raising=False)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda v=amx: v, raising=False)
        assert fast_dtype(cpu) == want
    monkeypatch.delattr(torch.cpu, "_is_avx512_bf16_supported")
    monkeypatch.delattr(torch.cpu, "_is_amx_tile_supported")
    assert fast_dtype(cpu) == "float32"


def test_engine_load_fast_dtype_resolves_before_the_model_loads(monkeypatch, caplog):
    """``Engine.load(dtype="fast")`` loads the model in `fast_dtype` of the device; bfloat16 asked for where the
    CPU only emulates it is loaded, saying so (`kvstitch.models.half_cpu` keeps it at float32's speed); a bad
    dtype is refused first."""
    import torch

    import kvstitch.engine.engine as engine_mod

    seen = []

    def fake_load_model(model, dev, dtype):
        seen.append(dtype)
        raise RuntimeError("stop here")

    monkeypatch.setattr(engine_mod, "load_model", fake_load_model)
    with pytest.raises(RuntimeError, match="stop here"):
        engine_mod.Engine.load("smollm2", device="cpu", dtype="fast")
    assert seen == [getattr(torch, engine_mod.fast_dtype(torch.device("cpu")))]
    monkeypatch.setattr(engine_mod, "multiplies_natively", lambda dtype, dev: False)  # a CPU without native bf16:
    with pytest.raises(RuntimeError, match="stop here"), caplog.at_level("INFO", "kvstitch.engine"):  # said
        engine_mod.Engine.load("smollm2", device="cpu", dtype="bfloat16")
    assert "bfloat16 on this CPU" in caplog.text and "emulated" in caplog.text
    caplog.clear()
    with pytest.raises(RuntimeError, match="stop here"), caplog.at_level("INFO", "kvstitch.engine"):
        engine_mod.Engine.load("smollm2", device="cpu", dtype="float32")
    assert "emulated" not in caplog.text
    with pytest.raises(InputError, match="unknown dtype 'half-ish'.*fast"):
        engine_mod.Engine.load("smollm2", device="cpu", dtype="half-ish")
    assert len(seen) == 3  # the refused dtype never reached the model


def test_generate_and_stream_list_the_request_fields():
    """`generate` / `stream` name every field of `GenerationRequest`, with its default (what `help()` and an
    editor show); the scheduler's flags are `Engine.steps`' alone."""
    import dataclasses
    import inspect

    from kvstitch.engine import GenerationRequest

    fields = {f.name: f.default for f in dataclasses.fields(GenerationRequest) if not f.metadata.get("internal")}
    for fn in (Engine.generate, Engine.stream):
        params = dict(inspect.signature(fn).parameters)
        params.pop("self")
        assert {k: p.default for k, p in params.items()} == fields, fn.__name__
        assert all(p.kind is p.KEYWORD_ONLY for k, p in params.items() if k not in ("question", "chunks"))
        assert not any(p.kind is p.VAR_KEYWORD for p in params.values())
    steps = inspect.signature(Engine.steps).parameters
    assert steps["batch_decode"].default is False and steps["batch_prefill"].default is False
    assert "batch_decode" not in fields and "batch_prefill" not in fields


@pytest.mark.parametrize("tiny_engine", ["llama"], indirect=True)
def test_scheduler_flags_are_not_request_options(tiny_engine):
    with pytest.raises(TypeError, match="batch_decode"):
        tiny_engine.generate(SAMPLE_QUESTION, SAMPLE_CHUNKS, batch_decode=True)
