"""Split documents into token-bounded chunks at natural boundaries (paragraph > sentence/line > tokens).

Chunks are the reuse unit of the store, so a chunk should be a self-contained span: whole paragraphs
when they fit, whole sentences otherwise, and a token split only for a single sentence longer than the
budget. Every chunk is re-tokenized and checked against `chunk_tokens` (token counts of pieces do not
add up exactly under BPE), and no chunk is empty. Text chunks are exact substrings of the document
(only a token-split sentence goes through `decode`).
"""

from __future__ import annotations

import re
from pathlib import Path

from kvstitch.core.errors import InputError

# the default max chunk size of documents precomputed whole (`kvstitch precompute`). Larger chunks keep more answers
# once stitched (SQuAD, passages joined 4 to a chunk) but retrieve worse at the same context budget (MiniLM, SQuAD:
# answer recall at 2K tokens 0.92 with 256-token chunks, 0.84 with 512): docs/results/squad/retrieval. A collection
# (`kvstitch index`) ranks smaller chunks and stitches their blocks instead (`kvstitch.corpus.units`).
DOCUMENT_CHUNK_TOKENS = 256

_PARA = re.compile(r"\n[ \t]*\n\s*")
# a unit ends after . ! ? or an ellipsis (optionally one closing quote/bracket) before spaces, or at a line break
_SENT = re.compile(r"(?:(?<=[.!?\u2026])|(?<=[.!?\u2026][\"'\u201d\u2019)\]]))[ \t]+|[ \t]*\n\s*")
_ABBREV = re.compile(r"(?:\b(?:e\.g|i\.e|etc|vs|cf|al|Mr|Mrs|Ms|Dr|Prof|St|No|Fig|Eq|Sec|approx)|\b[A-Z])\.$")


def _split_spans(text: str, sep: re.Pattern, start: int, end: int):
    """Non-blank (start, end) spans of text[start:end] between matches of `sep`, whitespace trimmed."""
    pos = start
    for m in list(sep.finditer(text, start, end)) + [None]:
        e = m.start() if m else end
        piece = text[pos:e]
        if piece.strip():
            yield pos + len(piece) - len(piece.lstrip()), pos + len(piece.rstrip())
        if m:
            pos = m.end()


def _units(text: str) -> list[tuple[int, int, bool]]:
    """(start, end, starts_paragraph) character spans of the sentences/lines of `text`."""
    out: list[tuple[int, int, bool]] = []
    for p0, p1 in _split_spans(text, _PARA, 0, len(text)):
        for j, (a, b) in enumerate(_split_spans(text, _SENT, p0, p1)):
            prev = out[-1] if out and j > 0 else None
            if prev and _ABBREV.search(text, prev[0], prev[1]) and "\n" not in text[prev[1]:a]:
                out[-1] = (prev[0], b, prev[2])  # "e.g. here" is not a sentence end
            else:
                out.append((a, b, j == 0))
    return out


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def chunk_text(text: str, tokenizer, chunk_tokens: int = DOCUMENT_CHUNK_TOKENS, overlap: int = 0) -> list[str]:
    """Split `text` into chunks of at most `chunk_tokens` tokens at paragraph/sentence boundaries.

    `overlap`: up to this many tokens of whole trailing sentences of a chunk are repeated at the start of
    the next one (0: none). A sentence longer than `chunk_tokens` is split by tokens (with `overlap` tokens
    of overlap between its pieces).
    """
    if chunk_tokens < 1:
        raise InputError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    if not 0 <= overlap < chunk_tokens:
        raise InputError(f"overlap must be in [0, chunk_tokens), got {overlap} for chunk_tokens={chunk_tokens}")
    units = _units(text)
    if not units:
        return []
    ntok = [len(_encode(tokenizer, text[a:b])) for a, b, _ in units]
    chunks: list[str] = []
    cur: list[int] = []  # indices into units

    def span(ix: list[int]) -> str:
        return text[units[ix[0]][0]:units[ix[-1]][1]]

    def fits(ix: list[int]) -> bool:
        return sum(ntok[i] for i in ix) <= chunk_tokens and len(_encode(tokenizer, span(ix))) <= chunk_tokens

    def tail(ix: list[int]) -> list[int]:
        """The trailing whole units of a flushed chunk to repeat (<= overlap tokens)."""
        out, n = [], 0
        for i in reversed(ix):
            if n + ntok[i] > overlap:
                break
            out.insert(0, i)
            n += ntok[i]
        return out if len(out) < len(ix) else out[1:]  # never repeat a whole chunk

    def flush(ix: list[int]) -> None:
        if ix:
            chunks.append(span(ix))

    for i, (_, _, para_start) in enumerate(units):
        if ntok[i] > chunk_tokens:  # one sentence over budget: token windows
            flush(cur)
            cur = []
            chunks.extend(_split_tokens(tokenizer, text[units[i][0]:units[i][1]], chunk_tokens, overlap))
            continue
        if fits(cur + [i]):
            cur.append(i)
            continue
        # overflow: prefer ending at the last paragraph boundary if that chunk is at least half full
        cut = max((j for j in range(1, len(cur)) if units[cur[j]][2]), default=None)
        if cut is not None and sum(ntok[j] for j in cur[:cut]) >= chunk_tokens // 2 and fits(cur[cut:] + [i]):
            flush(cur[:cut])
            cur = cur[cut:] + [i]
            continue
        flush(cur)
        carry = tail(cur) if overlap else []
        cur = carry + [i] if carry and fits(carry + [i]) else [i]
    flush(cur)
    return [c for c in chunks if c.strip()]


def _split_tokens(tokenizer, sentence: str, chunk_tokens: int, overlap: int) -> list[str]:
    ids = _encode(tokenizer, sentence)
    out, s = [], 0
    while s < len(ids):
        n = chunk_tokens
        while True:  # decode->encode may grow under BPE: shrink the window until it re-encodes within budget
            piece = tokenizer.decode(ids[s:s + n]).strip()
            if n == 1 or len(_encode(tokenizer, piece)) <= chunk_tokens:
                break
            n -= max(1, n // 16)
        if piece:
            out.append(piece)
        if s + n >= len(ids):
            break
        s += max(1, n - overlap)
    return out


def chunk_directory(docs_dir, tokenizer, chunk_tokens: int = DOCUMENT_CHUNK_TOKENS, overlap: int = 0) -> list[tuple[str, str]]:
    """``(doc_name, chunk)`` for every ``*.txt`` / ``*.md`` file directly in `docs_dir`, sorted by name."""
    root = Path(docs_dir)
    if not root.is_dir():
        raise InputError(f"documents directory not found: {root}")
    files = sorted(p for p in root.iterdir() if p.is_file() and p.suffix.lower() in (".txt", ".md"))
    out = []
    for p in files:
        try:
            text = p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise InputError(f"cannot read {p}: {e}") from None
        out.extend((p.name, c) for c in chunk_text(text, tokenizer, chunk_tokens, overlap))
    return out
