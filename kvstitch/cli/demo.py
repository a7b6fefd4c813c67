"""`kvstitch demo`: bundled passages and questions answered by full prefill and by stitched reuse, side by side."""

from __future__ import annotations

import json
import statistics
from importlib import resources
from typing import Optional

import typer
from rich.table import Table

from .common import budget_note, console, load_engine, parse_schedule
from .options import MODEL_HELP, StitchAdapterOpt, Store

# The demo's default: the reference model, and `auto` as chosen on the Qwen NIAH 8K calibration split (one round
# at 10%, accepted only if a full prefill of the question over its 2 best-matching passages agrees), measured on
# the demo's candidate questions in docs/results/demo/README.md.
DEMO_MODEL = "qwen2.5-0.5b"
DEMO_AUTO = {"schedule": "0.1", "verify_chunks": 2}


def demo_command(method: str = typer.Option("deltaprop", help="stitched method to compare with full prefill"),
         ratio: str = typer.Option("auto", help="recompute ratio, or 'auto' (adaptive budget, the default), or "
                                                "an auto spec such as 'auto(schedule=[0.1],verify_chunks=2)'"),
         auto_schedule: str = typer.Option(DEMO_AUTO["schedule"],
                                           help="'auto': the rounds' ratios, comma-separated"),
         auto_verify_chunks: int = typer.Option(DEMO_AUTO["verify_chunks"],
                                                help="'auto': accept a round only if a full prefill of the question "
                                                     "over this many best-matching passages says the same (0: off, "
                                                     "rounds are compared with each other)"),
         questions: Optional[int] = typer.Option(None, "--questions", help="only the first N bundled questions"),
         model: str = typer.Option(DEMO_MODEL, "--model", "-m", help=MODEL_HELP),
         dtype: str = typer.Option("fast", help="model dtype: fast (bfloat16 where the CPU or GPU multiplies it "
                                                 "natively, else float32), float32 or bfloat16"),
         store: Store = None, stitch_adapter: StitchAdapterOpt = "auto") -> None:
    """The main job in one command: bundled passages and questions, answered with `full` prefill and with
    stitched reuse (by default kvstitch's own method with the adaptive budget, each round checked against a
    full prefill of the question over its two best-matching passages), answers, the budget each used and TTFT
    side by side. The default setting was chosen on a calibration split (docs/results/demo/README.md)."""
    from kvstitch.core.errors import InputError
    from kvstitch.engine.budget import AutoBudget, ratio_value
    from kvstitch.tasks.agreement import first_words_agree

    ratio = ratio_value(ratio)
    auto = AutoBudget.of({"schedule": parse_schedule(auto_schedule), "verify_chunks": auto_verify_chunks})  # bad values fail before loading
    if isinstance(ratio, AutoBudget):  # an auto spec ("auto(tol=0.05)"): its options, not the flags'
        auto, ratio = ratio, "auto"
    data = json.loads(resources.files("kvstitch").joinpath("data/samples/demo.json").read_text())
    if questions is not None:
        if questions < 1:
            raise InputError(f"--questions must be >= 1, got {questions}")
        data["questions"] = data["questions"][:questions]
    eng = load_engine(model, store, dtype, stitch_adapter)
    passages = data["passages"]
    with console.status("precomputing the passages' KV caches (once; later questions reuse them) ..."):
        eng.generate(data["questions"][0]["question"], passages, method="naive", max_new_tokens=1)
    label = f"{method} {'auto' if ratio == 'auto' else f'{ratio:.0%}'}"
    if ratio != "auto":
        budget = "a fixed budget of recomputed tokens"
    elif auto.verify_chunks:
        budget = (f"rounds of {', '.join(f'{r:.0%}' for r in auto.schedule)} recomputed, each accepted only if a full "
                  f"prefill of the question over its {auto.verify_chunks} best-matching passages agrees, else full "
                  f"prefill")
    else:
        budget = "an adaptive budget of recomputed tokens"
    adapted = f", stitch adapter {eng.stitch_adapter.config.form}" if eng.stitch_adapter else ""
    console.print(f"[bold]{model} ({str(eng.dtype).removeprefix('torch.')}): {len(passages)} passages, "
                  f"{eng.layout('q', passages).n_context} context tokens[/]; each question answered by full prefill "
                  f"and by {label} (stitched caches{adapted} + {budget}).\n",
                  highlight=False)
    same, speedups, right = 0, [], {"full": 0, "stitched": 0}
    fixed_same, fixed_speedups = 0, []  # the same method at a fixed 20%, for contrast
    for i, q in enumerate(data["questions"], start=1):
        full = eng.generate(q["question"], passages, method="full", max_new_tokens=24)
        ours = eng.generate(q["question"], passages, method=method, max_new_tokens=24,
                            recompute_ratio=auto if ratio == "auto" else ratio)
        fixed = eng.generate(q["question"], passages, method=method, recompute_ratio=0.2, max_new_tokens=24)
        fixed_same += first_words_agree(fixed.text, full.text)
        fixed_speedups.append(full.ttft_s / fixed.ttft_s)
        agree = first_words_agree(ours.text, full.text)
        same += agree
        speedups.append(full.ttft_s / ours.ttft_s)
        console.print(_demo_block(i, q, full, ours, label, agree, speedups[-1], right), highlight=False)
    n = len(data["questions"])
    console.print(f"\n[bold]{label}[/] says what full prefill says (first 12 words) in [bold]{same}/{n}[/] answers, "
                  f"median TTFT speed-up [bold]{statistics.median(speedups):.1f}x[/]; answers containing the "
                  f"expected text: full {right['full']}/{n}, {label} {right['stitched']}/{n}.", highlight=False)
    console.print(f"For contrast, {method} at a fixed 20%: says what full prefill says in {fixed_same}/{n} answers, "
                  f"median TTFT speed-up {statistics.median(fixed_speedups):.1f}x.", highlight=False)
    st = eng.store.stats()
    console.print(f"Chunk store: {len(passages)} passages precomputed once, then reused {st.get('hits', 0)} times "
                  f"({st.get('bytes_loaded', 0) / 2**20:.0f} MiB of KV read, {st.get('storage_dtype')})"
                  + (f"; {st['problems']} unreadable entries recomputed" if st.get("problems") else "") + ".",
                  highlight=False)


def _demo_block(i: int, q: dict, full, ours, label: str, agree: bool, speedup: float, right: dict):
    """One question of the demo as a block that wraps within the terminal's width (80 columns and up)."""
    from rich.console import Group
    from rich.text import Text

    grid = Table.grid(padding=(0, 1))
    grid.add_column(width=3)
    grid.add_column(no_wrap=True)
    grid.add_column(justify="right", no_wrap=True)
    grid.add_column(ratio=1)
    for key, name, res in (("full", "full prefill", full), ("stitched", label, ours)):
        ok = q["answer"].lower() in res.text.lower()  # RULER-style string match
        right[key] += ok
        grid.add_row("", name, f"{res.ttft_s:.2f} s", Text(f"{'✓' if ok else '✗'} {res.text}"))
    pace = f"{speedup:.1f}x faster" if speedup >= 1 else f"{1 / speedup:.1f}x slower"  # "0.6x faster" misleads
    verdict = f"same answer, {pace}" if agree else f"DIFFERENT answer, {pace}"
    grid.add_row("", "", "", Text(f"{verdict}; {budget_note(ours.stats)}", style="green" if agree else "red"))
    head = Text.assemble((f"{i}. {q['question']}", "bold"), f"  (expected: {q['answer']})")
    return Group(head, grid)
