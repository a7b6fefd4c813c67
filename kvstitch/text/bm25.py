"""Okapi BM25 over short texts: the chunk collection's fallback retriever (no embedder installed) and the
`auto` verification's choice of chunks (`kvstitch.engine.budget`)."""

from __future__ import annotations

import re

import torch

_WORD = re.compile(r"\w+", re.UNICODE)
_STOP = frozenset("""a an and are as at be been but by can could did do does for from had has have how i if in
into is it its of on or so than that the their them then there these they this those to was were what when
where which who whom why will with would you your""".split())


def bm25_tokens(text: str) -> list[str]:
    return [w for w in _WORD.findall(text.lower()) if w not in _STOP]


class BM25:
    """Okapi BM25 (k1=1.5, b=0.75, Lucene's non-negative idf) over the chunk texts, scored by `bm25s`."""

    def __init__(self, texts: list[str], k1: float = 1.5, b: float = 0.75):
        import bm25s

        self.n = len(texts)
        self.scale = k1 + 1  # Lucene's variant drops Okapi's constant (k1 + 1) factor: scores as before
        self.index = bm25s.BM25(k1=k1, b=b, method="lucene")
        if texts:
            # bm25s treats an empty token list as missing: a placeholder word no query token can equal
            self.index.index([bm25_tokens(t) or ["\x00"] for t in texts], show_progress=False)

    def scores(self, query: str) -> torch.Tensor:
        q = [w for w in bm25_tokens(query) if w in self.index.vocab_dict] if self.n else []
        if not q:
            return torch.zeros(self.n)
        return torch.from_numpy(self.index.get_scores(q).astype("float32")) * self.scale
