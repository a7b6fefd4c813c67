"""Eval rows: their keys, the statistics and formatting the tables share, the JSON-lines log a resumable run
appends to, and matplotlib plumbing (a Figure on an Agg canvas: no pyplot global state, safe in workers)."""

from __future__ import annotations

import gzip
import json
import math
import os
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from kvstitch.core.extras import require

REFERENCE_METHODS = ("full", "naive")
REFERENCES = REFERENCE_METHODS  # always run, once per sample (they have no ratio)
ROW_KEY = ("task", "seed", "index", "length", "chunk_tokens", "method", "ratio")
_METHOD_ORDER = ("full", "naive", "random", "epic", "cacheblend", "kvshare", "a3", "prophet", "infoflow",
                 "cacheclip", "oracle", "oracle_ideal")
BOOTSTRAP_RESAMPLES = 2000
CI_LEVEL = 0.95
_SAMPLE_FIELDS = ("seed", "index", "length", "chunk_tokens", "depth")  # what names one sample within a task


def as_number(v: Any) -> float | None:
    try:
        x = float(v)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(x) else x


def mean_of(values: Iterable[Any]) -> float:
    xs = [x for x in map(as_number, values) if x is not None]
    return sum(xs) / len(xs) if xs else math.nan


def median_of(values: Iterable[Any]) -> float:
    """Times are summarised by their median: one row slowed by a paused or contended process (a long eval
    shares the machine) must not move a cell, as it does a mean."""
    xs = sorted(x for x in map(as_number, values) if x is not None)
    if not xs:
        return math.nan
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2


def method_key(method: str) -> tuple[int, str]:
    return (_METHOD_ORDER.index(method) if method in _METHOD_ORDER else len(_METHOD_ORDER), method)


def ratio_key(ratio: Any) -> float:
    if ratio == "auto":
        return 2.0  # after every fixed ratio
    x = as_number(ratio)
    return -1.0 if x is None else x


def ratio_cell(ratio: Any) -> str:
    return "auto" if ratio == "auto" else fmt_num(as_number(ratio), 2)


def fmt_num(x: float, digits: int = 1) -> str:
    return "–" if x is None or math.isnan(x) else f"{x:.{digits}f}"


def _finite(values: Iterable[Any]):
    import numpy as np

    return np.asarray([x for x in map(as_number, values) if x is not None and math.isfinite(x)], dtype=np.float64)


def _percentiles(stat, level: float) -> tuple[float, float]:
    import numpy as np

    stat = stat[np.isfinite(stat)]
    if stat.size == 0:
        return math.nan, math.nan
    tail = 50.0 * (1.0 - level)
    lo, hi = np.percentile(stat, [tail, 100.0 - tail])
    return float(lo), float(hi)


