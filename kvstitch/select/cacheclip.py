"""CacheClip (Yang et al. 2025, "CacheClip: Accelerating RAG with Effective KV Cache Reuse").

An *auxiliary* model picks the tokens the primary model recomputes (Sec. 2.8, 3.3, 3.4):

1. Shared prefix (Sec. 3.1): the auxiliary model has its own per-chunk caches, each precomputed after
   the auxiliary model's own shared prefix (its `PromptBuilder` prefix), looked up in / written to the
   auxiliary engine's chunk store (in memory by default), so a chunk seen before costs nothing.
2. Chunk + question (Sec. 3.3): every chunk is followed by the question - the auxiliary model's own
   suffix for the same question text (question + end of turn + assistant header) - and only those query
   tokens run through the auxiliary model, over [prefix][chunk_i] from the cache. The paper batches
   the chunks; kvstitch's engine is batch-1, so the chunks are looped (each pass is |Q| tokens).
3. Importance (Sec. 3.3): the *last layer's* attention from the query tokens to the chunk tokens (prefix
   and query columns excluded), averaged over the query tokens; heads: per query head, then the mean
   within each KV group and over the groups (`scoring.head_mean`, docs/design.md's GQA rule).
4. Token alignment (Sec. 3.4) by CHARACTER OFFSETS: both tokenizers cut the same chunk text. A primary
   context token gets the MAX score of the auxiliary tokens whose character span overlaps its own
   (max, not mean: a primary token covering any important auxiliary piece - say half of a number that
   the two tokenizers split differently - must be recomputed; ``align="mean"`` is available). A primary
   token overlapping none (e.g. a separator one tokenizer puts elsewhere) takes its nearest auxiliary
   token's score. Spans are compared in "core text" coordinates (the chunk text without the separator
   `PromptBuilder.chunk_piece` adds), so pairs whose builders chose different separators still align.
5. Grouping (Sec. 3.3): windows of ``group_size`` = 8, a window keeps its selected tokens only if at
   least ``group_min`` = 5 were selected; sparse windows are dropped and, as in the paper, their budget
   is NOT spent elsewhere: CacheClip recomputes at most ``budget`` tokens (the engine reports how many,
   ``recomputed_tokens``; ``stats["grouping_dropped"]`` = budget - recomputed). ``refill=True`` refills
   the budget window-wise (see `grouping.py`; alias `cacheclip_refill`).

The question is the layout's own (`PromptLayout.question`, set by `PromptBuilder.build`): it is never
recovered from the suffix ids (a suffix carrying more than the builder's template, e.g. RULER's answer
prefix, would silently turn into a different query). A layout without it is an `InputError`.

The auxiliary model: ``aux_engine=`` (any engine object), or ``aux_model=`` ("self" = the primary engine,
otherwise any model spec `kvstitch.models.load_model` accepts, e.g. "gemma3", "smollm2" or a path),
default the embedded SmolLM2-135M, loaded once per process by `SelectionContext.auxiliary_engine`
(`kvstitch.models.load_model`, wrapped in the primary engine's own class: `select` never imports
`kvstitch.engine`). The paper's pair is a small model of
another family than the primary (its Sec. 2.8 finds last-layer attention aligned across families);
kvstitch's reference pair is Gemma 3 270M (primary, ``Engine.load("gemma3")``) + SmolLM2-135M
(auxiliary). Any pair works; when the auxiliary model is the primary model itself (same weights),
``stats["cacheclip_self_guided"]`` is True: the rows then measure self-guidance, not CacheClip's
small-model guidance. The paper fine-tunes the auxiliary model (Sec. 3.5); kvstitch uses it as released.

The chunk texts are recovered from the primary layout's ids (decode; the spans come from re-encoding
with ``return_offsets_mapping`` when that reproduces the ids, else from incremental decoding).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import ClassVar, Literal

import torch

from kvstitch.core.errors import InputError
from kvstitch.core.prompt import PromptLayout
from .context import SelectionContext
from .method import Selector, register
from .grouping import grouped_top_k
from .attention_scores import head_mean

# ---- character spans ----------------------------------------------------------------------------
def _decode(tok, ids) -> str:
    return tok.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


def decode_spans(tok, ids: list[int]) -> torch.Tensor:
    """[n, 2] character spans of ``ids`` in ``decode(ids)`` by incremental decoding (the fallback:
    O(n^2) decodes; a token ending inside a multi-byte character gets an empty span)."""
    ends, best = [], 0
    for j in range(len(ids)):
        best = max(best, len(_decode(tok, ids[:j + 1]).rstrip("\ufffd")))
        ends.append(best)
    starts = [0] + ends[:-1]
    return torch.tensor([starts, ends], dtype=torch.long).T.reshape(len(ids), 2)


def encode_with_spans(tok, text: str) -> tuple[list[int], torch.Tensor]:
    """Tokenize ``text`` as `PromptBuilder` does (no special tokens) -> (ids, [n, 2] character spans)."""
    try:
        enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        return list(enc["input_ids"]), torch.tensor(enc["offset_mapping"], dtype=torch.long).reshape(-1, 2)
    except (NotImplementedError, TypeError, ValueError, KeyError):  # slow tokenizers have no offsets
        ids = tok.encode(text, add_special_tokens=False)
        return ids, decode_spans(tok, ids)


def spans_of_ids(tok, ids: list[int]) -> tuple[str, torch.Tensor]:
    """The text ``ids`` decode to and each id's character span in it."""
    text = _decode(tok, ids)
    enc_ids, spans = encode_with_spans(tok, text)
    if enc_ids != list(ids):  # re-encoding is not the identity: fall back to incremental decoding
        spans = decode_spans(tok, list(ids))
    return text, spans


