"""`kvstitch calibrate`: the command over `kvstitch.eval.calibrate` (mounted by `kvstitch.cli.main`)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from .options import Dtype, Model, StitchAdapterOpt, Store, Threads

DEFAULT_AUTOS = ("schedule=0.05/0.1,tol=0.01", "schedule=0.1/0.2,tol=0.01", "schedule=0.05/0.1,tol=0.02",
                 "schedule=0.1,verify_chunks=2")  # the last: verification by a short full prefill (design.md)


def calibrate_command(
    dataset: str = typer.Option(..., "--dataset", help="your questions and passages: a JSON/JSONL file in the eval's "
                                                       "shapes (question/answers/ctxs or LongBench's), or 'musique', "
                                                       "'squad', 'squad2'"),
    samples: str = typer.Option("", "--samples", help="records START:STOP of the file (default: all; SQuAD's tuning "
                                                      "split is 0:100)"),
    passages: Optional[int] = typer.Option(None, "--passages", help="squad / squad2: paragraphs a question (default 10)"),
    merge_passages: int = typer.Option(1, "--merge-passages", help="join this many adjacent passages into one chunk"),
    dtype: Dtype = None,
    model: Model = None,
    stitch_adapter: StitchAdapterOpt = None,
    methods: str = typer.Option("prophet,deltaprop", "--methods", help="selection methods to compare: comma-separated "
                                                                      "specs, e.g. 'prophet,deltaprop(base=infoflow)'"),
    ratios: str = typer.Option("0.05,0.1,0.2,0.4", "--ratios", help="fixed recompute ratios to compare"),
    auto: Optional[list[str]] = typer.Option(None, "--auto", help="an auto setting to compare (repeatable): "
                                             "'auto(schedule=[0.05,0.1],tol=0.01)', 'schedule=0.05/0.1,tol=0.01' "
                                             "or JSON; default: "
                                             + "; ".join(DEFAULT_AUTOS)),
    target: float = typer.Option(0.9, "--target", help="agreement with full prefill the chosen setting must reach"),
    config: Optional[Path] = typer.Option(None, "--config", help="TOML config to write the choice into (the file "
                                          "`kvstitch serve --config` and `kvstitch ask --config` read)"),
    out: Path = typer.Option(Path("calibration"), "--out", help="directory for rows.jsonl, calibration.md, "
                                                                "frontier.png (a rerun resumes)"),
    store: Store = None,
    threads: Threads = None,
) -> None:
    """Measure methods, ratios and auto settings on your own questions against full prefill, draw the
    agreement / TTFT frontier, and write the chosen setting (with its measured agreement) into --config."""
    from rich.console import Console

    from kvstitch.eval.calibrate import calibrate, configs, parse_auto
    from kvstitch.core.errors import InputError
    from kvstitch.core.extras import require
    from kvstitch.tasks.datasets import load_dataset, parse_range

    require("matplotlib", "plots", "kvstitch calibrate")  # frontier.png: fail before the measuring, not after it
    console = Console(stderr=True)
    if not 0.0 < target <= 1.0:
        raise InputError(f"--target must be in (0, 1], got {target}")
    try:
        ratio_list = [float(x) for x in ratios.split(",") if x.strip()]
    except ValueError:
        raise InputError(f"--ratios takes comma-separated numbers, got {ratios!r}") from None
    from kvstitch.select import split_specs

    cfgs = configs(split_specs(methods), ratio_list,
                   [parse_auto(a) for a in (auto or DEFAULT_AUTOS)])
    start, stop = parse_range(samples)
    # a file it cannot parse fails here, before the model loads
    data = load_dataset(dataset, start, stop, passages=passages, merge=merge_passages)
    if threads:
        import torch

        torch.set_num_threads(threads)
    from kvstitch.engine import Engine

    with console.status(f"loading {model or 'the embedded model'} ..."):
        eng = Engine.load(model, store=store, dtype=dtype, stitch_adapter=stitch_adapter)
    command = "kvstitch calibrate " + " ".join(sys.argv[2:]) if len(sys.argv) > 1 else ""
    rep = calibrate(eng, data, cfgs, out, target, config, model=model, dataset=dataset, command=command,
                    progress=lambda s, c: console.print(f"[dim]{s} {c}[/]", highlight=False))
    console.print(rep["markdown"], highlight=False, markup=False)
    ch = rep["chosen"]
    where = f" -> {config}" if config else ""
    console.print(f"chosen: {ch['config']} (agreement {ch['agreement']:.2f}, {ch['speedup']:.2f}x){where}; "
                  f"report {out / 'calibration.md'}, plot {out / 'frontier.png'}", highlight=False)
