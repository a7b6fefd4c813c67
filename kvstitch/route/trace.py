"""A synthetic RAG request trace: Zipf-popular documents plus a stream of novel one-off documents.

A request is about one topic document, drawn by Zipf popularity (rank r with weight 1 / r^s); it retrieves
`k` passages of it in relevance order (a random subset, so two questions about one document share passages in
different orders), and each passage is, with probability `mix`, a passage of another Zipf-drawn document
instead (retrieval crossing documents). With probability `novel_share` the topic is a fresh document that is
never asked about again (new uploads, one-off questions): its passages are misses for every router.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .router import Request


@dataclass(frozen=True)
class TraceConfig:
    n_requests: int = 10_000
    n_docs: int = 1_000
    zipf_s: float = 1.0
    passages: tuple[int, int] = (4, 24)  # passages per document, uniform, inclusive
    passage_tokens: tuple[int, int] = (128, 384)  # tokens per passage, uniform, inclusive
    k: int = 5
    mix: float = 0.2
    novel_share: float = 0.1
    seed: int = 0


def doc_of(key) -> str:
    return str(key).split(":", 1)[0]


def topic_of(req: Request) -> str:
    """The document most of the request's context tokens come from (the first such on a tie)."""
    tokens: dict[str, int] = {}
    for key, tok in req.chunks:
        tokens[doc_of(key)] = tokens.get(doc_of(key), 0) + tok
    return max(tokens, key=tokens.get) if tokens else ""


def precomputed(key) -> bool:
    """Popular documents' chunks are in the shared store from the start; novel ones (``n...``) are not."""
    return not doc_of(key).startswith("n")


def zipf_weights(n: int, s: float) -> np.ndarray:
    w = 1.0 / np.arange(1, n + 1, dtype=float) ** s
    return w / w.sum()


class _Docs:
    """Passage counts and token counts, drawn once per document."""

    def __init__(self, cfg: TraceConfig, rng: np.random.Generator) -> None:
        self.cfg, self.rng = cfg, rng
        self.sizes: dict[str, list[int]] = {}

    def passages(self, doc: str) -> list[int]:
        if doc not in self.sizes:
            lo, hi = self.cfg.passages
            n = int(self.rng.integers(lo, hi + 1))
            tlo, thi = self.cfg.passage_tokens
            self.sizes[doc] = [int(t) for t in self.rng.integers(tlo, thi + 1, size=n)]
        return self.sizes[doc]


def make_trace(cfg: TraceConfig) -> list[Request]:
    """`cfg.n_requests` requests, the same for the same config (seeded)."""
    rng = np.random.default_rng(cfg.seed)
    docs = _Docs(cfg, np.random.default_rng(cfg.seed + 1))
    p = zipf_weights(cfg.n_docs, cfg.zipf_s)
    topics = rng.choice(cfg.n_docs, size=cfg.n_requests, p=p)
    others = iter(rng.choice(cfg.n_docs, size=cfg.n_requests * cfg.k, p=p))
    novel = rng.random(cfg.n_requests) < cfg.novel_share
    out = []
    for i in range(cfg.n_requests):
        topic = f"n{i}" if novel[i] else f"d{int(topics[i])}"
        sizes = docs.passages(topic)
        order = [int(j) for j in rng.permutation(len(sizes))]
        chunks, seen = [], set()
        for _ in range(cfg.k):
            doc, idx = topic, None
            if rng.random() < cfg.mix or not order:
                doc = f"d{int(next(others))}"
                idx = int(rng.integers(len(docs.passages(doc))))
            else:
                idx = order.pop()
            key = f"{doc}:{idx}"
            if key not in seen:
                seen.add(key)
                chunks.append((key, docs.passages(doc)[idx]))
        out.append(Request(tuple(chunks)))
    return out
