"""The evaluation harness: RULER-style tasks x selection methods x recompute ratios, resumable.

A run visits its samples in order (`run_samples`), each with all its (method, ratio) rows (`eval/sample.py`
says how one sample is run and what its rows measure), appends every row to the log as it completes and
skips, on a rerun, the rows already there. Its configuration and protocol are in `eval/config.py`.

Output directory: ``results.jsonl`` (one row per (sample, method, ratio); a rerun skips rows already there, also
those of a ``results.jsonl.gz``: a published run is kept compressed and still resumes),
``summary.md`` (tables per length), ``accuracy_vs_ratio_<L>.png`` (ProphetKV Fig. 8 style),
``fidelity_vs_ratio_<L>.png`` (KL and NLL-gap recovery vs ratio), ``niah_heatmap.png`` (depth x length),
``run.json`` (protocol, model, the commands that wrote the log).

Reports (tables, plots) are in `eval/report.py` and `eval/plots.py`; the ``kvstitch eval`` command
(`eval_command`) in `cli/eval.py`.
"""

from __future__ import annotations

import json
import os
import time
import traceback
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import torch

from kvstitch.core.errors import EvalError, InputError
from kvstitch.core.memory import resident_bytes
from kvstitch.engine.budget import AUTO
from kvstitch.tasks.haystack import resolve_haystack
from kvstitch.tasks.tasks import TASKS, Sample, generate
from .config import EvalConfig, combos, row_key
from .config import DEFAULT_TASKS, PROTOCOL_VERSION, ordered_methods  # noqa: F401  (API)
from .report import write_reports
from .rows import REFERENCES, append_jsonl, has_jsonl, norm_ratio, read_jsonl, sample_key
from .sample import eval_sample  # the run calls it through this module (tests replace it here)
from .sample import MethodRun, answer_budget, run_method, sample_layout  # noqa: F401  (API)
from .timing import SampleFullPrefill  # noqa: F401  (API)
from .selection import to_original_order  # noqa: F401  (part of this module's API)

RESULTS = "results.jsonl"


# ---------------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------------

def spread_order(n: int) -> list[int]:
    """0..n-1 ordered so that every prefix is spread evenly (samples' depths go 0 -> 1 with the index):
    0, n-1, then repeatedly the index farthest from those taken (ties: the smallest)."""
    if n <= 2:
        return list(range(n))
    order = [0, n - 1]
    left = set(range(1, n - 1))
    while left:
        best = max(sorted(left), key=lambda i: min(abs(i - j) for j in order))
        order.append(best)
        left.remove(best)
    return order


def _token_counter(tok):
    def count(text: str) -> int:
        return len(tok.encode(text, add_special_tokens=False))

    return count


def warm_up(engine, methods: Sequence[str] = REFERENCES) -> None:
    """The first forward after loading is ~10x slower, and some methods load things lazily (CacheClip's
    auxiliary model): run every method once on a tiny prompt before timing anything."""
    chunks = ["The number is 7. The sky is blue.", "Bob lives in Rome."]
    for m in dict.fromkeys([*REFERENCES, *methods]):
        engine.generate("What is the number?", chunks, method=m, recompute_ratio=0.5, max_new_tokens=2)


def check_shard(shard: tuple[int, int] | None) -> tuple[int, int]:
    """(k, n) with 0 <= k < n, or InputError; None = the whole run (0, 1)."""
    if shard is None:
        return 0, 1
    k, n = shard
    if not (isinstance(k, int) and isinstance(n, int) and n >= 1 and 0 <= k < n):
        raise InputError(f"a shard is k/n with 0 <= k < n (e.g. 0/2 and 1/2), got {k}/{n}")
    return k, n


def parse_shard(text: str | None) -> tuple[int, int] | None:
    """'k/n' (e.g. '1/2') -> (k, n); '' or None -> None (the whole run)."""
    if not text:
        return None
    try:
        k, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise InputError(f"--shard takes k/n, e.g. 0/2 and 1/2 for two processes, got {text!r}") from None
    return check_shard((k, n))