def _lead(text: str) -> int:
    return len(text) - len(text.lstrip())


def align_scores(primary_spans: torch.Tensor, aux_spans: torch.Tensor, aux_scores: torch.Tensor,
                 reduce: str = "max") -> torch.Tensor:
    """Score of every primary token from the auxiliary tokens overlapping its character span.

    Spans are [start, end) in one shared coordinate system; both lists in token order (starts and
    ends non-decreasing). No overlap -> the nearest auxiliary token."""
    n, m = primary_spans.shape[0], aux_spans.shape[0]
    if m == 0:
        return torch.zeros(n)
    a_start = torch.cummax(aux_spans[:, 0], 0).values.contiguous()
    a_end = torch.cummax(aux_spans[:, 1], 0).values.contiguous()
    p_start, p_end = primary_spans[:, 0].contiguous(), primary_spans[:, 1].contiguous()
    lo = torch.searchsorted(a_end, p_start, right=True)  # first aux token ending after the span starts
    hi = torch.searchsorted(a_start, p_end, right=False)  # first aux token starting at/after its end
    count = (hi - lo).clamp(min=0)
    width = max(1, int(count.max()))
    idx = lo[:, None] + torch.arange(width)[None]
    valid = idx < hi[:, None]
    vals = aux_scores.float()[idx.clamp(max=m - 1)]
    if reduce == "max":
        out = vals.masked_fill(~valid, float("-inf")).max(1).values
    elif reduce == "mean":
        out = (vals * valid).sum(1) / count.clamp(min=1)
    else:
        raise ValueError(f"align must be 'max' or 'mean', got {reduce!r}")
    none = count == 0
    if none.any():  # nearest auxiliary token by character gap
        gap = torch.maximum(aux_spans[None, :, 0] - p_end[none, None], p_start[none, None] - aux_spans[None, :, 1])
        out[none] = aux_scores.float()[gap.clamp(min=0).argmin(1)]
    return out


