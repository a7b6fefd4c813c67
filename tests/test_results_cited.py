"""Every folder and file at the top of docs/results is cited: linked or named by path from README.md, docs/*.md or
a docs/results markdown file outside it. An uncited result has no command or context beside it to trust it by."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"


def _docs() -> dict[Path, str]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted(RESULTS.rglob("*.md"))]
    return {p: p.read_text(encoding="utf-8") for p in files if p.is_file()}


def citations(entry: Path, docs: dict[Path, str]) -> list[Path]:
    """The markdown files naming `entry` by path: ``results/NAME`` or ``../NAME`` anywhere; in docs/results' own
    top-level files also a bare ``NAME`` as a link target or code span. A file inside `entry` does not count."""
    name = re.escape(entry.name)
    end = r"(?=[/)`\s#:,;.]|$)"
    by_path = re.compile(rf"(?:results/|\.\./){name}{end}", re.M)
    relative = re.compile(rf"(?:results/|\.\./|(?<=[(\[`])){name}{end}", re.M)
    return [p for p, text in docs.items()
            if p != entry and entry not in p.parents
            and (relative if p.parent == RESULTS else by_path).search(text)]


def test_the_matcher_wants_a_path_not_a_word():
    entry = RESULTS / "viz"
    docs = {RESULTS / "README.md": "run `kvstitch viz` for a picture", ROOT / "docs" / "usage.md": "the viz command"}
    assert citations(entry, docs) == []
    docs[RESULTS / "README.md"] += "; an example: [page](viz/sel.html)"
    assert citations(entry, docs) == [RESULTS / "README.md"]
    assert citations(entry, {RESULTS / "viz" / "README.md": "see ../viz/"}) == []  # not by itself
    assert citations(entry, {ROOT / "README.md": "docs/results/viz/sel.html"}) == [ROOT / "README.md"]


@pytest.mark.skipif(not RESULTS.is_dir(), reason="no docs/results in this tree")
def test_every_top_level_result_is_cited():
    docs = _docs()
    uncited = [p.name for p in sorted(RESULTS.iterdir()) if not p.name.startswith(".") and not citations(p, docs)]
    assert not uncited, f"cited nowhere (README.md, docs/*.md, docs/results/**/*.md): {', '.join(uncited)}"
