"""What the commands share: the consoles, one clear line for an error (`friendly_errors`), loading the engine
from the options, torch threads, comma-separated values and the one-line note on an answer's budget."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Optional

import typer
from rich.console import Console
from rich.markup import escape

from kvstitch.core.errors import InputError, KVStitchError

if TYPE_CHECKING:
    from kvstitch.engine import GenerationStats

console = Console()
err_console = Console(stderr=True)


def friendly_errors(fn):
    """One clear line and a non-zero exit for every kvstitch error (never a bare traceback)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except KVStitchError as e:
            err_console.print(f"[bold red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
            raise typer.Exit(getattr(e, "exit_code", 2)) from None
        except (FileNotFoundError, PermissionError, IsADirectoryError) as e:
            err_console.print(f"[bold red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
            raise typer.Exit(2) from None

    return wrapper


def load_engine(model: Optional[str], store: Optional[str] = None, dtype: Optional[str] = None,
                stitch_adapter: Optional[str] = None, **kwargs):
    """`Engine.load` behind a status line (loading takes seconds)."""
    from kvstitch.engine import Engine

    with console.status(f"loading {model or 'the embedded model (SmolLM2-135M-Instruct)'} ..."):
        return Engine.load(model, store=store, dtype=dtype, stitch_adapter=stitch_adapter, **kwargs)


def set_threads(threads: Optional[int]) -> None:
    """``--threads``: torch's CPU threads (None: torch's default)."""
    import torch

    if threads is not None:
        if threads < 1:
            raise InputError(f"--threads must be >= 1, got {threads}")
        torch.set_num_threads(threads)


def csv_list(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def csv_ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def parse_schedule(text: str) -> tuple[float, ...]:
    """``--auto-schedule``: the rounds' ratios, comma-separated."""
    try:
        return tuple(float(x) for x in csv_list(text))
    except ValueError:
        raise InputError(f"--auto-schedule takes comma-separated ratios, e.g. 0.1 or 0.05,0.1; got {text!r}") from None


def budget_note(stats: GenerationStats) -> str:
    """"20% recomputed", or for ratio=auto "auto: 10% recomputed in 2 rounds" / "auto: full prefill after 4 rounds"."""
    used = stats.ratio_used
    note = f"{used:.0%} recomputed"
    if stats.auto_skipped == "short_context":
        note = "auto: short context, full prefill"
    elif stats.ratio == "auto" and stats.verify is not None:  # verified rounds: the check is what decided
        m = len(stats.verify["chunks"])
        last = stats.round_log[-1] if stats.round_log else {}
        note = (f"auto: {used:.0%} recomputed, confirmed by a full prefill of {m} passages" if stats.converged
                else f"auto: its {last.get('ratio', 0):.0%} round said {last.get('answer', '')[:40]!r}, a full "
                     f"prefill of {m} passages said {stats.verify['answer'][:40]!r}: full prefill answered")
    elif stats.ratio == "auto":
        note = (f"auto: {used:.0%} recomputed, converged in {stats.rounds} rounds" if stats.converged
                else f"auto: no convergence in {stats.rounds} rounds, " +
                ("full prefill" if used >= 1.0 else f"{used:.0%} recomputed"))
    if stats.cold_path == "full_prefill":
        note = "cold store: full prefill (its chunks are cached after the answer)"
    if stats.guard:
        note += ", guard: " + ("agrees with full prefill" if stats.guard["agreed"]
                               else "corrected to full prefill's answer")
    return note
