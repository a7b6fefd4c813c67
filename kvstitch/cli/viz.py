"""`kvstitch viz`: the token picture of what each selection method recomputes (`kvstitch.eval.viz`), as a command."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import typer

from kvstitch.core.errors import InputError
from kvstitch.eval.viz import selection_picture, write_picture

from .options import StitchAdapterOpt


def viz_command(
        method: str = typer.Option("naive,random,prophet,oracle", "--method", "--methods",
                                   help="comma-separated methods, or 'all' (one column each)"),
        task: str = typer.Option("two_hop", help="task generating the prompt (see kvstitch.tasks.TASKS)"),
        length: int = typer.Option(512, help="context tokens"),
        chunk_tokens: int = typer.Option(128, help="tokens per chunk"),
        ratio: float = typer.Option(0.2, help="recompute ratio"),
        index: int = typer.Option(0, help="which sample of the task"),
        seed: int = typer.Option(0, help="task generator seed"),
        depth: Optional[float] = typer.Option(0.5, help="needle depth in [0, 1]"),
        answers: bool = typer.Option(True, help="also generate each method's answer"),
        answer_prefix: bool = typer.Option(True, help="append the task's answer prefix after the assistant header"),
        out: Path = typer.Option(Path("sel.html"), help="HTML output"),
        png: Optional[Path] = typer.Option(None, help="PNG output (default: next to the HTML)"),
        model: Optional[str] = typer.Option(None, "--model", "-m", help="model (default: embedded SmolLM2)"),
        store: Optional[str] = typer.Option(None, "--store", help="chunk store"),
        stitch_adapter: StitchAdapterOpt = "auto",
) -> None:
    """The prompt's tokens with each method's recomputed tokens highlighted, side by side (ProphetKV Fig. 2):
    a self-contained HTML page plus a PNG."""
    from rich.console import Console

    from kvstitch.core.extras import require
    from kvstitch.engine import Engine
    from kvstitch.select import resolve_methods
    from kvstitch.tasks.tasks import TASKS, generate

    require("matplotlib", "plots", "kvstitch viz")  # its PNG: fail before the model loads
    console = Console(stderr=True)
    if task not in TASKS:
        raise InputError(f"unknown task {task!r}; known: {', '.join(sorted(TASKS))}")
    if not 0.0 <= ratio <= 1.0 or math.isnan(ratio):
        raise InputError(f"--ratio must be in [0, 1], got {ratio}")
    names = resolve_methods(method)
    with console.status("loading the model ..."):
        engine = Engine.load(model, store=store, stitch_adapter=stitch_adapter)
    count = lambda s: len(engine.tokenizer.encode(s, add_special_tokens=False))  # noqa: E731
    sample = generate(task, index + 1, length, chunk_tokens, seed, count, depth=depth)[index]
    pic = selection_picture(engine, sample.question, sample.chunks, names, ratio, sample.answers, task,
                            sample.meta.get("inserts"), sample.meta.get("answer_prefix") if answer_prefix else None,
                            with_answers=answers)
    html_path, png_path = write_picture(pic, out, png or Path(out).with_suffix(".png"))
    console.print(f"written: {html_path}, {png_path}", highlight=False)


if __name__ == "__main__":  # `python -m kvstitch.cli.viz --method ...` == `kvstitch viz --method ...`
    typer.run(viz_command)
