"""`kvstitch bench precompute`: precompute throughput single-process vs N Ray workers (Ray's overhead).

Each configuration precomputes the same synthetic folder into a fresh directory store; tokens/s is over
the compute phase (model loaded, keys known), and the wall time including model/actor start is shown
beside it. Run it on an idle machine; on 2 cores, 2 workers of 1 thread each is the ceiling.
"""

from __future__ import annotations

import random
import shutil
import tempfile
import time
from pathlib import Path

import torch


def synthetic_docs(folder: Path, n_docs: int, words_per_doc: int, seed: int = 0) -> Path:
    from kvstitch.tasks.haystack import essay_sentences

    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n_docs):
        sents, n = [], 0
        for s in essay_sentences(rng):
            sents.append(s)
            n += len(s.split())
            if n >= words_per_doc:
                break
        (folder / f"doc{i:04d}.txt").write_text(" ".join(sents))
    return folder


def bench_precompute(model: str | None, workers: list[int], n_docs: int = 16, words_per_doc: int = 1500,
                     chunk_tokens: int = 256, batch_size: int = 8, threads: int = 1, address: str | None = None,
                     seed: int = 0) -> list[dict]:
    from kvstitch.engine import Engine
    from kvstitch.engine.precompute import precompute_directory

    rows = []
    tmp = Path(tempfile.mkdtemp(prefix="kvstitch-bench-precompute-"))
    try:
        docs = synthetic_docs(tmp / "docs", n_docs, words_per_doc, seed)
        for w in workers:
            store = tmp / f"store-{w}"
            t0 = time.perf_counter()
            if w == 0:
                prev = torch.get_num_threads()
                torch.set_num_threads(threads)
                try:
                    eng = Engine.load(model, store=str(store), stitch_adapter=None)
                    rep, _ = precompute_directory(eng, docs, chunk_tokens, batch_size=batch_size, progress=False)
                finally:
                    torch.set_num_threads(prev)
                del eng
                chunks, computed, tokens, secs = rep.chunks, rep.computed, rep.tokens, rep.seconds
                name = "single process"
            else:
                from kvstitch.corpus.ray_precompute import RayPrecompute

                job = RayPrecompute(docs, str(store), model=model, workers=w, address=address,
                                    chunk_tokens=chunk_tokens, batch_size=batch_size, threads_per_worker=threads)
                try:
                    rep = job.run(progress=False)
                finally:
                    job.shutdown()
                chunks, computed, tokens, secs = rep.chunks, rep.computed, rep.tokens, rep.seconds
                name = f"Ray, {w} worker{'s' if w > 1 else ''}"
            rows.append({"config": name, "workers": w, "chunks": chunks, "computed": computed, "tokens": tokens,
                         "compute_s": round(secs, 3), "tokens_per_s": round(tokens / secs, 1) if secs else 0.0,
                         "wall_s": round(time.perf_counter() - t0, 3)})
            shutil.rmtree(store, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    base = next((r["tokens_per_s"] for r in rows if r["workers"] == 0), None)
    for r in rows:
        r["vs_single"] = round(r["tokens_per_s"] / base, 3) if base else None
    return rows


def precompute_table(rows: list[dict]) -> str:
    lines = ["| config | chunks | tokens | compute s | tokens/s | vs single process | wall s (with model load) |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        vs = f"{r['vs_single']:.2f}x" if r.get("vs_single") is not None else "–"
        lines.append(f"| {r['config']} | {r['chunks']} | {r['tokens']} | {r['compute_s']:.2f} | "
                     f"{r['tokens_per_s']:,.0f} | {vs} | {r['wall_s']:.1f} |")
    return "\n".join(lines)
