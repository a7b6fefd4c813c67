"""scripts/squad_retrieval.py: answer recall of MiniLM retrieval over SQuAD articles at several chunk sizes."""

from __future__ import annotations

import json

import pytest

from tests.scripts_loader import load_script


def _load():
    return load_script("squad_retrieval")


def test_an_answer_counts_as_whole_normalised_words():
    answer_in = _load().answer_in
    assert answer_in("It was built in 1889, for the fair.", ["1889"])
    assert answer_in("THE Eiffel tower", ["eiffel Tower"])  # case, articles
    assert not answer_in("It was built in 18890.", ["1889"])  # not inside a longer word
    assert not answer_in("anything", ["", "the"])  # an answer that normalises to nothing never matches


@pytest.mark.long  # ~25 s on 2 cores: run by .ci/run after the quick set
def test_recall_per_chunk_size_and_budget(tmp_path):
    """Two articles as the collection: recall in [0, 1], never lower with a larger budget (the retrieved chunks at a
    larger budget include those at a smaller one), and a budget holding the whole collection finds almost every
    answer (SQuAD's answers are spans of its paragraphs; the few that are fragments of a word are not whole words).
    `--blocks 2` (small-to-big): the same ranking of the same chunks, but each retrieved chunk brings its block of 2
    (about half as many units, each about twice as long); over the whole collection blocks find every answer plain
    chunks find, and a few more: their chunks are joined in document order, so an answer cut by a boundary is whole."""
    out = tmp_path / "r"
    assert _load().main(["--samples", "0:10570", "--chunk-tokens", "64,256", "--budgets", "128,512,100000",
                         "--blocks", "2", "--model", "smollm2", "--max-articles", "2", "--out", str(out)]) == 0
    rows = {(r["chunk_tokens"], r["block_chunks"], r["budget"]): r
            for r in json.loads((out / "retrieval.json").read_text())["rows"]}
    assert list(rows) == [(size, k, budget) for size in (64, 256) for k in (1, 2) for budget in (128, 512, 100000)]
    for size in (64, 256):
        for k in (1, 2):
            recall = [rows[(size, k, budget)]["answer_recall"] for budget in (128, 512, 100000)]
            assert 0.0 <= recall[0] <= recall[1] <= recall[2] and recall[2] >= 0.98
        assert rows[(size, 1, 100000)]["answer_recall"] <= rows[(size, 2, 100000)]["answer_recall"]
    plain, blocks = rows[(64, 1, 128)], rows[(64, 2, 128)]
    assert plain["chunks"] > rows[(256, 1, 128)]["chunks"] and plain["n"] > 100  # smaller chunks: more of them
    assert plain["chunks"] / 2 <= blocks["chunks"] <= plain["chunks"] / 2 + 2  # an article's last block may hold one
    assert 1.5 < blocks["mean_chunk_tokens"] / plain["mean_chunk_tokens"] <= 2.0
    text = (out / "retrieval.md").read_text()
    assert "| 256 | the chunk |" in text and "| 64 | its block of 2 chunks |" in text


def test_a_block_enters_once_in_the_order_of_its_best_chunk():
    from kvstitch.corpus.retrieval import Chunk, group_blocks

    retrieve = _load()._retrieve
    chunks = [Chunk(f"{d}#{j}", d, f"{d}{j}", n_tokens=10) for d, j in (("a", 0), ("a", 1), ("a", 2), ("b", 0))]
    blocks = group_blocks(chunks, 2)  # a0+a1, a2, b0
    blocks[0].n_tokens, blocks[1].n_tokens, blocks[2].n_tokens = 20, 10, 10
    # chunk 1 ranks first: its block (chunks 0 and 1) comes first, in document order; chunk 0 adds nothing again
    assert retrieve([1, 3, 0, 2], chunks, blocks, 40) == "a0\n\na1\n\nb0\n\na2"
    assert retrieve([1, 3, 0, 2], chunks, blocks, 39) == "a0\n\na1\n\nb0"  # the next block does not fit
    assert retrieve([1, 3, 0, 2], chunks, None, 20) == "a1\n\nb0"  # no blocks: the chunks themselves
