"""`kvstitch adapt`: train a stitch adapter for a model (`kvstitch.adapt`)."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Optional

import typer

from kvstitch.core.errors import InputError
from .common import console, csv_list, load_engine, set_threads
from .options import Dtype, Model, Threads


def adapt_command(
        out: Path = typer.Option(..., "--out", help="run directory: adapter, checkpoint, loss curve (resumes if it "
                                                    "holds a run with the same settings)"),
        corpus: str = typer.Option("squad", help="squad (the built-in training articles of SQuAD dev v1.1, split "
                                                 "by article) or a folder of your documents (.txt/.md; the model "
                                                 "writes a question about each sampled passage)"),
        links: int = typer.Option(8, help="link tokens between the passages and the question (0: none)"),
        rank: int = typer.Option(8, help="reader LoRA rank (0: none)"),
        alpha: float = typer.Option(16.0, help="LoRA alpha (scale = alpha / rank)"),
        writer: int = typer.Option(0, help="writer LoRA rank, applied when passages are precomputed (0: none; its "
                                           "caches get their own store key; trains at ratio 0)"),
        targets: str = typer.Option("attention", help="the projections the LoRAs adapt: attention (q, k, v, o), "
                                    "all (those and the MLP's gate, up, down) or a comma-separated list of them"),
        steps: int = typer.Option(200, help="optimizer steps (0: only validate the starting adapter)"),
        batch: int = typer.Option(8, help="questions per step"),
        lr: float = typer.Option(5e-4, help="peak learning rate (AdamW; warm-up, then linear decay to a tenth)"),
        passages: int = typer.Option(10, help="passages per training context"),
        questions: int = typer.Option(16, "--questions-per-context", help="questions asked over each context"),
        groupings: int = typer.Option(1, help="with --corpus squad: shuffles of each article into contexts (seeds "
                                              "SEED, SEED+1, ...); more long contexts from the same articles"),
        ratios: str = typer.Option("0", help="recompute ratios the student trains at, comma-separated, cycled"),
        method: str = typer.Option("deltaprop(base=infoflow)", help="picks the recomputed tokens at a ratio > 0"),
        question_weight: float = typer.Option(0.5, help="weight of question positions in the loss (answers: 1)"),
        answer_ce: float = typer.Option(0.0, "--answer-ce", help="weight of the cross-entropy of full prefill's "
                                        "answer tokens, added to the KL (validation stays the KL)"),
        answer_margin: float = typer.Option(0.0, "--answer-margin", help="weight of a hinge on those tokens' "
                                            "margins over the next best (up to full prefill's own), added likewise"),
        seed: int = typer.Option(0, help="data order and passage grouping"),
        init: Optional[str] = typer.Option(None, "--init", help="start from this adapter's weights: a file, or "
                                           "'default' (the one kvstitch ships for the model); its parts and "
                                           "projections or fewer (the rest start fresh)"),
        freeze: str = typer.Option("", "--freeze", help="parts of the --init adapter kept as they are, comma-"
                                   "separated: writer, links, reader (--freeze writer: its passages come from the "
                                   "store, and the link tokens and reader LoRA beside it train at any --ratios)"),
        model: Model = None, dtype: Dtype = None, threads: Threads = None,
        store: Optional[str] = typer.Option(None, "--store", help="passage cache store (default: OUT/store)"),
        teacher_dir: Optional[Path] = typer.Option(None, "--teacher-dir", help="the teacher's targets (default: "
                                                   "OUT/teacher); runs of one model on one corpus may share it"),
        strengths: str = typer.Option("0,0.25,0.5,0.75,1", help="after training, the reader LoRA strengths tried at "
                                      "each --tune-ratios ratio on the validation questions; the best is kept in the "
                                      "adapter (0: off there; '' skips the sweep, full strength everywhere)"),
        tune_ratios: str = typer.Option("0,0.1,0.2", "--tune-ratios", help="recompute ratios the strength is "
                                        "tuned at (between them it is interpolated)"),
        tune_on: str = typer.Option("validation", "--tune-on", help="where the strength is tuned: validation (the "
                                    "validation contexts) or tuning (with --corpus squad: the first "
                                    "--tune-questions held-out questions of SQuAD's tuning split, each over the "
                                    "--passages the evaluation gives it; never reported)"),
        tune_questions: int = typer.Option(32, "--tune-questions", help="questions of the tuning split (--tune-on "
                                           "tuning)")) -> None:
    """Learn a stitch adapter for MODEL by distillation from full prefill: the model's own full-prefill answers
    are the teacher, the stitched cache read through the adapter the student. Runs on a CPU, checkpoints as it
    goes and resumes when rerun with the same command."""
    from kvstitch.adapt import AdaptConfig, Trainer, tuning_contexts

    set_threads(threads)
    ratio_list, strength_list, tune_list = (_numbers(v, flag) for v, flag in
                                            ((ratios, "--ratios"), (strengths, "--strengths"),
                                             (tune_ratios, "--tune-ratios")))
    if tune_on not in ("validation", "tuning"):
        raise InputError(f"--tune-on takes validation or tuning, got {tune_on!r}")
    if groupings != 1 and corpus != "squad":
        raise InputError("--groupings needs --corpus squad: a folder's validation passages would be trained on")
    if tune_on == "tuning" and corpus != "squad":
        raise InputError("--tune-on tuning needs --corpus squad (it tunes on SQuAD's tuning split)")
    if strength_list:
        from kvstitch.adapt.strength import check_sweep

        check_sweep(tune_list, strength_list)  # before hours of training, not after
    start = _start_from(init, model)
    cfg = AdaptConfig(links=links, rank=rank, alpha=alpha, writer=writer, targets=_lora_targets(targets), steps=steps,
                      batch=batch, lr=lr, passages=passages, per_context=questions, groupings=groupings,
                      ratios=ratio_list or (0.0,), method=method, question_weight=question_weight, answer_ce=answer_ce,
                      answer_margin=answer_margin, seed=seed, corpus=corpus,
                      init=start.digest() if start is not None else "", freeze=tuple(csv_list(freeze)))
    docs = None
    if corpus != "squad":
        docs = Path(corpus).expanduser()
        if not docs.is_dir():
            raise InputError(f"--corpus must be 'squad' or a folder of documents; {corpus!r} is neither")
    if method and any(r > 0 for r in cfg.ratios):
        from kvstitch.select import check_method

        check_method(method)
    eng = load_engine(model, store or str(out / "store"), dtype)
    train, val, note = _contexts(eng, docs, cfg)
    command = " ".join(["kvstitch"] + [shlex.quote(a) for a in sys.argv[1:]])
    trainer = Trainer(eng, cfg, train, val, out, command=command, corpus_note=note, teacher_dir=teacher_dir, init=start)
    info = trainer.run()
    if strength_list and (cfg.links or cfg.rank):  # (a writer alone reads nothing through a strength)
        from kvstitch.adapt.strength import tune_strength

        tuning = tuning_contexts(passages, tune_questions) if tune_on == "tuning" else None
        tuned = tune_strength(trainer, tune_list, strength_list, contexts=tuning, on=tune_on)
        trainer.save()
        console.print("reader LoRA strength by ratio ({} KL, n = {}): {}".format(
            tune_on, tuned["questions"], ", ".join(f"{r:g}: {s:g}" for r, s in tuned["schedule"])), highlight=False)
    size = (out / "adapter.safetensors").stat().st_size
    console.print(f"stitch adapter {cfg.adapter.form}: {info['parameters']:,} parameters, {size / 1e6:.2f} MB, "
                  f"{info['steps']} steps, {info['cpu_hours']:.2f} CPU-hours; loss {info['final_loss']:.4f}; "
                  f"{out / 'adapter.safetensors'} (use it: --stitch-adapter {out / 'adapter.safetensors'})",
                  highlight=False)


def _contexts(eng, docs: Path | None, cfg) -> tuple[list, list, str]:
    """Training and validation contexts, from the built-in corpus (``docs`` None) or a folder, and a note of which."""
    from kvstitch.adapt import document_contexts, squad_contexts

    if docs is None:
        train = squad_contexts(cfg.passages, cfg.per_context, cfg.seed, groupings=cfg.groupings)
        val = squad_contexts(cfg.passages, cfg.per_context, cfg.seed, validation=True)
        return train, val, ("SQuAD dev v1.1, the adapter articles (kvstitch.tasks.squad.ADAPTER_ARTICLES), their "
                            "questions")
    from kvstitch.engine.precompute import directory_chunks

    chunks, _ = directory_chunks(eng, docs)
    texts = [t for _, t in chunks]
    contexts = document_contexts(eng, texts, cfg.passages, cfg.per_context, cfg.seed)
    n_val = max(1, len(contexts) // 10) if len(contexts) > 1 else 0
    return contexts[n_val:], contexts[:n_val], f"{docs}: {len(texts)} passages, questions written by the model"


def _lora_targets(spec: str) -> tuple[str, ...]:
    """``--targets``: a name for a group, or projections (in the order adapters keep them)."""
    from kvstitch.models.stitch_adapter import ATTENTION_TARGETS, LORA_TARGETS

    names = {"attention": ATTENTION_TARGETS, "all": LORA_TARGETS}.get(spec.strip()) or csv_list(spec)
    bad = [t for t in names if t not in LORA_TARGETS]
    if bad or not names:
        raise InputError(f"--targets takes attention, all or projections among {', '.join(LORA_TARGETS)}; "
                         f"got {spec!r}")
    return tuple(t for t in LORA_TARGETS if t in names)


def _start_from(init: str | None, model: str | None):
    """The adapter ``--init`` names (None: a fresh start)."""
    if init is None:
        return None
    from kvstitch.models.stitch_adapter import StitchAdapterError, resolve_adapter

    try:
        start = resolve_adapter(init, model)
    except StitchAdapterError as e:
        raise InputError(f"--init: {e}") from None
    if start is None:
        raise InputError("--init takes an adapter file or 'default'; to start fresh, leave it out")
    return start


def _numbers(value: str, flag: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in csv_list(value))
    except ValueError:
        raise InputError(f"{flag} takes comma-separated numbers, got {value!r}") from None