def _check_protocol(out: Path, cfg: EvalConfig, model_desc: dict) -> None:
    meta_path = out / "run.json"
    if not meta_path.exists() or not has_jsonl(out / RESULTS):
        return
    old = json.loads(meta_path.read_text())
    was, now = old.get("protocol"), cfg.protocol()
    if was is not None and ("auto" in was) != ("auto" in now):
        # a run gains (or a resume leaves out) the "auto" ratio: only auto rows depend on its options, and on one
        # side there are none, so the other rows stay comparable
        was, now = {k: v for k, v in was.items() if k != "auto"}, {k: v for k, v in now.items() if k != "auto"}
    if was not in (None, now):
        raise InputError(f"{out} holds a run with protocol {old.get('protocol')}, this one is {cfg.protocol()}: "
                         f"use another --out directory (rows would not be comparable)")
    was_specs, now_specs = old.get("method_specs") or {}, method_specs(cfg)
    changed = [m for m in now_specs if m in was_specs and was_specs[m] != now_specs[m]]
    if changed:
        m = changed[0]
        raise InputError(f"{out}: method {m!r} was run as {was_specs[m]} and now means {now_specs[m]} (a default "
                         f"changed): name it as it ran to resume, or use another --out (its rows would mix both)")
    if old.get("model", {}).get("fingerprint") not in (None, model_desc.get("fingerprint")):
        raise InputError(f"{out} holds a run of another model or model dtype (this one: {model_desc.get('family')}, "
                         f"{model_desc.get('dtype')}; that one: {old['model'].get('family')}, "
                         f"{old['model'].get('dtype', 'float32')}); use another --out")


def method_specs(cfg: EvalConfig) -> dict[str, str]:
    """label -> the method with every option spelled out (`full_spec`), for every method of the run."""
    from kvstitch.select.method import build, full_spec

    return {m: full_spec(build(m)) for m in dict.fromkeys([*cfg.methods, *cfg.auto_methods])}


def _model_desc(engine) -> dict:
    try:
        desc = dict(engine.adapter.describe())
    except Exception:  # noqa: BLE001 - descriptive only
        desc = {}
    desc["fingerprint"] = getattr(engine, "fingerprint", None)  # weights and dtype
    desc["dtype"] = str(getattr(engine, "dtype", "")).removeprefix("torch.")
    return json.loads(json.dumps(desc, default=str))


def heldout_samples(cfg: EvalConfig, samples: list[Sample]) -> list[Sample]:
    """``cfg.heldout``: a SQuAD run's samples less the questions of the articles stitch adapters train on."""
    if not cfg.heldout:
        return samples
    from kvstitch.tasks.squad import FILES, read_squad

    if cfg.dataset not in FILES:
        raise InputError("--heldout keeps the SQuAD questions of articles stitch adapters never train on: it takes "
                         "--dataset squad or squad2 (no other evaluation set is trained on)")
    squad = read_squad(cfg.dataset)
    trained = {q.qid for q in squad.questions if not squad.heldout(q)}
    return [s for s in samples if s.meta.get("qid") not in trained]


def run_samples(cfg: EvalConfig, tokenizer) -> list[Sample]:
    """The run's samples in visiting order. A dataset: its records ``cfg.samples`` in file order (the first
    k done are the file's first k). Generated tasks: length-major; within a length, tasks round-robin over
    the indices in `spread_order`, so an interrupted run keeps every task at about the same n and depths
    spread over [0, 1]."""
    if cfg.dataset:
        from kvstitch.tasks.datasets import load_dataset

        if cfg.retrieve is not None:
            from .squad_retrieval import load_squad_retrieved

            return heldout_samples(cfg, load_squad_retrieved(cfg.dataset, tokenizer, start=cfg.samples[0],
                                                             stop=cfg.samples[1], **cfg.retrieve))
        samples = load_dataset(cfg.dataset, *cfg.samples, passages=cfg.passages, merge=cfg.merge, seed=cfg.seed)
        return heldout_samples(cfg, samples)
    count = _token_counter(tokenizer)
    out = []
    for length in cfg.lengths:
        samples = {t: generate(t, cfg.n, length, cfg.chunk_tokens, cfg.seed, count, haystack=cfg.haystack)
                   for t in cfg.tasks}
        out += [samples[task][i] for i in spread_order(cfg.n) for task in cfg.tasks]
    return out


