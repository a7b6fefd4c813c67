"""The adaptive budget's verification (`kvstitch.engine.budget`, ``verify_chunks`` > 0): a short prompt, the
question over only the few chunks most relevant to it, prefilled in full once, whose greedy answer a round's probe
must reproduce; and the greedy probe itself, which both the rounds and the short prompt decode."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Probe:
    """A round's greedy answer start: ``tokens`` and the next-token logits ``[len(tokens), V]`` that chose them."""

    tokens: list[int]
    logits: torch.Tensor


def greedy_probe(engine, cache, start_slot: int, first_logits: torch.Tensor, tokens: list[int],
                 logits: list[torch.Tensor], n_probe: int) -> Probe:
    """Extend ``tokens`` greedily (their K/V but the last's are in the cache) to ``n_probe`` tokens or EOS.
    ``first_logits`` chose ``tokens[-1]`` (or, with ``tokens`` empty, are the logits of the first token)."""
    tokens, logits = list(tokens), list(logits)
    if not tokens:
        tokens.append(int(torch.argmax(first_logits)))
        logits.append(first_logits.float().cpu())
    while len(tokens) < n_probe and not engine.finished(tokens):
        slot = start_slot + len(tokens) - 1
        out = engine.forward(cache, torch.tensor([tokens[-1]]), torch.tensor([slot]))[-1]
        tokens.append(int(torch.argmax(out)))
        logits.append(out.float().cpu())
    return Probe(tokens, torch.stack(logits))


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
    it: when a round says what the short prompt says, checking it costs one forward of its few tokens instead
    of decoding the short prompt's answer token by token."""

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
        N, eng, first = self.layout.n_total, self.engine, self.first
        guess = list(guess[:self.n_probe])
        self.cache.truncate(N)
        if not guess or int(torch.argmax(first)) != guess[0]:
            return greedy_probe(eng, self.cache, N, first, [], [], self.n_probe).tokens
        out = [] if len(guess) == 1 else list(eng.forward(self.cache, torch.tensor(guess[:-1]),
                                                         torch.arange(N, N + len(guess) - 1),
                                                         logits_to_keep=len(guess) - 1).float().cpu())
        logits = [first] + out  # logits[i] chose the short prompt's token i; guess[:k] is its own so far
        k = 1
        while True:
            if eng.finished(guess[:k]) or k == self.n_probe:
                return guess[:k]
            if k == len(guess):  # all of the guess is its own: continue after it (its last K/V not written yet)
                return greedy_probe(eng, self.cache, N, first, guess, logits[:k], self.n_probe).tokens
            own = int(torch.argmax(logits[k]))
            if own != guess[k]:  # it leaves the guess here: its own token, then step by step
                self.cache.truncate(N + k)
                return greedy_probe(eng, self.cache, N, first, guess[:k] + [own], logits[:k + 1], self.n_probe).tokens
            k += 1

    @torch.no_grad()
    def probs_given(self, guess: list[int]) -> torch.Tensor:
        """The short prompt's probability of each token of ``guess`` (teacher-forced, one forward) -> [len]."""
        N, guess = self.layout.n_total, list(guess[:self.n_probe])
        if not guess:
            return torch.empty(0)
        self.cache.truncate(N)
        rows = [self.first]
        if len(guess) > 1:
            rows += list(self.engine.forward(self.cache, torch.tensor(guess[:-1]), torch.arange(N, N + len(guess) - 1),
                                             logits_to_keep=len(guess) - 1).float().cpu())
        self.cache.truncate(N)
        return torch.softmax(torch.stack(rows), -1).gather(1, torch.tensor(guess).view(-1, 1)).flatten()

    def answer_given(self, guess: list[int]) -> str:
        """`greedy_given` as text."""
        return self.engine.answer_text(self.greedy_given(guess), strip=False)


def reference_answer(engine, layout, m: int, n_probe: int) -> Reference:
    """Full prefill of ``layout`` reduced to `verification_chunks`, greedy for ``n_probe`` tokens."""
    short = ShortPrompt(engine, layout, m, n_probe)
    return Reference(short.answer_given([]), short.chunks, short.layout.n_context)
