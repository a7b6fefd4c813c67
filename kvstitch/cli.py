"""The `kvstitch` command line (typer)."""

from __future__ import annotations

import functools
import json
import sys
from importlib import resources
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from .errors import KVStitchError

app = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                  help="Stitched KV-cache reuse with selective recompute for long-context RAG.")
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks (results as JSON + a markdown table).")
app.add_typer(bench_app, name="bench")
console = Console()
err_console = Console(stderr=True)

ModelOpt = typer.Option(None, "--model", "-m", help="embedded name (smollm2, gemma3), HF directory or .gguf file")
StoreOpt = typer.Option(None, "--store", help="chunk store: a directory, redis://host:port/db, or none (memory)")


def friendly_errors(fn):
    """One clear line and a non-zero exit for every kvstitch error (never a bare traceback)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except KVStitchError as e:
            err_console.print(f"[bold red]error:[/] {e}", highlight=False, soft_wrap=True)
            raise typer.Exit(2) from None
        except (FileNotFoundError, PermissionError, IsADirectoryError) as e:
            err_console.print(f"[bold red]error:[/] {e}", highlight=False, soft_wrap=True)
            raise typer.Exit(2) from None

    return wrapper


def _load(model: Optional[str], store: Optional[str] = None):
    from .engine import Engine

    with console.status(f"loading {model or 'the embedded model (SmolLM2-135M-Instruct)'} ..."):
        return Engine.load(model, store=store)


@app.command()
def methods() -> None:
    """List the registered selection methods."""
    from .select import SELECTORS

    for name in sorted(SELECTORS):
        doc = (SELECTORS[name].__doc__ or "").strip().splitlines()[0]
        console.print(f"[bold]{name:<18}[/] {doc}", highlight=False)


@app.command()
@friendly_errors
def ask(question: str = typer.Argument(..., help="the question"),
        chunk: list[Path] = typer.Option(..., "--chunk", "-c", help="a passage file (repeatable, in order)"),
        method: str = typer.Option("prophet", help="selection method (see `kvstitch methods`)"),
        ratio: float = typer.Option(0.2, help="recompute ratio in [0, 1]"),
        compare: Optional[str] = typer.Option(None, help="also answer with this method (e.g. full)"),
        max_new_tokens: int = typer.Option(32, help="answer length cap"),
        model: Optional[str] = ModelOpt, store: Optional[str] = StoreOpt) -> None:
    """Answer QUESTION over the given passage files with stitched reuse."""
    from .errors import InputError

    texts = []
    for p in chunk:
        if not p.is_file():
            raise InputError(f"chunk file {str(p)!r} does not exist or is not a file")
        texts.append(p.read_text(encoding="utf-8", errors="replace"))
    eng = _load(model, store)
    runs = [(method, ratio)] + ([(compare, ratio)] if compare else [])
    results = [eng.generate(question, texts, method=m, recompute_ratio=r, max_new_tokens=max_new_tokens)
               for m, r in runs]
    for (m, _), res in zip(runs, results):
        console.print(f"[bold]{m}[/] ({res.stats['recomputed_tokens']}/{res.stats['context_tokens']} recomputed, "
                      f"TTFT {res.ttft_s * 1000:.0f} ms): {res.text}", highlight=False)
    if compare:
        console.print(f"speedup of {method} over {compare}: {results[1].ttft_s / results[0].ttft_s:.2f}x TTFT")


@app.command()
@friendly_errors
def demo(method: str = typer.Option("prophet", help="stitched method to compare with full prefill"),
         ratio: float = typer.Option(0.2, help="recompute ratio"),
         model: Optional[str] = ModelOpt, store: Optional[str] = StoreOpt) -> None:
    """The main job in one command: bundled passages and questions, answered with `full` prefill and
    with stitched reuse, answers and TTFT side by side."""
    data = json.loads(resources.files("kvstitch").joinpath("data/samples/demo.json").read_text())
    eng = _load(model, store)
    passages = data["passages"]
    eng.generate(data["questions"][0]["question"], passages, method="naive", max_new_tokens=1)  # warm + precompute
    table = Table(title=f"{len(passages)} passages, {eng.layout('q', passages).n_context} context tokens; "
                        f"{method} recomputes {ratio:.0%}")
    for col in ("question", "expected", "full", "TTFT full", method, f"TTFT {method}", "speedup"):
        table.add_column(col)
    for q in data["questions"]:
        full = eng.generate(q["question"], passages, method="full", max_new_tokens=24)
        ours = eng.generate(q["question"], passages, method=method, recompute_ratio=ratio, max_new_tokens=24)
        table.add_row(q["question"], q["answer"], full.text, f"{full.ttft_s * 1000:.0f} ms", ours.text,
                      f"{ours.ttft_s * 1000:.0f} ms", f"{full.ttft_s / ours.ttft_s:.1f}x")
    console.print(table)
    console.print(f"chunk store: {eng.store.stats()}", highlight=False)


def _csv_ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def _csv(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


@bench_app.command("ttft")
@friendly_errors
def bench_ttft_cmd(lengths: str = typer.Option("2048,4096,8192", help="context lengths in tokens"),
                   methods: str = typer.Option("random", help="comma-separated methods (full is always run)"),
                   ratio: float = typer.Option(0.2), repeats: int = typer.Option(3),
                   chunk_tokens: int = typer.Option(256),
                   out: Path = typer.Option(Path("docs/results"), help="output directory"),
                   model: Optional[str] = ModelOpt) -> None:
    """Full-prefill TTFT vs stitched TTFT (warm chunk caches), ratios measured in one run."""
    from .bench import bench_ttft, ttft_table, write_results

    eng = _load(model)
    rows = bench_ttft(eng, _csv_ints(lengths), _csv(methods), ratio, repeats, chunk_tokens)
    table = ttft_table(rows)
    write_results(rows, out, "bench_ttft", table, {"model": eng.adapter.describe(), "device": str(eng.device)})
    console.print(table, highlight=False)
    console.print(f"written: {out / 'bench_ttft.json'}, {out / 'bench_ttft.md'}")


def _mount_optional() -> None:
    """Sub-apps owned by other modules (added as they land)."""
    try:
        from .store.cli import store_app

        app.add_typer(store_app, name="store", help="Inspect, verify and garbage-collect a chunk store.")
    except ImportError:
        pass


_mount_optional()


def main() -> None:  # pragma: no cover
    sys.exit(app())
