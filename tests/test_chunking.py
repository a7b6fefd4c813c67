"""Token-bounded, boundary-aware document chunking."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstitch.text.chunking import chunk_directory, chunk_text
from kvstitch.core.errors import InputError


class WhitespaceTokenizer:
    """A tokenizer-like object: one token per whitespace-separated word (HF `encode`/`decode` signatures)."""

    def __init__(self) -> None:
        self.vocab: dict[str, int] = {}
        self.inv: list[str] = []

    def encode(self, text, add_special_tokens=False):
        assert add_special_tokens is False
        ids = []
        for w in text.split():
            if w not in self.vocab:
                self.vocab[w] = len(self.inv)
                self.inv.append(w)
            ids.append(self.vocab[w])
        return ids

    def decode(self, ids):
        return " ".join(self.inv[i] for i in ids)


tok = WhitespaceTokenizer()


def ntok(s: str) -> int:
    return len(tok.encode(s))


def sentence(i: int, n: int = 6) -> str:
    return " ".join(f"s{i}w{j}" for j in range(n - 1)) + f" end{i}."


def test_packs_whole_sentences_up_to_the_budget():
    text = " ".join(sentence(i) for i in range(10))  # 10 sentences x 6 tokens, one paragraph
    chunks = chunk_text(text, tok, chunk_tokens=20)
    assert [ntok(c) for c in chunks] == [18, 18, 18, 6]
    assert all(c.endswith(".") and c.startswith("s") for c in chunks)  # never cut inside a sentence
    assert " ".join(chunks) == text  # nothing lost, nothing repeated


def test_prefers_paragraph_boundaries():
    p1 = " ".join(sentence(i) for i in range(2))  # 12 tokens
    p2 = " ".join(sentence(i) for i in range(10, 13))  # 18 tokens
    chunks = chunk_text(p1 + "\n\n" + p2, tok, chunk_tokens=20)
    assert chunks == [p1, p2]  # not p1 + first sentence of p2
    both = chunk_text("short para.\n\nanother one.", tok, chunk_tokens=20)
    assert both == ["short para.\n\nanother one."]  # small paragraphs share a chunk


def test_long_sentence_is_split_by_tokens():
    long = " ".join(f"w{i}" for i in range(45))
    text = f"{sentence(1)} {long}. {sentence(2)}"
    chunks = chunk_text(text, tok, chunk_tokens=20)
    assert [ntok(c) for c in chunks] == [6, 20, 20, 5, 6]
    assert all(ntok(c) <= 20 for c in chunks)
    with_overlap = chunk_text(long, tok, chunk_tokens=20, overlap=5)
    assert [ntok(c) for c in with_overlap] == [20, 20, 15]
    assert with_overlap[1].split()[:5] == with_overlap[0].split()[-5:]


def test_overlap_repeats_whole_trailing_sentences():
    text = " ".join(sentence(i, 4) for i in range(6))  # 6 sentences x 4 tokens
    chunks = chunk_text(text, tok, chunk_tokens=12, overlap=4)
    assert all(ntok(c) <= 12 for c in chunks)
    for a, b in zip(chunks, chunks[1:]):
        last = a.rsplit(". ", 1)[-1]
        assert b.startswith(last)  # the last sentence of a chunk opens the next
    assert chunks[-1].endswith("end5.")


def test_no_empty_chunks_and_edge_cases():
    assert chunk_text("", tok) == [] and chunk_text(" \n\n \t\n", tok) == []
    assert chunk_text("one", tok, chunk_tokens=1) == ["one"]
    text = "Title\n\n\n\n- item one\n- item two\n\nQ? A! Fin.\n"
    chunks = chunk_text(text, tok, chunk_tokens=3)
    assert chunks == ["Title", "- item one", "- item two", "Q? A! Fin."]  # lines are units, not paragraphs
    for bad in (dict(chunk_tokens=0), dict(chunk_tokens=8, overlap=8), dict(overlap=-1)):
        with pytest.raises(InputError):
            chunk_text("x", tok, **bad)


def test_abbreviations_do_not_end_sentences():
    chunks = chunk_text("We use e.g. this. Dr. Who met J. Smith today. Done.", tok, chunk_tokens=6)
    assert chunks == ["We use e.g. this.", "Dr. Who met J. Smith today.", "Done."]


@settings(max_examples=60, deadline=None)
@given(words=st.lists(st.sampled_from(["a", "bb", "c.", "d!", "e?", "\n", "\n\n", "f", "g.", " "]), max_size=120),
       budget=st.integers(1, 12), overlap=st.integers(0, 11))
def test_properties(words, budget, overlap):
    overlap = min(overlap, budget - 1)
    text = " ".join(words)
    chunks = chunk_text(text, tok, chunk_tokens=budget, overlap=overlap)
    assert all(c.strip() for c in chunks)
    assert all(ntok(c) <= budget for c in chunks)
    covered = set(tok.encode(" ".join(chunks)))
    assert covered == set(tok.encode(text))  # every word lands in some chunk
    if overlap == 0:
        assert ntok(" ".join(chunks)) == ntok(text)


def test_chunk_directory(tmp_path):
    (tmp_path / "b.md").write_text("# B\n\nSecond doc. It has two sentences.")
    (tmp_path / "a.txt").write_text("First doc.")
    (tmp_path / "c.pdf").write_text("ignored")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "d.txt").write_text("not recursive")
    (tmp_path / "empty.txt").write_text("\n")
    out = chunk_directory(tmp_path, tok, chunk_tokens=4)
    assert out == [("a.txt", "First doc."), ("b.md", "# B\n\nSecond doc."), ("b.md", "It has two sentences.")]
    with pytest.raises(InputError, match="not found"):
        chunk_directory(tmp_path / "nope", tok)
