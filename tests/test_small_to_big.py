"""Small-to-big: chunks ranked, blocks of consecutive chunks stitched (collections and SQuAD over retrieval)."""

from __future__ import annotations

import gzip
import json
import uuid

import pytest
from typer.testing import CliRunner

from kvstitch.cli.main import app
from kvstitch.core.errors import InputError, KVStitchError
from kvstitch.corpus import retrieval
from kvstitch.corpus.retrieval import Chunk, Collection, build_index, group_blocks, load_collection
from kvstitch.corpus.units import INDEX_BLOCK_CHUNKS, INDEX_CHUNK_TOKENS
from kvstitch.eval.runner import EvalConfig, run_eval
from kvstitch.eval import squad_retrieval
from kvstitch.tasks import squad

from .conftest import make_tiny_engine


def _chunks(spec: dict[str, int]) -> list[Chunk]:
    return [Chunk(id=f"{doc}#{j}", doc=doc, text=f"{doc}{j}", n_tokens=10) for doc, n in spec.items() for j in range(n)]


def test_blocks_are_consecutive_chunks_of_one_document():
    chunks = _chunks({"a": 5, "b": 2})
    blocks = group_blocks(chunks, 2)
    assert [b.id for b in blocks] == ["a#0-1", "a#2-3", "a#4", "b#0-1"]  # a document's last block may be short
    assert [c.block for c in chunks] == [0, 0, 1, 1, 2, 3, 3]
    assert blocks[0].text == "a0\n\na1" and blocks[2].text == "a4" and {b.doc for b in blocks[3:]} == {"b"}
    with pytest.raises(InputError, match="block_chunks"):
        group_blocks(chunks, 0)


def test_a_block_ranks_as_its_best_chunk_enters_once_and_the_token_budget_stops_the_list(monkeypatch):
    chunks = _chunks({"a": 3, "b": 1})
    blocks = group_blocks(chunks, 2)  # a#0-1, a#2, b#0
    for b, n in zip(blocks, (20, 10, 10)):
        b.n_tokens = n
    col = Collection("c", chunks, "bm25", blocks=blocks)
    scores = {"a0": 0.5, "a1": 0.9, "a2": 0.1, "b0": 0.7}  # chunk a1 ranks first, a0 adds nothing again
    monkeypatch.setattr(Collection, "scores", lambda self, q, e=None: ([scores[c.text] for c in self.chunks], "x"))
    hits = col.search("q", k=None, max_tokens=40)
    assert [h.id for h in hits] == ["a#0-1", "b#0", "a#2"] and [h.rank for h in hits] == [0, 1, 2]
    assert hits[0].score == 0.9 and hits[0].text == "a0\n\na1"
    assert [h.id for h in col.search("q", k=None, max_tokens=39)] == ["a#0-1", "b#0"]  # a#2 would overflow
    assert [h.id for h in col.search("q", k=1)] == ["a#0-1"]
    assert [h.id for h in Collection("p", chunks, "bm25").search("q", k=2)] == ["a#1", "b#0"]  # no blocks: chunks
    with pytest.raises(InputError, match="k or max_tokens"):
        col.search("q", k=None)


@pytest.fixture(scope="module")
def engine(smollm_tokenizer):
    return make_tiny_engine("llama", smollm_tokenizer)


