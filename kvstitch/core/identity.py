"""What a chunk cache's store key names besides the model weights: the tokenizer, and the model record
a shared store keeps so `kvstitch store stats` can group entries by model.

The tokenizer identity is a hash of what turns text into ids: the fast tokenizer's full serialized
pipeline (vocabulary, merges, normalizer, pre-tokenizer, post-processor, added tokens), plus the special
tokens and the class. Two servers whose weights agree but whose tokenizers differ never share an entry.
"""

from __future__ import annotations

import hashlib
import json


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256[:32] of the tokenizer's vocabulary / merges / configuration."""
    h = hashlib.sha256()

    def part(b: bytes) -> None:
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)

    part(type(tokenizer).__name__.encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        part(backend.to_str().encode())
    else:  # a slow tokenizer: its vocabulary (merges live in the class's files; the vocab names them)
        part(json.dumps(sorted(tokenizer.get_vocab().items()), ensure_ascii=False).encode())
    special = {k: str(v) for k, v in sorted((getattr(tokenizer, "special_tokens_map", None) or {}).items())}
    part(json.dumps(special, sort_keys=True).encode())
    for attr in ("add_bos_token", "add_eos_token", "clean_up_tokenization_spaces"):
        part(f"{attr}={getattr(tokenizer, attr, None)}".encode())
    return h.hexdigest()[:32]


def model_record(engine) -> dict:
    """The descriptor a store keeps per model fingerprint (``kvstitch store stats`` shows its name)."""
    cfg = getattr(engine.model, "config", None)
    path = (getattr(cfg, "_name_or_path", "") or "").rstrip("/")
    name = path.rsplit("/", 1)[-1]
    try:  # a dequantized GGUF (models/loader.py) records where it came from
        from pathlib import Path

        src = Path(path) / "source.json"
        if path and src.is_file():
            name = Path(json.loads(src.read_text())["gguf"]).stem
    except (OSError, ValueError, KeyError):
        pass
    return {"name": name or getattr(engine, "weights_id", "") or engine.fingerprint[:12],
            "fingerprint": engine.fingerprint, "weights": getattr(engine, "weights_id", ""),
            "tokenizer": getattr(engine, "tokenizer_id", ""), "dtype": str(engine.dtype).removeprefix("torch."),
            "family": getattr(engine.adapter, "family", ""),
            "storage_dtype": getattr(engine.store, "storage_dtype", "")}


def register_model(engine) -> None:
    """Record the engine's model in its store (shared stores name their models); never fails a load."""
    import logging

    from .errors import StoreError

    try:
        engine.store.register_model(model_record(engine))
    except (StoreError, NotImplementedError, OSError) as e:
        logging.getLogger("kvstitch.store").warning("could not record the model in the store: %s", e)
