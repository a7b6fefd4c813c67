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
) -> None:
    """Two eval runs of the same samples side by side: score, NLL-gap recovery (both against BASE's gap),
    KL and the share of identical answers, per method and ratio (markdown + JSON)."""
    from rich.console import Console

    from .compare import write_comparison

    args = ["eval-compare", str(base), str(other), "--out", str(out), "--base-label", base_label,
            "--other-label", other_label] + (["--name", name] if name != "compare" else [])
    command = "kvstitch " + " ".join(shlex.quote(a) for a in args)  # what reproduces these files
    md, js, rows = write_comparison(base, other, out, base_label, other_label, name, command=command)
    console = Console()
    console.print(md.read_text(), highlight=False, soft_wrap=True)
    console.print(f"{len(rows)} rows -> {md}, {js}", highlight=False)
