"""Where a stitched answer comes from when full prefill answers right and it does not: the gold passage (a misread
span), another passage (a distractor read as the answer), or none (its opening words are in no passage).

    python scripts/answer_sources.py RUN [RUN ...] [--out FILE.md]

Only the questions every RUN holds are counted, so runs over different sample sets compare on the same questions.

RUN: a SQuAD eval run directory (results.jsonl[.gz]); its rows name the task (``squad_p40``), the seed and the
sample index, from which the passages are rebuilt (`kvstitch.tasks.squad.load_squad`). A table per run: for each
method and ratio, of the questions its run's full prefill answers right, how many it keeps and where the rest come
from. An answer's source is the passage holding the longest run of its opening words (at least `MIN_WORDS`).
"""

from __future__ import annotations

import argparse
import re
from collections import Counter, defaultdict
from pathlib import Path

MIN_WORDS = 2  # fewer opening words found verbatim: the answer is from no passage
MAX_WORDS = 12


def words(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


def answer_source(pred: str, passages: list[str], gold: int) -> str:
    """"gold", "other" or "none" (see the module doc)."""
    w = words(pred)
    best, where = 0, None
    for i, passage in enumerate(passages):
        text = " " + " ".join(words(passage)) + " "
        n = 0
        while n < min(len(w), MAX_WORDS) and " " + " ".join(w[:n + 1]) + " " in text:
            n += 1
        if n > best:
            best, where = n, i
    if best < MIN_WORDS:
        return "none"
    return "gold" if where == gold else "other"


def tally(rows: list[dict], passages_of) -> dict[tuple[str, float | None], Counter]:
    """``(method, ratio) -> Counter`` of kept / gold / other / none over the questions full prefill answers right;
    ``passages_of(row) -> (passages, gold position)``."""
    by = defaultdict(dict)
    for r in rows:
        by[r["index"]][(r["method"], r["ratio"])] = r
    out: dict = defaultdict(Counter)
    for settings in by.values():
        full = settings.get(("full", None))
        if not full or not full["correct"]:
            continue
        for key, r in settings.items():
            if key[0] == "full":
                continue
            out[key]["kept" if r["correct"] else answer_source(r["pred"], *passages_of(r))] += 1
    return dict(out)


def table(counts: dict) -> str:
    lines = ["| method | ratio | right by full | kept | from the gold passage | from another passage | from none |",
             "|---|---|---|---|---|---|---|"]
    for (method, ratio), c in sorted(counts.items(), key=lambda kv: (kv[0][0], kv[0][1] or 0.0)):
        n = sum(c.values())
        lines.append(f"| {method} | {'–' if ratio is None else f'{ratio:g}'} | {n} | {c['kept']} | {c['gold']} | "
                     f"{c['other']} | {c['none']} |")
    return "\n".join(lines)


def _squad_passages():
    from kvstitch.tasks.squad import load_squad

    cache: dict = {}

    def passages_of(row: dict):
        version, passages = row["task"].split("_p")
        key = (version, int(passages.split("_")[0]), row["seed"], row["index"])
        if key not in cache:
            s = load_squad(key[0], key[1], key[2], key[3], key[3] + 1)[0]
            cache[key] = (s.chunks, s.meta["gold_position"])
        return cache[key]

    return passages_of


def main(argv=None) -> None:
    from kvstitch.eval.rows import read_jsonl

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    passages_of = _squad_passages()
    runs = {run: [r for r in read_jsonl(run / "results.jsonl") if r["task"].startswith("squad")] for run in args.runs}
    shared = set.intersection(*({r["index"] for r in rows} for rows in runs.values()))
    parts = []
    for run, rows in runs.items():
        parts.append(f"## {run}\n\n{table(tally([r for r in rows if r['index'] in shared], passages_of))}\n")
    text = "\n".join(parts)
    print(text)
    if args.out:
        args.out.write_text(f"Written by `python scripts/answer_sources.py {' '.join(map(str, args.runs))} --out "
                            f"{args.out}`.\n\n{text}", encoding="utf-8")


if __name__ == "__main__":
    main()