def bootstrap_mean_ci(strata: Sequence[Iterable[Any]], n_resamples: int = BOOTSTRAP_RESAMPLES,
                      level: float = CI_LEVEL, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of per-stratum means (one stratum: of the plain mean;
    several: e.g. RULER's average over tasks, each task resampled on its own). None / NaN values are
    skipped. (nan, nan) when no stratum has 2 values (no spread to resample)."""
    import numpy as np

    arrays = [a for a in (_finite(s) for s in strata) if a.size]
    if not arrays or max(a.size for a in arrays) < 2:
        return math.nan, math.nan
    rng = np.random.default_rng(seed)
    stat = np.zeros(n_resamples)
    for a in arrays:
        stat += a[rng.integers(0, a.size, (n_resamples, a.size))].mean(axis=1)
    return _percentiles(stat / len(arrays), level)


def bootstrap_ratio_ci(strata: Sequence[tuple[Sequence[float], Sequence[float]]],
                       n_resamples: int = BOOTSTRAP_RESAMPLES, level: float = CI_LEVEL,
                       seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of sum_s mean(num_s) / sum_s mean(den_s), the (num, den) pairs of a
    stratum resampled together (paired: e.g. a method's score and full prefill's on the same sample, or
    the naive-minus-method and naive-minus-full NLL of pooled gap recovery)."""
    import numpy as np

    pairs = []
    for num, den in strata:
        num, den = np.asarray(num, dtype=np.float64), np.asarray(den, dtype=np.float64)
        ok = np.isfinite(num) & np.isfinite(den)
        if ok.any():
            pairs.append((num[ok], den[ok]))
    if not pairs or max(n.size for n, _ in pairs) < 2:
        return math.nan, math.nan
    rng = np.random.default_rng(seed)
    top, bottom = np.zeros(n_resamples), np.zeros(n_resamples)
    for num, den in pairs:
        idx = rng.integers(0, num.size, (n_resamples, num.size))
        top += num[idx].mean(axis=1)
        bottom += den[idx].mean(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        stat = np.where(np.abs(bottom) > 1e-12, top / bottom, np.nan)
    return _percentiles(stat, level)


def fmt_ci(x: float, ci: tuple[float, float], digits: int = 1, scale: float = 1.0) -> str:
    """``x [lo, hi]`` (the 95% bootstrap interval) or just ``x`` when there is no interval."""
    if x is None or math.isnan(x):
        return "–"
    lo, hi = ci
    if math.isnan(lo) or math.isnan(hi):
        return f"{scale * x:.{digits}f}"
    return f"{scale * x:.{digits}f} [{scale * lo:.{digits}f}, {scale * hi:.{digits}f}]"


def mean_ci_cell(values: Sequence[Any], digits: int = 2) -> str:
    """A table cell: the mean of `values` with its 95% bootstrap interval."""
    return fmt_ci(mean_of(values), bootstrap_mean_ci([values]), digits)


def sample_id(r: dict) -> tuple:
    return tuple(r.get(k) for k in ("task", *_SAMPLE_FIELDS))


def group_rows(rows: Iterable[dict], *keys: str) -> dict[tuple, list[dict]]:
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        groups[tuple(r.get(k) for k in keys)].append(r)
    return groups


def json_default(o: Any) -> Any:
    if hasattr(o, "item"):  # numpy / torch scalars
        return o.item()
    if hasattr(o, "tolist"):
        return o.tolist()
    if isinstance(o, (set, tuple)):
        return list(o)
    if isinstance(o, os.PathLike):
        return os.fspath(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def _drop_partial_tail(path: Path) -> None:
    """Cut a last line that a killed run left without its newline, so the next row starts cleanly."""
    with open(path, "rb+") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        if size == 0:
            return
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return
        pos = size
        while pos > 0:
            step = min(4096, pos)
            f.seek(pos - step)
            block = f.read(step)
            nl = block.rfind(b"\n")
            if nl >= 0:
                f.truncate(pos - step + nl + 1)
                return
            pos -= step
        f.truncate(0)


def append_jsonl(path: str | os.PathLike, row: dict) -> None:
    """Append one row as a JSON line (flushed), first dropping a truncated last line if one is there."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    line = json.dumps(row, default=json_default, ensure_ascii=False) + "\n"
    if path.exists():
        _drop_partial_tail(path)
    with open(path, "a", encoding="utf-8") as f:
        f.write(line)
        f.flush()


GZ = ".gz"


def jsonl_files(path: str | os.PathLike) -> list[Path]:
    """The files holding the log `path`: itself if it names a .gz; else its compressed copy (``path.gz``: a
    published log) then `path` (rows a resumed run appended since), those that exist."""
    path = Path(path)
    if path.suffix == GZ:
        return [path] if path.exists() else []
    return [p for p in (path.with_name(path.name + GZ), path) if p.exists()]


def has_jsonl(path: str | os.PathLike) -> bool:
    """Whether the log `path` exists, plain or compressed."""
    return bool(jsonl_files(path))


def _jsonl_lines(path: Path) -> list[str]:
    if path.suffix == GZ:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            return f.read().splitlines()
    return path.read_text(encoding="utf-8").splitlines()


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """All rows of a JSON-lines log ([] if it does not exist): ``path.gz`` then `path` when both exist, a line
    in both read once (a copy left beside its compressed file). An unparsable *last* line of a file is a write
    the run did not finish and is skipped; an unparsable line elsewhere is corruption and raises."""
    rows: list[dict] = []
    before: set[str] = set()  # lines of the files already read
    for file in jsonl_files(path):
        lines = [line.strip() for line in _jsonl_lines(file)]
        while lines and not lines[-1]:
            lines.pop()
        for i, line in enumerate(lines):
            if not line or line in before:
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as err:
                if i == len(lines) - 1:
                    break
                raise ValueError(f"{file}:{i + 1}: corrupt JSON line ({err.msg})") from err
        before.update(lines)
    return rows


def norm_ratio(method: str, ratio: float | str | None) -> float | str | None:
    if method in REFERENCES or ratio is None:
        return None
    return "auto" if ratio == "auto" else round(float(ratio), 6)


def sample_key(r: dict) -> tuple:
    return tuple(r.get(k) for k in ROW_KEY[:5])


def colour_cycle() -> list:
    """20 distinguishable colours (tab10 then the light half of tab20): a dozen methods never share one."""
    colormaps = require("matplotlib", "plots", "plotting").colormaps
    t20 = colormaps["tab20"].colors
    return [t20[2 * i] for i in range(10)] + [t20[2 * i + 1] for i in range(10)]


def ratio_of_means(num: Iterable[Any], den: Iterable[Any]) -> float:
    n, d = mean_of(num), mean_of(den)
    return n / d if d and not math.isnan(n) and not math.isnan(d) else math.nan


def sample_speedups(rows: Iterable[dict]) -> list[float]:
    """Per row: its sample's full-prefill TTFT / the row's TTFT (rows lacking either time are left out)."""
    out = []
    for x in rows:
        full, own = as_number(x.get("ttft_full_s")), as_number(x.get("ttft_s"))
        if full is not None and own:
            out.append(full / own)
    return out


def ttft_speedup(rows: Iterable[dict]) -> float:
    """TTFT speed-up over full prefill: the median over samples of full prefill's TTFT / the method's on the same
    sample. Paired and a median, so one sample slowed by a paused process does not move it (as it does a ratio of
    means, which that sample's time dominates)."""
    return median_of(sample_speedups(rows))


def naive_nll_by_sample(rows: Sequence[dict]) -> dict[tuple, float]:
    return {sample_key(r): float(r["nll"]) for r in rows if r.get("method") == "naive" and r.get("nll") is not None}


def pooled_recovery(rows: Sequence[dict], naive_nll: dict[tuple, float]) -> float:
    """NLL-gap recovery pooled over samples: sum(NLL_naive - NLL_m) / sum(NLL_naive - NLL_full), each sample's
    naive NLL from its `naive` row. Robust where the per-sample ratio explodes (a tiny naive-full gap)."""
    num = den = 0.0
    for r in rows:
        nv = naive_nll.get(sample_key(r))
        if nv is None or r.get("nll") is None or r.get("nll_full") is None:
            continue
        num += nv - float(r["nll"])
        den += nv - float(r["nll_full"])
    return num / den if abs(den) > 1e-9 else math.nan


def pooled_recovery_ci(rows: Sequence[dict], naive_nll: dict[tuple, float]) -> tuple[float, float]:
    """95% bootstrap interval of `pooled_recovery` (samples resampled with their naive and full NLLs)."""
    num, den = [], []
    for r in rows:
        nv = naive_nll.get(sample_key(r))
        if nv is None or r.get("nll") is None or r.get("nll_full") is None:
            continue
        num.append(nv - float(r["nll"]))
        den.append(nv - float(r["nll_full"]))
    return bootstrap_ratio_ci([(num, den)])
