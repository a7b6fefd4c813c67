"""The adaptive budget's verification (`kvstitch.engine.budget`, ``verify_chunks`` > 0): a short prompt, the
question over only the few chunks most relevant to it, prefilled in full once, whose greedy answer a round's probe
must reproduce (read teacher-forced: `forcing.force_greedy`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .forcing import force_greedy
from .sampling import answer_text


@dataclass
class Reference:
    """The verification's answer: a full prefill of the question over the most relevant chunks only."""

    text: str
    chunks: list[int]  # chunk indices kept (original order)
    n_context: int  # context tokens prefilled


def verification_chunks(engine, layout, m: int, by: str = "bm25", selected: torch.Tensor | None = None) -> list[int]:
    """The pinned chunks plus ``m`` others, in prompt order: those whose text scores highest by BM25 against
    the question (``by="bm25"``), those holding most of the context indices ``selected`` (``"attention"``: the
    tokens the stitched pass chose to recompute, i.e. where the question's attention went), or the first ``m``
    (``"order"``: the retriever's ranking, when it put its best first)."""
    free = list(range(layout.pinned, len(layout.chunk_ids)))
    if by == "order":
        return list(range(layout.pinned)) + free[:m]
    if by == "attention":
        if selected is None:
            raise ValueError("verification by attention needs the selected context indices")
        ends = torch.tensor([c.numel() for c in layout.chunk_ids]).cumsum(0)
        owner = torch.bucketize(selected.cpu(), ends, right=True)
        scores = torch.bincount(owner, minlength=len(layout.chunk_ids))[layout.pinned:].float()
    else:
        from kvstitch.text.bm25 import BM25

        question = layout.question or engine.tokenizer.decode(layout.suffix_ids, skip_special_tokens=True)
        texts = [engine.tokenizer.decode(layout.chunk_ids[i], skip_special_tokens=True) for i in free]
        scores = BM25(texts).scores(question)
    top = torch.argsort(scores, descending=True, stable=True)[:m].tolist()  # ties: the earlier chunk
    return list(range(layout.pinned)) + sorted(free[j] for j in top)


class ShortPrompt:
    """The verification's short prompt, prefilled in full once: the question over `verification_chunks` only.

    `greedy_given(guess)` is its greedy answer (``n_probe`` tokens or EOS). The guess (a round's probe) is read
    teacher-forced in one pass, and step-by-step decoding starts only where the short prompt's argmax leaves
    it (`force_greedy`): when a round says what the short prompt says, checking it costs one forward of its few
    tokens instead of decoding the short prompt's answer token by token."""

    @torch.no_grad()
    def __init__(self, engine, layout, m: int, n_probe: int, chunks: list[int] | None = None):
        from kvstitch.core.prompt import PromptLayout

        self.engine, self.n_probe = engine, n_probe
        self.chunks = verification_chunks(engine, layout, m) if chunks is None else chunks
        layout = layout.without_links()  # a full prefill: the prompt as the model reads it, no adapter
        self.layout = PromptLayout(layout.prefix_ids, [layout.chunk_ids[i] for i in self.chunks], layout.suffix_ids,
                                   [layout.order[i] for i in self.chunks], layout.pinned, layout.question)
        self.cache, logits = engine.full_prefill(self.layout, extra=n_probe)
        self.first = logits[-1].float().cpu()

    @torch.no_grad()
    def greedy_given(self, guess: list[int]) -> list[int]:
        guess = list(guess[:self.n_probe])
        if guess and int(torch.argmax(self.first)) != guess[0]:
            guess = []  # it leaves the guess at its first token: not worth a forward
        return force_greedy(self.engine, self.cache, self.layout.n_total, guess, self.n_probe, first=self.first).tokens

    @torch.no_grad()
    def probs_given(self, guess: list[int]) -> torch.Tensor:
        """The short prompt's probability of each token of ``guess`` (teacher-forced, one forward) -> [len]."""
        N, guess = self.layout.n_total, list(guess[:self.n_probe])
        if not guess:
            return torch.empty(0)
        rows = force_greedy(self.engine, self.cache, N, guess, first=self.first).forced
        self.cache.truncate(N)
        return torch.softmax(rows, -1).gather(1, torch.tensor(guess).view(-1, 1)).flatten()

    def answer_given(self, guess: list[int]) -> str:
        """`greedy_given` as text."""
        return answer_text(self.engine, self.greedy_given(guess), strip=False)


def reference_answer(engine, layout, m: int, n_probe: int) -> Reference:
    """Full prefill of ``layout`` reduced to `verification_chunks`, greedy for ``n_probe`` tokens."""
    short = ShortPrompt(engine, layout, m, n_probe)
    return Reference(short.answer_given([]), short.chunks, short.layout.n_context)