def test_an_index_of_blocks_precomputes_the_blocks_and_reloads_them(engine, tmp_path, monkeypatch):
    monkeypatch.setenv("KVSTITCH_EMBEDDER", "bm25")
    docs = tmp_path / "docs"
    docs.mkdir()
    tag = uuid.uuid4().hex[:6]  # fresh texts: the tiny engine's store is shared with other tests
    (docs / "a.txt").write_text(" ".join(f"[{tag}] Sentence {i} says the code of room {i} is {100 + i}."
                                         for i in range(12)))
    root = tmp_path / "cols"
    col = build_index(engine, docs, "kb", root, chunk_tokens=24, block_chunks=3)
    assert len(col.chunks) > 3 and len(col.blocks) == -(-len(col.chunks) // 3) and col.meta["block_chunks"] == 3
    assert all(c.key == "" for c in col.chunks) and all(b.key in engine.store for b in col.blocks)
    n_prefixes = len(engine.builder.canonical_prefixes())
    assert col.meta["precompute"]["computed"] == len({b.key for b in col.blocks}) * n_prefixes
    assert all(b.n_tokens > max(col.chunks[i].n_tokens for i in range(len(col.chunks)) if col.chunks[i].block == j)
               for j, b in enumerate(col.blocks) if b.id.count("-"))
    again = load_collection("kb", root)
    assert [(b.id, b.text, b.key) for b in again.blocks] == [(b.id, b.text, b.key) for b in col.blocks]
    assert [c.block for c in again.chunks] == [c.block for c in col.chunks]
    hit = again.search("What is the code of room 7?", k=1)[0]
    assert "is 107." in hit.text and hit.chunk in again.blocks
    p = root / "kb" / retrieval.BLOCKS
    p.write_text(p.read_text().replace("room", "hall"))
    with pytest.raises(KVStitchError, match="checksum mismatch"):
        load_collection("kb", root)
    with pytest.raises(InputError, match="overlap"):
        build_index(engine, docs, "kb2", root, chunk_tokens=24, overlap=4, block_chunks=2)

    # the default collection is small-to-big: 128-token chunks ranked, blocks of 4 stitched; overlapping chunks
    # (which cannot form blocks) and block_chunks=1 stitch the chunks themselves
    long = tmp_path / "long"
    long.mkdir()
    (long / "b.txt").write_text("\n\n".join(" ".join(f"[{tag}] Paragraph {p} sentence {i} names item {p * 40 + i}."
                                                      for i in range(20)) for p in range(8)))
    d = build_index(engine, long, "default", root, precompute=False)
    assert (d.meta["chunk_tokens"], d.meta["block_chunks"]) == (INDEX_CHUNK_TOKENS, INDEX_BLOCK_CHUNKS) == (128, 4)
    assert len(d.chunks) > 4 and len(d.blocks) == -(-len(d.chunks) // 4)
    assert max(c.n_tokens for c in d.chunks) < 2 * 128 < max(b.n_tokens for b in d.blocks)  # n_tokens: with separators
    ov = build_index(engine, long, "overlap", root, overlap=16, precompute=False)
    assert ov.blocks is None and ov.meta["block_chunks"] == 1
    assert build_index(engine, long, "plain", root, block_chunks=1, precompute=False).blocks is None
    with pytest.raises(InputError, match="positive integer"):
        build_index(engine, long, "bad", root, block_chunks=0, precompute=False)


def _squad_file(tmp_path) -> str:
    """Two articles of four paragraphs; paragraph (a, i) says "The code of hall A-i is C{a}{i}." and asks for it."""
    data = []
    for a in range(2):
        paras = [{"context": f"The code of hall {a}-{i} is C{a}{i}. " + "Filler words about halls. " * 6,
                  "qas": [{"id": f"q{a}{i}", "question": f"What is the code of hall {a}-{i}?",
                           "answers": [{"text": f"C{a}{i}"}]}]} for i in range(4)]
        data.append({"title": f"T{a}", "paragraphs": paras})
    path = tmp_path / "squad.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"version": "x", "data": data}, f)
    return str(path)


@pytest.fixture
def small_squad(tmp_path, monkeypatch):
    path = _squad_file(tmp_path)
    real = squad.read_squad
    monkeypatch.setattr(squad_retrieval, "read_squad", lambda version, p=None: real(version, path))
    monkeypatch.setattr(squad, "read_squad", lambda version, p=None: real(version, path))
    monkeypatch.setenv("KVSTITCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("KVSTITCH_EMBEDDER", "bm25")
    squad_retrieval.squad_collection.cache_clear()
    yield
    squad_retrieval.squad_collection.cache_clear()


def test_squad_over_retrieval_fills_the_budget_best_first_and_finds_the_gold_unit(small_squad, smollm_tokenizer):
    spec = {"context_tokens": 120, "chunk_tokens": 24, "block_chunks": 2}
    samples = squad_retrieval.load_squad_retrieved("squad", smollm_tokenizer, start=0, stop=8, **spec)
    col = squad_retrieval.squad_collection("squad", smollm_tokenizer, 24, 2)
    assert len(samples) == 8 and col.blocks is not None and col.backend == "bm25"
    size = {b.text: b.n_tokens for b in col.blocks}
    for s in samples:
        assert s.task == "squad_r120_c24x2" and s.meta["n_chunks"] == len(s.chunks) >= 1
        assert sum(size[c] for c in s.chunks) <= 120 and all(c in size for c in s.chunks)
        g = s.meta["gold_position"]
        assert g is not None and s.answers[0] in s.chunks[g] and not any(s.answers[0] in c for c in s.chunks[:g])
    hall = [s for s in samples if s.meta["gold_position"] == 0]
    assert len(hall) >= 6  # BM25 ranks the paragraph naming the hall first for most questions
    # built once: a second process (cache cleared) loads the saved collection, same units
    squad_retrieval.squad_collection.cache_clear()
    again = squad_retrieval.load_squad_retrieved("squad", smollm_tokenizer, start=0, stop=8, **spec)
    assert [s.chunks for s in again] == [s.chunks for s in samples]
    with pytest.raises(InputError, match="outside"):
        squad_retrieval.load_squad_retrieved("squad", smollm_tokenizer, start=100, stop=101, **spec)


def test_an_eval_over_retrieval_records_its_protocol(small_squad, smollm_tokenizer, tmp_path):
    engine = make_tiny_engine("llama", smollm_tokenizer)
    retrieve = {"context_tokens": 100, "chunk_tokens": 24, "block_chunks": 1}
    cfg = EvalConfig(tasks=[], lengths=[], methods=["random"], ratios=[0.5], max_new_tokens=4, dataset="squad",
                     samples=(0, 2), overlap=False, retrieve=retrieve)
    rows = run_eval(engine, cfg, tmp_path / "out", progress=False)
    assert len(rows) == 2 * 3 and {r["task"] for r in rows} == {"squad_r100_c24"}
    assert all(r["n_tokens"] <= 100 + 4 * r["n_chunks"] for r in rows)  # the units' tokens, plus their separators
    assert cfg.protocol()["dataset"]["retrieve"] == {**retrieve, "ranker": "bm25"}
    assert "passages" not in cfg.protocol()["dataset"]


@pytest.mark.parametrize("args, says", [
    (["--dataset", "squad", "--block-chunks", "4"], "give --retrieve"),
    (["--dataset", "musique", "--retrieve", "2048"], "--dataset squad or squad2"),
    (["--dataset", "squad", "--retrieve", "256", "--chunk-tokens", "128", "--block-chunks", "4"], "holds no unit"),
    (["--dataset", "squad", "--retrieve", "2048", "--passages", "10"], "--passages"),
    (["--dataset", "squad", "--retrieve", "0"], "positive integer"),
])
def test_eval_refuses_retrieval_options_that_do_not_fit(args, says):
    res = CliRunner().invoke(app, ["eval", *args, "--out", "/nonexistent/never-written"])
    assert res.exit_code != 0 and says in res.output



@pytest.mark.parametrize("args, says", [
    (["--overlap", "8", "--block-chunks", "2"], "need overlap 0"),
    (["--block-chunks", "0"], "positive integer"),
])
def test_index_refuses_blocks_that_do_not_fit_before_loading_a_model(tmp_path, args, says):
    res = CliRunner().invoke(app, ["index", str(tmp_path), "--collection", "kb", *args])
    assert res.exit_code == 2 and says in res.output

def test_the_summary_says_how_often_retrieval_brought_the_answer(tmp_path):
    from kvstitch.eval.qa_report import squad_sections

    def row(i, method, gold, correct):
        return {"task": "squad_r2048_c256", "index": i, "method": method, "ratio": None if method == "full" else 0.1,
                "gold_position": gold, "depth": None if gold is None else 0.0, "answerable": True, "correct": correct,
                "pred": "x", "score": float(correct), "em": float(correct), "ttft_s": 1.0, "ttft_full_s": 2.0}

    rows = [row(0, "full", 0, True), row(1, "full", None, True), row(2, "full", None, False), row(3, "full", 2, False)]
    rows += [{**r, "method": "prophet", "ratio": 0.1} for r in rows]
    parts, _ = squad_sections(rows, tmp_path, "squad_r2048_c256")
    assert ("The answer is in the retrieved context for 2 of 4 answerable questions; full prefill is right on 1 of the "
            "2 others.") in parts
    parts, _ = squad_sections([r for r in rows if r["gold_position"] is not None], tmp_path, "x")
    assert not any("retrieved context" in p for p in parts)  # passages given, not retrieved: no such line