def _check_config(engine, cfg: EvalConfig) -> None:
    """Validate `cfg` (InputError) and settle what the engine decides: method labels, store dtype, precompute
    mode, the haystack."""
    from kvstitch.select import check_methods

    # labels: what rows are keyed by (an alias's name, or the canonical spec: "infoflow(reorder=max)" and
    # "infoflow_reorder_max" are one method, and a resumed run finds its rows under either)
    cfg.methods, cfg.auto_methods = check_methods(cfg.methods), check_methods(cfg.auto_methods)
    bad_tasks = [] if cfg.dataset else [t for t in cfg.tasks if t not in TASKS]
    if bad_tasks:
        raise InputError(f"unknown task(s) {', '.join(bad_tasks)}; known: {', '.join(sorted(TASKS))}")
    if any(r != AUTO and not 0.0 <= r <= 1.0 for r in cfg.ratios):
        raise InputError(f"ratios must be in [0, 1], got {cfg.ratios}")
    cfg.storage_dtype = getattr(engine.store, "storage_dtype", cfg.storage_dtype)  # the engine's store decides
    cfg.precompute_mode = getattr(engine, "precompute_mode", cfg.precompute_mode)  # and so does the engine
    try:
        cfg.haystack = resolve_haystack(cfg.haystack)
    except (ValueError, FileNotFoundError) as e:
        raise InputError(str(e)) from None


def _sample_key(sample: Sample) -> tuple:
    m = sample.meta
    return sample.task, m["seed"], m["index"], m["length"], m["chunk_tokens"]


def run_plan(engine, cfg: EvalConfig, rows: Sequence[dict], shard: tuple[int, int] | None = None,
             max_samples: int | None = None) -> list[tuple[Sample, list]]:
    """(sample, its (method, ratio) pairs not yet in `rows`) for the samples of this shard with any left to run."""
    have = {row_key(r) for r in rows}
    todo_combos = combos(cfg.methods, cfg.ratios, cfg.auto_methods)
    k_shard, n_shards = check_shard(shard)
    plan: list[tuple[Sample, list]] = []
    for position, s in enumerate(run_samples(cfg, engine.tokenizer)):  # the place in the whole run: what a shard is cut by
        if position % n_shards != k_shard:
            continue
        todo = [(mm, r) for mm, r in todo_combos if (*_sample_key(s), mm, r) not in have]
        if todo:
            plan.append((s, todo))
    return plan if max_samples is None else plan[:max_samples]


def _run_planned(engine, cfg: EvalConfig, plan: list[tuple[Sample, list]], rows: list[dict], out: Path,
                    progress: bool, console) -> list[str]:
    """Run `plan` sample by sample, appending each row to the log and to `rows` as it completes; a failing
    sample is logged (errors.log) and skipped. -> the error messages."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    by_sample: dict[tuple, dict[tuple, dict]] = defaultdict(dict)
    for r in rows:
        by_sample[sample_key(r)][(r.get("method"), norm_ratio(str(r.get("method")), r.get("ratio")))] = r
    errors: list[str] = []
    columns = [TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TimeRemainingColumn(), TextColumn("{task.fields[now]}")]
    with Progress(*columns, console=console, disable=not progress, transient=False) as bar:
        pid = bar.add_task("eval", total=sum(len(t) for _, t in plan), now="")

        def on_row(row: dict) -> None:
            append_jsonl(out / RESULTS, row)
            rows.append(row)
            bar.advance(pid)

        def on_start(sample: Sample, m: str, r: float | None) -> None:
            bar.update(pid, now=f"{sample.task}#{sample.meta['index']} L={sample.meta['length']} {m}"
                                + ("" if r is None else f" r={r}"))

        # a live bar is invisible in a log file (nohup, CI): there, one plain line per sample instead
        log_lines = progress and not console.is_terminal
        started = time.monotonic()
        for done, (sample, todo) in enumerate(plan, 1):
            key = _sample_key(sample)
            sample_started = time.monotonic()
            try:
                eval_sample(engine, sample, todo, by_sample.get(key, {}), cfg, on_row, on_start)
            except KeyboardInterrupt:
                raise
            except Exception as e:  # noqa: BLE001 - one broken method must not stop a long run
                msg = f"{key}: {type(e).__name__}: {e}"
                errors.append(msg)
                console.print(f"[red]error[/] {msg}", highlight=False)
                with open(out / "errors.log", "a", encoding="utf-8") as f:
                    f.write(msg + "\n" + traceback.format_exc() + "\n")
                done_now = len([r for r in rows if row_key(r)[:5] == key]) - len(by_sample.get(key, {}))
                bar.advance(pid, max(0, len(todo) - done_now))
            if log_lines:
                console.print(sample_log_line(done, len(plan), f"{sample.task}#{sample.meta['index']}",
                                              time.monotonic() - sample_started, time.monotonic() - started,
                                              resident_bytes(), _store_bytes(engine.store)),
                              highlight=False)
    return errors


def run_eval(engine, cfg: EvalConfig, out: str | os.PathLike, progress: bool = True, command: str | None = None,
             console=None, max_samples: int | None = None, shard: tuple[int, int] | None = None) -> list[dict]:
    """Run (or resume) the evaluation into `out`; rewrite the summary and plots. -> every row in the log.

    Samples are visited in `run_samples` order, each with all its (method, ratio) rows, so an interrupted
    run leaves whole samples. `max_samples` caps the samples visited (tests).
    `shard=(k, n)` visits only every n-th sample of that order, from the k-th: n processes (or machines) with
    k = 0..n-1 and their own `out` split one run between them (`kvstitch eval-merge` joins them). The split
    is over all the run's samples, done or not, so a shard resumed after a stop keeps its own samples."""
    from rich.console import Console

    console = console or Console(stderr=True)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    _check_config(engine, cfg)
    model_desc = _model_desc(engine)
    _check_protocol(out, cfg, model_desc)
    rows = read_jsonl(out / RESULTS)
    plan = run_plan(engine, cfg, rows, shard, max_samples)
    _write_meta(out, cfg, model_desc, command, rows_before=len(rows))
    if plan:
        warm_up(engine, cfg.methods)
    errors = _run_planned(engine, cfg, plan, rows, out, progress, console)
    write_reports(rows, out, cfg.depth_bins)
    _write_meta(out, cfg, model_desc, command, rows_before=None, rows_after=len(rows), errors=errors)
    if plan and len(errors) == len(plan):
        raise EvalError(f"every sample of this run failed ({len(errors)} of {len(plan)}; first: {errors[0]}); "
                        f"tracebacks in {out / 'errors.log'}")
    return rows


