"""`kvstitch adapt`: learn a stitch adapter by self-distillation from full prefill, on a CPU (the teacher, the
student and the loss: `kvstitch.adapt.distill`).

The passages' caches come from the store (each passage's forward runs once, ever), stitched as a request stitches
them; at a ratio > 0 the engine's method picks context tokens first, and they join the student's pass. Gradients
reach only the adapter: the cached K/V are constants and the base weights are frozen. An adapter with a writer
LoRA instead writes its passages' K/V in the student's graph (`written_chunks`), so it trains at ratio 0; kept
frozen (``freeze=("writer",)``, from ``--init``), its passages come from the store written through it, and the parts
beside it (link tokens, a reader LoRA) train over them at any ratio.

The run directory holds the adapter (``adapter.safetensors``), the checkpoint (``state.pt``: optimizer, step,
losses), the loss log and curve (``loss.jsonl``, ``loss.png``), the teacher's targets (``teacher/``) and the
passage store (``store/``). A stopped run resumes from its checkpoint to the same state; its settings must be
the same (``run.json``).
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from kvstitch.core.figures import save_png
from kvstitch.core.errors import InputError
from kvstitch.core.memory import resident_gib
from kvstitch.models.stitch_adapter import StitchAdapter
from .config import PARTS, AdaptConfig, part_size
from .data import Context
from .distill import cached_targets, questions_loss, written_chunks

ADAPTER_FILE, STATE_FILE, RUN_FILE, LOSS_FILE = "adapter.safetensors", "state.pt", "run.json", "loss.jsonl"
CARD_FILE = "adapter.json"  # what made the adapter, readable without torch (beside it, and in shipped adapters)


def adapter_card(path: Path) -> dict:
    """The adapter file's header as a card: form, model, the command and corpus that made it, steps, CPU-hours,
    parameters, bytes."""
    ad = StitchAdapter.load(path)
    return {"form": ad.config.form, "model": ad.model_name, "weights_id": ad.weights_id,
            "parameters": ad.n_parameters, "bytes": Path(path).stat().st_size,
            **{k: ad.info.get(k) for k in ("command", "corpus", "steps", "cpu_hours", "wall_hours", "final_loss",
                                           "config", "strength")}}


# ---- the run --------------------------------------------------------------------------------------------
@dataclass
class TrainState:
    step: int = 0
    seconds: float = 0.0  # wall time spent training (teacher included)
    cpu_seconds: float = 0.0  # wall time x threads
    losses: list[dict] = field(default_factory=list)


class Trainer:
    """One training run over ``contexts`` (train) and ``val`` (validation), in ``run_dir``."""

    def __init__(self, engine, cfg: AdaptConfig, contexts: list[Context], val: list[Context], run_dir: Path,
                 command: str = "", corpus_note: str = "", teacher_dir: Path | None = None,
                 init: StitchAdapter | None = None):
        if not contexts:
            raise InputError("no training contexts: the corpus gave no passages with questions")
        if (init is None) != (not cfg.init) or (init is not None and init.digest() != cfg.init):
            raise InputError("AdaptConfig.init must be the digest of the adapter passed as init")
        self.init = init
        self.engine, self.cfg, self.contexts, self.val = engine, cfg, contexts, val
        self.run_dir = Path(run_dir)
        self.teacher_dir = Path(teacher_dir) if teacher_dir is not None else self.run_dir / "teacher"
        self.command, self.corpus_note = command, corpus_note
        self.items = [(c, q) for c, ctx in enumerate(contexts) for q in range(len(ctx.questions))]
        self._order: tuple[int, list] | None = None
        self.adapter: StitchAdapter | None = None
        self.opt = None
        self.state = TrainState()
        self.schedule: list | None = None  # the reader LoRA's strength by ratio, once tuned (`kvstitch.adapt.strength`)

    # ---- setup / resume ----
    def _check_run(self) -> None:
        path = self.run_dir / RUN_FILE
        desc = {"config": self.cfg.identity(), "model": self.engine.weights_id}
        if path.exists():
            old = json.loads(path.read_text())
            if old.get("config") != desc["config"] or old.get("model") != desc["model"]:
                raise InputError(f"{self.run_dir} holds a run with other settings or another model; pass a new --out "
                                 f"or the same settings to resume it")
        else:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({**desc, "command": self.command, "corpus": self.corpus_note}, indent=1))

    def setup(self) -> None:
        if self.init is not None:
            self._check_init(self.init)  # before the run directory is written
        self._check_run()
        eng, cfg = self.engine, self.cfg
        for p in eng.model.parameters():
            p.requires_grad_(False)
        ckpt = self.run_dir / STATE_FILE
        if ckpt.exists():
            self.adapter = StitchAdapter.load(self.run_dir / ADAPTER_FILE)
        elif self.init is not None:
            eng.use_stitch_adapter(None)
            self.adapter = self._from_init(self.init)
        else:
            eng.use_stitch_adapter(None)
            self.adapter = StitchAdapter.for_model(eng.model, eng.weights_id, cfg.adapter, eng.model_name)
        self.adapter.info.pop("strength", None)  # training reads through it at full strength
        eng.use_stitch_adapter(self.adapter)
        self.opt = torch.optim.AdamW(self.trained_parameters(), lr=cfg.lr, weight_decay=0.0)
        if ckpt.exists():
            st = torch.load(ckpt, weights_only=False)
            self.opt.load_state_dict(st["optimizer"])
            self.state = TrainState(**st["state"])

    def trained_parameters(self) -> list[torch.nn.Parameter]:
        """The adapter's parameters this run trains (the frozen parts' stop taking gradients)."""
        frozen = tuple(pre for part in self.cfg.freeze for pre in PARTS[part])
        out = []
        for name, p in self.adapter.named_parameters():
            p.requires_grad_(not name.startswith(frozen))
            if p.requires_grad:
                out.append(p)
        return out

    def _check_init(self, init: StitchAdapter) -> None:
        """Refuse an adapter to start from that does not fit this model and these settings."""
        from kvstitch.models.stitch_adapter import StitchAdapterError

        try:
            init.check_model(self.engine.weights_id, self.engine.model_name)
        except StitchAdapterError as e:
            raise InputError(f"--init: {e}") from None
        want, have = self.cfg.adapter, init.config
        # the run's form holds the given one's (each part absent or equal, the projections the same or more): the
        # parts it adds start fresh, a new LoRA as the identity (B = 0), so training starts from what it computes
        if have.alpha != want.alpha or not set(have.targets) <= set(want.targets) \
                or any(getattr(have, n) not in (0, getattr(want, n)) for n in ("links", "rank", "writer")):
            raise InputError(f"--init holds a {have.form} adapter (alpha {have.alpha:g}) on {','.join(have.targets)}; "
                             f"this run trains {want.form} (alpha {want.alpha:g}) on {','.join(want.targets)}: pass "
                             f"the same form or one with more parts, on the same projections or more")
        missing = [p for p in self.cfg.freeze if not part_size(have, p)
                   or (p != "links" and set(have.targets) != set(want.targets))]
        if missing:
            raise InputError(f"--freeze {','.join(missing)} keeps --init's {' and '.join(missing)} as trained, but "
                             f"the {have.form} adapter given lacks it (or adapts other projections)")

    def _from_init(self, init: StitchAdapter) -> StitchAdapter:
        """This run's adapter, starting from ``init``'s weights (`_check_init`)."""
        want = self.cfg.adapter
        ad = StitchAdapter.for_model(self.engine.model, self.engine.weights_id, want, self.engine.model_name)
        own = ad.state_dict()
        given = {k: v.float() for k, v in init.state_dict().items() if v.numel() and k in own}
        assert all(own[k].shape == v.shape for k, v in given.items())
        ad.load_state_dict({**own, **given})
        return ad

    def lr_at(self, step: int) -> float:
        """Linear warm-up, then linear decay to a tenth."""
        cfg = self.cfg
        if step < cfg.warmup:
            return cfg.lr * (step + 1) / cfg.warmup
        frac = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
        return cfg.lr * (1 - 0.9 * min(1.0, frac))

    def batch_items(self, step: int) -> list[tuple[int, int]]:
        """The questions of optimizer step ``step``: a pure function of (seed, step), so a resumed run sees the
        same ones. Each epoch visits the contexts in a seeded order, a context's questions together (its
        teacher and its stitched cache serve them all)."""
        n = len(self.items)
        out = []
        for i in range(step * self.cfg.batch, (step + 1) * self.cfg.batch):
            epoch, k = divmod(i, n)
            out.append(self._epoch(epoch)[k])
        return out

    def _epoch(self, epoch: int) -> list[tuple[int, int]]:
        if self._order is None or self._order[0] != epoch:
            ctxs = list(range(len(self.contexts)))
            random.Random(f"{self.cfg.seed}:{epoch}").shuffle(ctxs)
            self._order = (epoch, [(c, q) for c in ctxs for q in range(len(self.contexts[c].questions))])
        return self._order[1]

    # ---- one step ----
    def _linked(self, layout, strength: float):
        """``layout`` with the adapter's link tokens (none when it is off)."""
        if self.adapter.n_links and strength > 0 and not layout.links:
            return layout.with_links(self.adapter.link_ids(self.engine.vocab_size))
        return layout

    def _stitched(self, ctx: Context, layout, strength: float = 1.0):
        from kvstitch.engine.stitch import stitch

        eng = self.engine
        kvs = written_chunks(eng, layout) if self.cfg.trains_writer else eng.chunk_kvs(layout)  # store: its writer's
        return stitch(eng, self._linked(layout, strength), kvs, extra=self.cfg.max_answer, adapted=strength)

    def _recompute(self, layout, ratio: float) -> tuple[torch.Tensor | None, object]:
        """At a ratio > 0: the engine's method picks the tokens (its own prefill, no gradients); the layout
        it used (a method may reorder the passages)."""
        if ratio <= 0:
            return None, layout
        pre = self.engine.prefill(layout, self.cfg.method, ratio, max_new_tokens=1)
        return pre.indices.cpu(), pre.layout.without_links()

    def loss_of(self, items: list[tuple[int, int]], contexts: list[Context], ratio: float, grad: bool,
                strength: float = 1.0, agree: list | None = None) -> float:
        """The mean loss of ``items`` (backpropagated when ``grad``) read through the adapter at ``strength`` (0:
        without it), one pass a question: packing a context's questions as rows of one pass measured no faster on
        a CPU (SmolLM2, 8 questions: 42 s vs 31 s), since each row needs its own copy of the stitched context. A
        writer's graph runs through its context's passages: one backward of that context's questions together."""
        eng, cfg = self.engine, self.cfg
        total, current, pending = 0.0, None, []
        extra = {"answer_ce": cfg.answer_ce, "answer_margin": cfg.answer_margin} if grad else {}  # validation: KL
        for c, q in items:
            ctx = contexts[c]
            targets = cached_targets(eng, self.teacher_dir, ctx, cfg)
            layout = eng.layout(ctx.questions[q], list(ctx.passages))
            recompute, used = self._recompute(layout, ratio)
            if current is None or current[0] != (c, tuple(used.order)):
                _backward(pending)
                with torch.set_grad_enabled(grad and self.cfg.trains_writer):
                    current = ((c, tuple(used.order)), self._stitched(ctx, used, strength))
            with torch.set_grad_enabled(grad):
                loss = questions_loss(eng, current[1], self._linked(used, strength), [targets[q]],
                                      cfg.question_weight, recompute, strength, agree=agree, **extra)
                if grad:
                    pending.append(loss / len(items))
                    if not self.cfg.trains_writer:
                        _backward(pending)
            total += float(loss.detach()) / len(items)
        _backward(pending)
        return total

    def val_items(self) -> list[tuple[int, int]]:
        return [(c, q) for c, ctx in enumerate(self.val) for q in range(len(ctx.questions))][:self.cfg.val_questions]

    def validate(self) -> dict:
        """Validation KL at no recompute, and how often the student's argmax is full prefill's answer token (teacher
        forced; `val_first`: its first token, which mostly decides the answer): the KL weighs near ties little, and
        a near tie lost is an answer lost."""
        items = self.val_items()
        if not items:
            return {"val": None}
        agree: list[list[bool]] = []
        val = self.loss_of(items, self.val, 0.0, grad=False, agree=agree)
        tokens = [a for row in agree for a in row]
        return {"val": val, "val_agree": round(sum(tokens) / max(len(tokens), 1), 4),
                "val_first": round(sum(row[0] for row in agree if row) / len(agree), 4)}

    def step(self) -> float:
        st, cfg = self.state, self.cfg
        for g in self.opt.param_groups:
            g["lr"] = self.lr_at(st.step)
        self.opt.zero_grad(set_to_none=True)
        ratio = cfg.ratios[st.step % len(cfg.ratios)]
        loss = self.loss_of(self.batch_items(st.step), self.contexts, ratio, grad=True)
        torch.nn.utils.clip_grad_norm_([p for p in self.adapter.parameters() if p.requires_grad], 1.0)
        self.opt.step()
        st.step += 1
        return loss

    # ---- checkpoints ----
    def save(self) -> None:
        """Adapter, then the checkpoint that names its step (each through a temporary file and a rename)."""
        self.adapter.info = self.info()
        self.adapter.save(self.run_dir / ADAPTER_FILE)
        (self.run_dir / CARD_FILE).write_text(json.dumps(adapter_card(self.run_dir / ADAPTER_FILE), indent=1) + "\n")
        tmp = self.run_dir / (STATE_FILE + ".tmp")
        torch.save({"optimizer": self.opt.state_dict(), "state": asdict(self.state)}, tmp)
        tmp.replace(self.run_dir / STATE_FILE)
        self.write_losses()
        self.plot()

    def info(self) -> dict:
        st = self.state
        return {"command": self.command, "corpus": self.corpus_note, "steps": st.step,
                "config": self.cfg.identity(), "cpu_hours": round(st.cpu_seconds / 3600, 3),
                "wall_hours": round(st.seconds / 3600, 3), "parameters": self.adapter.n_parameters,
                "final_loss": st.losses[-1]["loss"] if st.losses else None,
                **({"strength": self.schedule} if self.schedule else {})}

    def log(self, row: dict) -> None:
        self.state.losses.append(row)

    def write_losses(self) -> None:
        """``loss.jsonl`` as of the checkpoint (rewritten whole: a resumed run repeats no row)."""
        tmp = self.run_dir / (LOSS_FILE + ".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in self.state.losses), encoding="utf-8")
        tmp.replace(self.run_dir / LOSS_FILE)

    def plot(self) -> None:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:  # the `plots` extra: the curve is in loss.jsonl either way
            return
        rows = self.state.losses
        if not rows:
            return
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], lw=0.8, label="train (batch)")
        val = [r for r in rows if r.get("val") is not None]
        if val:
            ax.plot([r["step"] for r in val], [r["val"] for r in val], "o-", label="validation")
        ax.set_xlabel("step")
        ax.set_ylabel("KL(full prefill || stitched)")
        ax.set_title(f"stitch adapter {self.cfg.adapter.form}, {self.engine.model_name}")
        ax.legend()
        fig.tight_layout()
        save_png(fig, self.run_dir / "loss.png", dpi=110)
        plt.close(fig)

    # ---- the loop ----
    def run(self, progress: bool = True) -> dict:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.setup()
        st, cfg = self.state, self.cfg
        threads = torch.get_num_threads()
        cols = [TextColumn("adapt"), BarColumn(), MofNCompleteColumn(), TextColumn("loss {task.fields[loss]}"),
                TextColumn("val {task.fields[val]}"), TimeRemainingColumn()]
        with Progress(*cols, disable=not progress) as bar:
            last = next((r for r in reversed(st.losses) if r.get("val") is not None), None)
            task = bar.add_task("adapt", total=cfg.steps, completed=st.step, loss="-",
                                val=f"{last['val']:.4f}" if last else "-")
            if st.step == 0 and not st.losses:
                t0 = time.perf_counter()
                val = self.validate()
                self._account(time.perf_counter() - t0, threads)
                self.log({"step": 0, "loss": val["val"] if val["val"] is not None else math.nan, **val, "s": 0.0})
            while st.step < cfg.steps:
                t0 = time.perf_counter()
                loss = self.step()
                row = {"step": st.step, "loss": loss, "lr": self.lr_at(st.step - 1)}
                if st.step % cfg.eval_every == 0 or st.step == cfg.steps:
                    row.update(self.validate())
                    bar.update(task, val=f"{row['val']:.4f}" if row["val"] is not None else "-")
                self._account(time.perf_counter() - t0, threads)
                row["s"] = round(st.seconds, 1)
                row["rss_gib"] = resident_gib()  # training memory grows with passages per context: watch it here
                self.log(row)
                bar.update(task, advance=1, loss=f"{loss:.4f}")
                if st.step % cfg.save_every == 0 or st.step == cfg.steps:
                    self.save()
        self.save()
        return self.info()

    def _account(self, dt: float, threads: int) -> None:
        self.state.seconds += dt
        self.state.cpu_seconds += dt * threads


def _backward(losses: list[torch.Tensor]) -> None:
    """Backpropagate the sum of ``losses`` (if any) and forget them."""
    if losses:
        torch.stack(losses).sum().backward()
        losses.clear()
