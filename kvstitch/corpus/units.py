"""A collection's units: its chunks (what is embedded and ranked) and, small-to-big, the blocks of consecutive
chunks that are precomputed and stitched in their place (`group_blocks`), and the rule that turns a ranking of
chunks into the units a question gets (`take_units`)."""

from __future__ import annotations

from dataclasses import dataclass

from kvstitch.core.errors import InputError

# a collection's default units: 128-token chunks embedded and ranked, blocks of 4 of them precomputed and stitched.
# At the same context (2K retrieved tokens, SQuAD v1.1 dev over MiniLM) this gave full prefill's answer more often
# and answered more questions right than 256-token chunks with every method measured (docs/results/README.md,
# "Many short passages"). Overlapping chunks cannot form blocks (a block would repeat the overlap).
INDEX_CHUNK_TOKENS = 128
INDEX_BLOCK_CHUNKS = 4


def default_block_chunks(block_chunks: int | None, overlap: int) -> int:
    """`block_chunks` as given, or the default: blocks of `INDEX_BLOCK_CHUNKS`, or none with overlapping chunks."""
    if block_chunks is None:
        return INDEX_BLOCK_CHUNKS if not overlap else 1
    if not isinstance(block_chunks, int) or isinstance(block_chunks, bool) or block_chunks < 1:
        raise InputError(f"block_chunks must be a positive integer, got {block_chunks!r}")
    if block_chunks > 1 and overlap:
        raise InputError(f"blocks of chunks (block_chunks={block_chunks}) need overlap 0: a block would repeat the "
                         f"overlap (block_chunks=1 for overlapping chunks)")
    return block_chunks


@dataclass
class Chunk:
    id: str  # "<doc name>#<n>"
    doc: str
    text: str
    n_tokens: int = 0
    key: str = ""  # chunk-store key under the indexing model (empty when not precomputed)
    block: int | None = None  # small-to-big: the index of the block (cache unit) holding this chunk


def group_blocks(chunks: list[Chunk], block_chunks: int) -> list[Chunk]:
    """Small-to-big cache units: every `block_chunks` consecutive chunks of one document joined into one block
    (id ``"<doc>#<first>-<last>"``); each chunk's ``block`` is set to its block's index."""
    if not isinstance(block_chunks, int) or isinstance(block_chunks, bool) or block_chunks < 1:
        raise InputError(f"block_chunks must be a positive integer, got {block_chunks!r}")
    blocks: list[Chunk] = []
    members: list[list[Chunk]] = []
    for c in chunks:
        if not members or members[-1][0].doc != c.doc or len(members[-1]) == block_chunks:
            members.append([])
        members[-1].append(c)
        c.block = len(members) - 1
    for m in members:
        first, last = m[0].id.rsplit("#", 1)[-1], m[-1].id.rsplit("#", 1)[-1]
        blocks.append(Chunk(id=f"{m[0].doc}#{first}" + (f"-{last}" if len(m) > 1 else ""), doc=m[0].doc,
                            text="\n\n".join(c.text for c in m)))
    return blocks


def take_units(order, chunks: list[Chunk], blocks: list[Chunk] | None, k: int | None = None,
               max_tokens: int | None = None) -> list[tuple[int, int]]:
    """Chunks ranked best first (`order`, chunk indices) -> the units a question gets: (unit index, its best
    chunk), each unit once in the order of its best chunk (a chunk's unit: its block, or itself without
    blocks), until `k` are taken or the next would take the units' tokens past `max_tokens`."""
    units = chunks if blocks is None else blocks
    taken: list[tuple[int, int]] = []
    seen: set[int] = set()
    used = 0
    for i in order:
        unit = i if blocks is None else chunks[i].block
        if unit in seen:
            continue
        if max_tokens is not None:
            if used + units[unit].n_tokens > max_tokens:
                break
            used += units[unit].n_tokens
        seen.add(unit)
        taken.append((unit, i))
        if k is not None and len(taken) == k:
            break
    return taken