def sample_log_line(done: int, total: int, name: str, took_s: float, elapsed_s: float,
                    resident: int | None = None, store: int | None = None) -> str:
    """One line of a run logged to a file: where it is, what the sample took, the time left at the mean pace, and
    the process's resident memory with the chunk store's share of it (a long run's memory is watched from here)."""
    left = elapsed_s / done * (total - done)
    line = (f"eval: sample {done}/{total} ({name}) done in {_hms(took_s)}; "
            f"elapsed {_hms(elapsed_s)}, ~{_hms(left)} left")
    if resident is not None:
        line += f"; {resident / 2**30:.1f} GiB resident"
        if store is not None:
            line += f", {store / 2**30:.1f} GiB of it in the chunk store"
    return line


def _store_bytes(store) -> int | None:
    """Bytes the engine's in-process store tiers hold (disk and Redis tiers hold none of the process's memory)."""
    from kvstitch.store import MemoryStore, TieredStore

    tiers = store.tiers if isinstance(store, TieredStore) else [store]
    held = [t.stats()["bytes"] for t in tiers if isinstance(t, MemoryStore)]
    return sum(held) if held else None


def _hms(seconds: float) -> str:
    m, s = divmod(int(round(seconds)), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


def _write_meta(out: Path, cfg: EvalConfig, model_desc: dict, command: str | None, rows_before: int | None,
                rows_after: int | None = None, errors: list[str] | None = None) -> None:
    path = out / "run.json"
    old = json.loads(path.read_text()) if path.exists() else {}
    commands = old.get("commands", [])
    if command and rows_before is not None and (not commands or commands[-1] != command):
        commands.append(command)
    protocol = cfg.protocol()
    if "auto" in old.get("protocol", {}) and "auto" not in protocol:  # a resume without auto: its rows keep theirs
        protocol["auto"] = old["protocol"]["auto"]
    specs = {**(old.get("method_specs") or {}), **method_specs(cfg)}
    meta = {**old, "protocol": protocol, "model": model_desc, "commands": commands, "method_specs": specs,
            "config": {k: v for k, v in cfg.__dict__.items()}, "torch_threads": torch.get_num_threads(),
            "updated": time.strftime("%Y-%m-%d %H:%M:%S")}
    if rows_after is not None:
        meta["rows"] = rows_after
        meta["errors_last_run"] = errors or []
    path.write_text(json.dumps(meta, indent=2, default=str) + "\n")