# ---- the selector -------------------------------------------------------------------------------
@register
@dataclass
class CacheClip(Selector):
    """CacheClip: an auxiliary model's last-layer question->chunk attention, aligned by character
    offsets, grouped in windows of 8 (>= 5 selected)."""

    name: ClassVar[str] = "cacheclip"
    aux_model: str | None = None  # None: embedded SmolLM2; "self": the primary engine; else a load_model spec
    aux_device: str | None = None  # None: the primary engine's device
    align: Literal["max", "mean"] = "max"
    group_size: int = 8
    group_min: int = 5
    refill: bool = False  # True: refill the budget of dropped windows (exact budget); False: the paper
    aux_engine: object = field(default=None, repr=False, compare=False)

    def _aux(self, ctx: SelectionContext):
        if self.aux_engine is not None:
            return self.aux_engine
        if self.aux_model == "self":
            return ctx.engine
        self.aux_engine = ctx.auxiliary_engine(self.aux_model, self.aux_device)
        return self.aux_engine

    @property
    def exact_budget(self) -> bool:
        return self.refill

    def aux_token_scores(self, aux, question: str, cores: list[str]):
        """-> per chunk (aux chunk-piece spans in core coordinates, aux token scores). ``aux``: an engine,
        used through a `SelectionContext` of its own like the primary one."""
        actx = SelectionContext(aux, None, None, 0)
        b, tok = actx.builder, actx.tokenizer
        pieces = [b.chunk_piece(c) for c in cores]
        encoded = [encode_with_spans(tok, p) for p in pieces]
        suffix = torch.tensor(tok.encode(b.suffix_text(question), add_special_tokens=False), dtype=torch.long)
        layout = PromptLayout(b.prefix_ids, [torch.tensor(ids, dtype=torch.long) for ids, _ in encoded], suffix,
                              question=question)
        kvs = actx.chunk_kvs(layout)  # the auxiliary model's own per-chunk caches (store-backed)
        last = actx.num_layers - 1
        out = []
        for piece, (ids, spans), kv in zip(pieces, encoded, kvs):
            one = PromptLayout(layout.prefix_ids, [kv.token_ids.to(torch.long)], suffix)  # chunk_i + question
            per_head = actx.query_attention([last], cache=actx.stitch(one, [kv]), layout=one)[last]  # [Hq, n_i]
            scores = head_mean(per_head, actx.num_kv_heads).float().cpu()
            out.append((spans - _lead(piece), scores))
        return out

    def score(self, ctx: SelectionContext) -> torch.Tensor:
        t0 = time.perf_counter()
        aux, lay = self._aux(ctx), ctx.layout
        texts, p_spans = [], []
        for ids in lay.chunk_ids:
            text, spans = spans_of_ids(ctx.tokenizer, ids.tolist())
            texts.append(text)
            p_spans.append(spans - _lead(text))
        question = lay.question
        if not isinstance(question, str) or not question.strip():
            raise InputError("cacheclip needs the question text: the layout has none (build it with "
                             "Engine.layout / PromptBuilder.build, or pass PromptLayout(..., question=...))")
        per_chunk = self.aux_token_scores(aux, question, [t.strip() for t in texts])
        scores = torch.cat([align_scores(ps, a_spans, a_scores, self.align)
                            for ps, (a_spans, a_scores) in zip(p_spans, per_chunk)])
        primary = ctx.engine
        self_guided = aux is primary or getattr(aux, "fingerprint", None) == getattr(primary, "fingerprint", 0)
        ctx.stats.update(cacheclip_aux=aux.adapter.family, cacheclip_aux_s=time.perf_counter() - t0,
                         cacheclip_self_guided=bool(self_guided))
        return scores

    def pick(self, scores: torch.Tensor, ctx: SelectionContext) -> torch.Tensor:
        idx = grouped_top_k(scores, ctx.budget, self.group_size, self.group_min, self.refill)
        ctx.stats.update(selection_budget=int(ctx.budget), grouping_dropped=int(ctx.budget - idx.numel()))
        return idx
