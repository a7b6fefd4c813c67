"""Command-line entry points of the evaluation (typer): ``kvstitch eval-compare``."""

from __future__ import annotations

import shlex
from pathlib import Path

import typer


def compare_command(
        base: Path = typer.Argument(..., help="the reference run: a `kvstitch eval --out` directory (or its results.jsonl)"),
        other: Path = typer.Argument(..., help="the run to compare with it, over the same samples"),
        out: Path = typer.Option(..., "--out", help="directory for <name>.md and <name>.json"),
        base_label: str = typer.Option("base", help="column label of BASE (e.g. fp16)"),
        other_label: str = typer.Option("other", help="column label of OTHER (e.g. int8)"),
        name: str = typer.Option("compare", help="file name stem of the outputs"),
        tasks: str = typer.Option("", help="only these tasks (comma-separated; default: all)"),
        lengths: str = typer.Option("", help="only these context lengths (comma-separated; default: all)"),
) -> None:
    """Two eval runs of the same samples side by side: score, NLL-gap recovery (both against BASE's gap),
    KL and the share of identical answers, per method and ratio (markdown + JSON)."""
    from rich.console import Console

    from ..errors import InputError
    from .compare import write_comparison

    task_list = [t.strip() for t in tasks.split(",") if t.strip()]
    try:
        length_list = [int(x) for x in lengths.split(",") if x.strip()]
    except ValueError:
        raise InputError(f"--lengths takes comma-separated integers, got {lengths!r}") from None
    args = ["eval-compare", str(base), str(other), "--out", str(out), "--base-label", base_label,
            "--other-label", other_label] + (["--name", name] if name != "compare" else []) + \
        (["--tasks", tasks] if task_list else []) + (["--lengths", lengths] if length_list else [])
    command = "kvstitch " + " ".join(shlex.quote(a) for a in args)  # what reproduces these files
    md, js, rows = write_comparison(base, other, out, base_label, other_label, name, command=command,
                                    tasks=task_list, lengths=length_list)
    console = Console()
    console.print(md.read_text(), highlight=False, soft_wrap=True)
    console.print(f"{len(rows)} rows -> {md}, {js}", highlight=False)
