"""Options that several commands share, each declared once as an `Annotated` type: typer reads the
`typer.Option` inside it, and the command gives the default (``model: Model = None``).

The decode-policy options live together at the end, with their defaults, so that how a policy is named and
parsed is described in one place."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

# ---- the model and its chunk store -----------------------------------------------------------------------
MODEL_HELP = "embedded name (smollm2, gemma3, qwen2.5-0.5b, qwen2.5-1.5b), HF directory or .gguf file"
Model = Annotated[Optional[str], typer.Option("--model", "-m", help=MODEL_HELP)]

Store = Annotated[Optional[str], typer.Option("--store", help="chunk store: a directory, redis://host:port/db, or "
                                                              "none (memory)")]

DTYPE_HELP = ("model dtype: float32 (CPU default), bfloat16 (CUDA default; on a CPU with AVX512-BF16 ~1.8x faster "
              "prefill) or fast (bfloat16 where native, else float32)")
Dtype = Annotated[Optional[str], typer.Option("--dtype", help=DTYPE_HELP)]

STITCH_ADAPTER_HELP = ("stitch adapter: auto (the one kvstitch ships for this embedded model where it measured "
                       "better than none, else none; what run, demo and serve use by default), default (the "
                       "shipped one), a file from `kvstitch adapt`, or none (what eval, calibrate and bench use "
                       "by default, so a recorded command keeps measuring the same thing)")
StitchAdapterOpt = Annotated[Optional[str], typer.Option("--stitch-adapter", help=STITCH_ADAPTER_HELP)]

Threads = Annotated[Optional[int], typer.Option("--threads", help="torch CPU threads (default: torch's, one per core)")]

CollectionsDir = Annotated[Optional[Path], typer.Option(
    "--collections-dir", help="where collections live (default: STORE/collections or $KVSTITCH_CACHE/collections)")]

# ---- benchmarks ------------------------------------------------------------------------------------------
RESULTS_DIR = Path("docs/results")
ResultsDir = Annotated[Path, typer.Option("--out", help="output directory")]

# ---- decode policies -------------------------------------------------------------------------------------
DECODE_DEFAULT = "dense"
Decode = Annotated[str, typer.Option("--decode", help="decode policy, a spec: dense, or a sparse one such as prkv, "
                                                      "'prkv(static_ratio=0.5,kv_budget=512)'")]
ServeDecode = Annotated[str, typer.Option("--decode", help="default decode policy, a spec: dense, prkv, "
                                                           "'prkv(static_ratio=0.5)' (per-request: 'decode')")]
DecodeSweep = Annotated[str, typer.Option("--decode", help="comma-separated decode policy specs, each a sweep of its "
                                                           "own (dense; prkv, quest, 'prkv(static_ratio=0.5)')")]
KvBudget = Annotated[Optional[int], typer.Option("--kv-budget", help="sparse decode's kv_budget (default: the "
                                                                     "server's)")]
DecodePolicies = Annotated[str, typer.Option("--policies", "--decode", help="comma-separated sparse decode policy "
                                                                            "specs, e.g. 'prkv(static_ratio=0.5),quest' "
                                                                            "(dense always runs)")]
DecodeBudgets = Annotated[str, typer.Option("--budget", help="comma-separated KV budgets (tokens)")]
PageSize = Annotated[Optional[int], typer.Option("--page-size", help="decoder page size (default 32, PRKV Sec. 5.1)")]
PolicyOption = Annotated[Optional[list[str]], typer.Option(
    "--policy-option", "-o", help="a policy field, POLICY.FIELD=VALUE (repeatable), e.g. prkv.group_reduce=max")]
