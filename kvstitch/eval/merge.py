"""Join eval runs made side by side (``kvstitch eval --shard k/n`` in several processes or machines, one task
per process, a run continued elsewhere) into one run directory: ``kvstitch eval-merge RUN... --out DIR``.

A row is one (sample, method, ratio); a row found in several runs (the shards were seeded with the same done
rows) is kept once, and two runs that disagree on a row's answer are refused rather than silently picked from.
Runs of another protocol or another model are refused too: their rows would not be comparable."""

from __future__ import annotations

import gzip
import json
import os
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

from kvstitch.core.errors import InputError
from .rows import GZ, has_jsonl, json_default, norm_ratio, sample_key, read_jsonl
from .runner import RESULTS, combos, row_key

NLL_TOL = 1e-4  # the same row computed twice (another machine, another thread count) may differ this much


def _read_run(run: Path) -> tuple[list[dict], dict]:
    path = run / RESULTS if run.is_dir() else run
    if not has_jsonl(path):
        raise InputError(f"no {RESULTS} in {run}")
    meta_path = path.parent / "run.json"
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    return read_jsonl(path), meta


def _same_row(a: dict, b: dict) -> bool:
    """The same answer: text, tokens and (within `NLL_TOL`) answer NLL; times may differ."""
    if a.get("pred") != b.get("pred") or a.get("answer_ids") != b.get("answer_ids"):
        return False
    na, nb = a.get("nll"), b.get("nll")
    return (na is None) == (nb is None) and (na is None or abs(float(na) - float(nb)) <= NLL_TOL)


def unfinished_samples(rows: Sequence[dict], meta: dict) -> int:
    """Samples holding some but not all of the rows the run's config asks for: a run still writing, or stopped
    inside a sample. Merging one is allowed (the joined run resumes them), but the joined table lacks those rows."""
    cfg = meta.get("config") or {}
    if not cfg.get("methods"):
        return 0
    want = set(combos(cfg["methods"], cfg.get("ratios") or [], cfg.get("auto_methods") or []))
    got: dict[tuple, set] = defaultdict(set)
    for r in rows:
        got[sample_key(r)].add((r.get("method"), norm_ratio(str(r.get("method")), r.get("ratio"))))
    return sum(1 for have in got.values() if not want <= have)


def _one(values: set, what: str, runs: Sequence[Path]) -> None:
    if len(values) > 1:
        raise InputError(f"the runs {', '.join(map(str, runs))} differ in their {what}; their rows are not "
                         f"comparable and are not merged")


def merge_runs(runs: Sequence[Path]) -> tuple[list[dict], dict, int, dict[str, int]]:
    """The union of the runs' rows (first seen first) and one run.json for it -> (rows, meta, duplicates,
    {run: its unfinished samples} for the runs that have any)."""
    if not runs:
        raise InputError("name at least one run to merge")
    read = [_read_run(Path(r)) for r in runs]
    metas = [m for _, m in read if m]
    _one({json.dumps(m.get("protocol"), sort_keys=True) for m in metas if m.get("protocol") is not None},
         "protocol (run.json)", runs)
    _one({m.get("model", {}).get("fingerprint") for m in metas} - {None}, "model (run.json fingerprint)", runs)
    kept: dict[tuple, dict] = {}
    duplicates = 0
    for (rows, _), run in zip(read, runs):
        for r in rows:
            key = row_key(r)
            if key in kept:
                if not _same_row(kept[key], r):
                    raise InputError(f"{run} has another answer for the row {key} than another of the runs: "
                                     f"{kept[key].get('pred')!r} vs {r.get('pred')!r}; nothing was merged")
                duplicates += 1
                continue
            kept[key] = r
    merged = list(kept.values())
    meta = dict(metas[0]) if metas else {}
    config = dict(meta.get("config", {}))
    config["tasks"] = list(dict.fromkeys(r["task"] for r in merged if "task" in r))
    config["lengths"] = sorted({int(r["length"]) for r in merged if "length" in r})
    meta.update(config=config, commands=list(dict.fromkeys(c for m in metas for c in m.get("commands", []))),
                merged_from=[str(r) for r in runs], rows=len(merged), updated=time.strftime("%Y-%m-%d %H:%M:%S"))
    meta.pop("rows_before", None)
    unfinished = {str(run): n for (rows, m), run in zip(read, runs) if (n := unfinished_samples(rows, m))}
    return merged, meta, duplicates, unfinished


def write_run(rows: Sequence[dict], meta: dict, out: Path) -> Path:
    """results.jsonl and run.json into `out`, each written whole to a temporary file and renamed, so a
    failure leaves the old files (and `out` may be one of the merged runs). Where `out` holds a compressed
    results.jsonl.gz, the rows replace it, compressed, and a plain results.jsonl beside it is removed."""
    out.mkdir(parents=True, exist_ok=True)
    results = "".join(json.dumps(r, default=json_default, ensure_ascii=False) + "\n" for r in rows).encode()
    gz = (out / (RESULTS + GZ)).exists()
    if gz:  # mtime 0: the same rows give the same bytes
        results = gzip.compress(results, compresslevel=9, mtime=0)
    for name, data in ((RESULTS + GZ if gz else RESULTS, results),
                       ("run.json", (json.dumps(meta, indent=2, default=str) + "\n").encode())):
        tmp = out / f".{name}.tmp"
        tmp.write_bytes(data)
        os.replace(tmp, out / name)
    if gz:
        (out / RESULTS).unlink(missing_ok=True)
    return out / RESULTS
