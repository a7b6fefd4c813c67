"""The prompt layout: shared prefix / chunks / suffix, tokenized piecewise and concatenated.

    prefix  = chat template up to the passages header (identical for every request: the attention sink
              every chunk is precomputed against)
    chunk_i = separator + passage text (or text + separator, whichever keeps seams clean)
    suffix  = question + end of turn + assistant header

The full-prefill baseline uses exactly these concatenated ids, so every method sees the same tokens.
The separator is chosen per tokenizer so that the piecewise ids also equal the joint tokenization of
the whole prompt (clean seams); `seam_exact` checks that.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

INSTRUCTION = ("Answer the question based on the given passages. "
               "Only give me the answer and do not output any other words.")
HEADER = "The following are given passages.\n\n"
_CTX, _Q = "\x00CTX\x00", "\x00Q\x00"
# (where the separator goes, separator): leading separators keep BPE seams clean for GPT-2-style
# pre-tokenizers, which split "\n\nWord" as "\n", "\n", "Word" only when the newlines start the piece.
_SEPARATORS = (("lead", "\n\n"), ("trail", "\n\n"), ("lead", "\n"), ("trail", "\n"))
_PROBE = ["Alice lives in Paris. The sky is blue.", "Bob's number is 42, and 7 is lucky!", "(Another) passage: x=3"]


@dataclass
class PromptLayout:
    prefix_ids: torch.Tensor
    chunk_ids: list[torch.Tensor]
    suffix_ids: torch.Tensor
    order: list[int] = field(default_factory=list)  # chunk order used (identity unless reordered)

    def __post_init__(self):
        if not self.order:
            self.order = list(range(len(self.chunk_ids)))

    @property
    def n_prefix(self) -> int:
        return self.prefix_ids.numel()

    @property
    def n_context(self) -> int:
        return sum(c.numel() for c in self.chunk_ids)

    @property
    def n_suffix(self) -> int:
        return self.suffix_ids.numel()

    @property
    def n_total(self) -> int:
        return self.n_prefix + self.n_context + self.n_suffix

    @property
    def context_start(self) -> int:
        return self.n_prefix

    @property
    def context_end(self) -> int:
        return self.n_prefix + self.n_context

    @property
    def chunk_starts(self) -> list[int]:
        starts, pos = [], self.n_prefix
        for c in self.chunk_ids:
            starts.append(pos)
            pos += c.numel()
        return starts

    @property
    def ids(self) -> torch.Tensor:
        return torch.cat([self.prefix_ids, *self.chunk_ids, self.suffix_ids])

    def chunk_index(self) -> torch.Tensor:
        """[n_context] chunk number of every context token (in layout order)."""
        return torch.cat([torch.full((c.numel(),), i, dtype=torch.long) for i, c in enumerate(self.chunk_ids)])

    def reordered(self, order: list[int]) -> "PromptLayout":
        return PromptLayout(self.prefix_ids, [self.chunk_ids[i] for i in order], self.suffix_ids,
                            [self.order[i] for i in order])


def with_answer_prefix(layout: PromptLayout, tokenizer, answer_prefix: str | None) -> PromptLayout:
    """`layout` with an answer prefix (RULER's "The special magic number for X mentioned in the provided
    text is") appended after the assistant header. It belongs to the suffix, so query-driven selectors see
    it as part of the query. None or "" leaves the layout as it is."""
    if not answer_prefix:
        return layout
    extra = tokenizer.encode(answer_prefix.strip(), add_special_tokens=False)
    return replace(layout, suffix_ids=torch.cat([layout.suffix_ids, torch.tensor(extra, dtype=torch.long)]))


class PromptBuilder:
    """Turns (question, chunks) into a `PromptLayout` for one tokenizer."""

    def __init__(self, tokenizer, instruction: str = INSTRUCTION):
        self.tok = tokenizer
        self.instruction = instruction
        self._raw_prefix, self._raw_suffix = self._split_template()
        self.separator = next((s for s in _SEPARATORS if self._seams_ok(s)), _SEPARATORS[0])
        self.prefix_ids = self._encode(self.prefix_text, first=True)

    @property
    def prefix_text(self) -> str:
        return self._raw_prefix.rstrip() if self.separator[0] == "lead" else self._raw_prefix

    def _split_template(self) -> tuple[str, str]:
        user = f"{self.instruction}\n\n{HEADER}{_CTX}Question: {_Q}"
        if getattr(self.tok, "chat_template", None):
            text = self.tok.apply_chat_template([{"role": "user", "content": user}], tokenize=False,
                                                add_generation_prompt=True)
        else:  # base models (e.g. Gemma 3 270M): a plain completion prompt
            text = f"{user}\nAnswer:"
        prefix, rest = text.split(_CTX)
        return prefix, rest

    def _encode(self, text: str, first: bool = False) -> torch.Tensor:
        ids = self.tok.encode(text, add_special_tokens=first)
        bos = self.tok.bos_token_id
        if first and bos is not None and len(ids) > 1 and ids[0] == bos and ids[1] == bos:
            ids = ids[1:]  # the template already had BOS
        return torch.tensor(ids, dtype=torch.long)

    def chunk_piece(self, text: str) -> str:
        where, sep = self.separator
        return sep + text.strip() if where == "lead" else text.strip() + sep

    def encode_chunk(self, text: str) -> torch.Tensor:
        """The ids a chunk has inside any prompt (what the store keys and caches)."""
        return self._encode(self.chunk_piece(text))

    def suffix_text(self, question: str) -> str:
        where, sep = self.separator
        suffix = self._raw_suffix.replace(_Q, question.strip())
        return sep + suffix if where == "lead" else suffix

    def build(self, question: str, chunks: list[str]) -> PromptLayout:
        return PromptLayout(self._encode(self.prefix_text, first=True),
                            [self.encode_chunk(c) for c in chunks],
                            self._encode(self.suffix_text(question)))

    def joint_ids(self, question: str, chunks: list[str]) -> torch.Tensor:
        text = self.prefix_text + "".join(self.chunk_piece(c) for c in chunks) + self.suffix_text(question)
        return self._encode(text, first=True)

    def seam_exact(self, question: str, chunks: list[str]) -> bool:
        return torch.equal(self.build(question, chunks).ids, self.joint_ids(question, chunks))

    def _seams_ok(self, sep: str) -> bool:
        old = getattr(self, "separator", None)
        self.separator = sep
        try:
            return self.seam_exact("Where does Alice live?", _PROBE)
        finally:
            self.separator = old
