"""SQuAD over real retrieval: each question over the units a retriever returns from the whole dev set.

`kvstitch.tasks.squad` gives every question its gold paragraph among other paragraphs of its article: the
passages are fixed, so what a chunking costs in retrieval does not show. Here every article of the dev set is one
document of one collection, chunked as ``kvstitch index`` chunks documents (`kvstitch.text.chunk_text` with the
model's tokenizer, ``chunk_tokens`` at most) and embedded as it embeds (MiniLM; BM25 without it), and a question
gets the best cache units of the whole collection, best first, until ``context_tokens`` are full
(`kvstitch.corpus.retrieval.Collection.search`). ``block_chunks`` K > 1 is small-to-big: chunks are ranked, but
the unit stitched is the block of K consecutive chunks holding one, as a collection indexed with
``--block-chunks K`` stitches. So one command compares chunkings on answers, retrieval and stitching together.

The gold position is the first unit that holds one of the answers (whole words, SQuAD-normalised); None when
retrieval missed it (full prefill rarely answers those, so they fall out of "answers kept").
"""

from __future__ import annotations

import hashlib
import json
import logging
from functools import lru_cache

import torch
from rich.console import Console
from rich.progress import track

from kvstitch.core.errors import InputError, KVStitchError
from kvstitch.tasks.grading import normalize_answer
from kvstitch.tasks.squad import ANSWER_TOKENS, INSTRUCTION, ABSTAIN_INSTRUCTION, read_squad
from kvstitch.tasks.tasks import Sample

log = logging.getLogger("kvstitch.eval")
_stderr = Console(stderr=True)  # its own: rich allows one live display per console, and an eval may show one


def task_name(version: str, context_tokens: int, chunk_tokens: int, block_chunks: int = 1) -> str:
    """``squad_r2048_c256``; small-to-big ``squad_r2048_c128x4``."""
    return f"{version}_r{context_tokens}_c{chunk_tokens}" + (f"x{block_chunks}" if block_chunks > 1 else "")


def answer_in(text: str, answers) -> bool:
    """One of `answers` appears in `text` as whole words, both SQuAD-normalised."""
    norm = f" {normalize_answer(text)} "
    return any(f" {normalize_answer(a)} " in norm for a in answers if normalize_answer(a))


def embedder_name() -> str:
    """What ranks the chunks (part of a run's protocol): the embedding model, or bm25 without it."""
    from kvstitch.corpus.retrieval import EMBED_MODEL_NAME, embedder_dir

    return EMBED_MODEL_NAME if embedder_dir() is not None else "bm25"


@lru_cache(maxsize=4)
def squad_collection(version: str, tokenizer, chunk_tokens: int, block_chunks: int = 1):
    """The dev set's articles as one `Collection` (documents ``article<i>``): built once (minutes: chunking at
    sentence boundaries re-tokenises, and every chunk is embedded) and kept under
    ``$KVSTITCH_CACHE/squad-collections``, keyed by everything that shapes it."""
    from kvstitch.corpus.retrieval import CollectionNotFound, load_collection
    from kvstitch.models.loader import cache_root

    from kvstitch.tasks.squad import FILES

    ranker = embedder_name()
    key = json.dumps([FILES[version], getattr(tokenizer, "name_or_path", ""), len(tokenizer), chunk_tokens,
                      block_chunks, ranker])
    name = f"{version}-c{chunk_tokens}x{block_chunks}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    root = cache_root() / "squad-collections"
    try:
        return load_collection(name, root)
    except CollectionNotFound:  # the first run on this machine builds it
        log.info("building %s under %s", name, root)
    except KVStitchError as e:  # damaged (an interrupted write): rebuilt
        log.warning("rebuilding %s: %s", name, e)
    col = _build_collection(version, tokenizer, chunk_tokens, block_chunks, name)
    col.meta = {"key": key}
    col.save(root)
    return col


def _build_collection(version: str, tokenizer, chunk_tokens: int, block_chunks: int, name: str):
    from kvstitch.corpus.retrieval import Chunk, Collection, get_embedder, group_blocks
    from kvstitch.text.chunking import chunk_text

    squad = read_squad(version)
    chunks = []
    articles = track(squad.articles, f"chunking {version}'s articles (once)", transient=True, console=_stderr)
    for a, paras in enumerate(articles):
        chunks += [Chunk(id=f"article{a}#{j}", doc=f"article{a}", text=t)
                   for j, t in enumerate(chunk_text("\n\n".join(paras), tokenizer, chunk_tokens))]
    blocks = group_blocks(chunks, block_chunks) if block_chunks > 1 else None
    for c in chunks + (blocks or []):
        c.n_tokens = len(tokenizer.encode(c.text, add_special_tokens=False))
    embedder = get_embedder()
    chunks_text = [c.text for c in chunks]
    if embedder is None:
        return Collection(name, chunks, "bm25", blocks=blocks)
    emb = torch.cat([embedder.encode(chunks_text[i:i + 256]) for i in
                     track(range(0, len(chunks_text), 256), f"embedding {len(chunks)} chunks", transient=True,
                           console=_stderr)])
    return Collection(name, chunks, "embedding", embeddings=emb, blocks=blocks)


def load_squad_retrieved(version: str, tokenizer, context_tokens: int, chunk_tokens: int, block_chunks: int = 1,
                         start: int = 0, stop: int | None = None) -> list[Sample]:
    """Samples ``start`` .. ``stop`` of SQuAD's visiting order, each over the units retrieved for it."""
    check_retrieval(context_tokens, chunk_tokens, block_chunks)
    squad = read_squad(version)
    n = len(squad.questions)
    if not 0 <= start < n or (stop is not None and not start < stop):
        raise InputError(f"sample range {start}:{'' if stop is None else stop} is outside {version}'s {n} questions")
    col = squad_collection(version, tokenizer, chunk_tokens, block_chunks)
    task = task_name(version, context_tokens, chunk_tokens, block_chunks)
    instruction = INSTRUCTION + (ABSTAIN_INSTRUCTION if version == "squad2" else "")
    out = []
    for i in range(start, min(stop if stop is not None else n, n)):
        q = squad.questions[i]
        units = [h.text for h in col.search(q.text, k=None, max_tokens=context_tokens)]
        if not units:
            raise InputError(f"--retrieve {context_tokens}: no retrieved unit fits (units of up to "
                             f"{chunk_tokens * block_chunks} tokens); raise it")
        gold = next((j for j, u in enumerate(units) if q.answers and answer_in(u, q.answers)), None)
        out.append(Sample(task=task, chunks=units, question=f"{q.text}\n{instruction}", answers=list(q.answers),
                          meta={"task": task, "seed": 0, "index": i, "length": 0, "chunk_tokens": chunk_tokens,
                                "depth": None if gold is None else gold / max(1, len(units) - 1),
                                "gold_position": gold, "n_passages": len(units), "n_chunks": len(units),
                                "raw_question": q.text, "qid": q.qid, "answerable": bool(q.answers),
                                "max_new_tokens": ANSWER_TOKENS, "qa": True, "squad": version}))
    return out


def check_retrieval(context_tokens: int, chunk_tokens: int, block_chunks: int) -> None:
    """The options' values, before any model or embedding time is spent."""
    for name, v in (("--retrieve", context_tokens), ("--chunk-tokens", chunk_tokens), ("--block-chunks", block_chunks)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise InputError(f"{name} must be a positive integer, got {v!r}")
    if chunk_tokens * block_chunks > context_tokens:
        raise InputError(f"--retrieve {context_tokens} holds no unit of up to {chunk_tokens} x {block_chunks} "
                         "tokens: raise it or make the units smaller")
