"""`kvstitch adapt`: learn a stitch adapter by self-distillation from full prefill, on a CPU.

For each context (passages + questions, `kvstitch.adapt.data`):

- **teacher** (once, kept on disk): full prefill of the passages, then per question the suffix (question, end
  of turn, assistant header) and the teacher's own greedy answer. What is kept is the teacher's top-k
  log-probabilities at every position that predicts a question or answer token (`Targets`).
- **student**: the passages' caches from the store (each passage's forward runs once, ever), stitched as a
  request stitches them, then one forward with gradients of the adapter's link tokens + the question + the
  teacher's answer (teacher-forced) over the stitched cache, out of place. At a ratio > 0 the engine's method
  picks context tokens first, and they join the pass. Gradients reach only the adapter: the cached K/V are
  constants and the base weights are frozen.
- **loss**: KL(teacher || student) over the top-k tokens plus the tail's mass, per position; answer positions
  weigh 1, question positions ``question_weight``.

The run directory holds the adapter (``adapter.safetensors``), the checkpoint (``state.pt``: optimizer, step,
losses), the loss log and curve (``loss.jsonl``, ``loss.png``), the teacher's targets (``teacher/``) and the
passage store (``store/``). A stopped run resumes from its checkpoint to the same state; its settings must be
the same (``run.json``).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from kvstitch.core.attention import ForwardPlan
from kvstitch.core.cache import StitchCache
from kvstitch.core.errors import InputError
from kvstitch.models import cache_kwargs
from kvstitch.models.stitch_adapter import StitchAdapter, StitchAdapterConfig, gate_of, gated
from .data import Context

ADAPTER_FILE, STATE_FILE, RUN_FILE, LOSS_FILE = "adapter.safetensors", "state.pt", "run.json", "loss.jsonl"
CARD_FILE = "adapter.json"  # what made the adapter, readable without torch (beside it, and in shipped adapters)


def adapter_card(path: Path) -> dict:
    """The adapter file's header as a card: form, model, the command and corpus that made it, steps, CPU-hours,
    parameters, bytes."""
    ad = StitchAdapter.load(path)
    return {"form": ad.config.form, "model": ad.model_name, "weights_id": ad.weights_id,
            "parameters": ad.n_parameters, "bytes": Path(path).stat().st_size,
            **{k: ad.info.get(k) for k in ("command", "corpus", "steps", "cpu_hours", "wall_hours", "final_loss",
                                           "config")}}


@dataclass(frozen=True)
class AdaptConfig:
    """The settings of a training run (they must match to resume it)."""

    links: int = 8
    rank: int = 8
    alpha: float = 16.0
    steps: int = 200
    batch: int = 8  # questions per optimizer step
    lr: float = 5e-4
    warmup: int = 10
    passages: int = 10  # passages per context
    per_context: int = 16  # questions per context
    ratios: tuple[float, ...] = (0.0,)  # recompute ratios the student is trained at (cycled)
    method: str = "deltaprop(base=infoflow)"  # picks the recomputed tokens at a ratio > 0
    top_k: int = 64
    question_weight: float = 0.5
    max_answer: int = 16
    seed: int = 0
    corpus: str = "squad"  # "squad" (built-in) or a folder of the user's documents
    val_questions: int = 16
    eval_every: int = 25
    save_every: int = 10

    def __post_init__(self):
        for name in ("steps", "batch", "passages", "per_context", "top_k", "max_answer", "save_every", "eval_every"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InputError(f"adapt {name} must be a positive integer, got {v!r}")
        if not self.lr > 0:
            raise InputError(f"adapt lr must be > 0, got {self.lr}")
        for r in self.ratios:
            if not 0 <= r < 1:
                raise InputError(f"adapt ratios must be in [0, 1), got {r}")
        StitchAdapterConfig(self.links, self.rank, self.alpha)  # its own checks

    @property
    def adapter(self) -> StitchAdapterConfig:
        return StitchAdapterConfig(self.links, self.rank, self.alpha)


@dataclass
class Targets:
    """The teacher's view of one question over one context."""

    suffix: torch.Tensor  # [n_s] ids: question, end of turn, assistant header
    answer: torch.Tensor  # [n_a] the teacher's greedy answer (EOS included when it stopped)
    top_ids: torch.Tensor  # [n_s + n_a - 1, k] int32: the teacher's top-k next tokens at every position
    top_logp: torch.Tensor  # [n_s + n_a - 1, k] float32: their log-probabilities


# ---- teacher --------------------------------------------------------------------------------------------
@torch.no_grad()
def teacher_targets(engine, ctx: Context, max_answer: int, top_k: int) -> list[Targets]:
    """Full prefill of ``ctx``'s passages once, then every question over a copy of its cache, and the greedy
    answers of all questions decoded together (one batched step per token)."""
    from kvstitch.engine.batch import DecodeStep

    layouts = [engine.layout(q, list(ctx.passages)) for q in ctx.questions]
    n_ctx = layouts[0].context_end
    cache = StitchCache.empty(engine.adapter, n_ctx, engine.device, engine.dtype)
    engine.forward(cache, layouts[0].ids[:n_ctx], torch.arange(n_ctx))
    keys, values = cache.stacked_keys(), cache.stacked_values()
    caches, rows, answers = [], [], []
    for lay in layouts:
        c = StitchCache.from_stacked(keys, values, capacity=n_ctx + lay.n_suffix + max_answer)
        n_s = lay.n_suffix
        rows.append([engine.forward(c, lay.suffix_ids, torch.arange(n_ctx, n_ctx + n_s), logits_to_keep=n_s)])
        answers.append([int(rows[-1][0][-1].argmax())])
        caches.append(c)

    def done(ans: list[int]) -> bool:  # the first line is the answer (what evaluation scores)
        return engine.finished(ans) or "\n" in engine.answer_text(ans[-1:], strip=False) or len(ans) >= max_answer

    live = [i for i, a in enumerate(answers) if not done(a)]
    while live:
        logits = engine.decode_batch([DecodeStep(caches[i], answers[i][-1]) for i in live])
        for i, lg in zip(live, logits):
            rows[i].append(lg)
            answers[i].append(int(lg[-1].argmax()))
        live = [i for i in live if not done(answers[i])]
    out = []
    for lay, r, answer in zip(layouts, rows, answers):
        logp = torch.log_softmax(torch.cat(r).float(), -1)
        top = logp.topk(top_k, dim=-1)
        out.append(Targets(lay.suffix_ids.clone(), torch.tensor(answer), top.indices.to(torch.int32).cpu(),
                           top.values.cpu()))
    return out


def cached_targets(engine, folder: Path, ctx: Context, cfg: AdaptConfig) -> list[Targets]:
    """`teacher_targets`, computed once per context and kept in ``folder`` (runs of one model may share it)."""
    key = hashlib.sha256(json.dumps([ctx.key, ctx.passages, ctx.questions, cfg.max_answer, cfg.top_k,
                                     engine.fingerprint]).encode()).hexdigest()[:24]
    path = Path(folder) / f"{key}.pt"
    if path.exists():
        return [Targets(**t) for t in torch.load(path, weights_only=True)]
    got = teacher_targets(engine, ctx, cfg.max_answer, cfg.top_k)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # runs may share a teacher folder
    torch.save([asdict(t) for t in got], tmp)
    tmp.replace(path)
    return got


# ---- student --------------------------------------------------------------------------------------------
def sparse_kl(student_logits: torch.Tensor, top_ids: torch.Tensor, top_logp: torch.Tensor) -> torch.Tensor:
    """Per position KL(teacher || student) over the teacher's top-k tokens plus one bucket for the rest."""
    logq = torch.log_softmax(student_logits.float(), -1)
    q_top = logq.gather(-1, top_ids.long())
    p_top = top_logp.exp()
    p_rest = (1 - p_top.sum(-1)).clamp_min(1e-8)
    q_rest = (1 - q_top.exp().sum(-1)).clamp_min(1e-8)
    return (p_top * (top_logp - q_top)).sum(-1) + p_rest * (p_rest.log() - q_rest.log())


def student_logits(engine, cache: StitchCache, layout, tails: list[torch.Tensor],
                   recompute: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Logits, with gradients to the adapter, at every position of each question's ``tail`` (its suffix and its
    answer but the last token), one row per question: one pass of the recomputed context tokens (``recompute``:
    context indices), the link tokens (``layout``'s) and the tail over ``cache`` (the questions' shared context),
    out of place. Rows are right-padded: a token never sees the padding after it."""
    n_ctx, links = layout.context_end, layout.suffix_ids[:layout.links]
    rows = [torch.cat([links, t]) for t in tails]
    width = max(r.numel() for r in rows)
    ids = torch.full((len(rows), width), int(rows[0][-1]), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :r.numel()] = r
    slots = torch.arange(n_ctx, n_ctx + width)
    if recompute is not None and recompute.numel():
        ctx_slots = recompute.sort().values + layout.context_start
        slots = torch.cat([ctx_slots, slots])
        ids = torch.cat([layout.ids[ctx_slots].expand(len(rows), -1), ids], dim=1)
    if len(rows) > 1:  # one copy of the stitched context per question (read only: the pass is out of place)
        cache = StitchCache.from_stacked(cache.stacked_keys(0, n_ctx), cache.stacked_values(0, n_ctx),
                                         capacity=n_ctx + width, batch=len(rows))
    keep = width - layout.links  # the link tokens predict nothing
    slots = slots.to(engine.device)
    with cache.mode(slots=slots, write=False), gated(gate_of(slots >= n_ctx)):  # not recomputed passage tokens
        out = engine.model(input_ids=ids.to(engine.device), position_ids=slots.view(1, -1).expand(len(rows), -1),
                           **cache_kwargs(engine.model, cache), use_cache=True, logits_to_keep=keep,
                           kvstitch_plan=ForwardPlan(q_slots=slots))
    return [out.logits[i, :r.numel() - layout.links] for i, r in enumerate(rows)]


def questions_loss(engine, cache: StitchCache, layout, targets: list[Targets], question_weight: float,
                   recompute: torch.Tensor | None = None) -> torch.Tensor:
    """The mean over ``targets`` (questions over one context) of each one's weighted KL, in one pass."""
    tails = [torch.cat([t.suffix, t.answer[:-1]]) for t in targets]
    losses = []
    for logits, t in zip(student_logits(engine, cache, layout, tails, recompute), targets):
        kl = sparse_kl(logits, t.top_ids.to(logits.device), t.top_logp.to(logits.device))
        w = torch.ones_like(kl)
        w[:t.suffix.numel() - 1] = question_weight  # positions that predict the question's own next token
        losses.append((kl * w).sum() / w.sum())
    return torch.stack(losses).mean()


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
                 command: str = "", corpus_note: str = "", teacher_dir: Path | None = None):
        if not contexts:
            raise InputError("no training contexts: the corpus gave no passages with questions")
        self.engine, self.cfg, self.contexts, self.val = engine, cfg, contexts, val
        self.run_dir = Path(run_dir)
        self.teacher_dir = Path(teacher_dir) if teacher_dir is not None else self.run_dir / "teacher"
        self.command, self.corpus_note = command, corpus_note
        self.items = [(c, q) for c, ctx in enumerate(contexts) for q in range(len(ctx.questions))]
        self._order: tuple[int, list] | None = None
        self.adapter: StitchAdapter | None = None
        self.opt = None
        self.state = TrainState()

    # ---- setup / resume ----
    def _check_run(self) -> None:
        path = self.run_dir / RUN_FILE
        desc = {"config": asdict(self.cfg), "model": self.engine.weights_id}
        if path.exists():
            old = json.loads(path.read_text())
            if old.get("config") != json.loads(json.dumps(desc["config"])) or old.get("model") != desc["model"]:
                raise InputError(f"{self.run_dir} holds a run with other settings or another model; pass a new --out "
                                 f"or the same settings to resume it")
        else:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({**desc, "command": self.command, "corpus": self.corpus_note}, indent=1))

    def setup(self) -> None:
        self._check_run()
        eng, cfg = self.engine, self.cfg
        for p in eng.model.parameters():
            p.requires_grad_(False)
        ckpt = self.run_dir / STATE_FILE
        if ckpt.exists():
            self.adapter = StitchAdapter.load(self.run_dir / ADAPTER_FILE)
        else:
            eng.use_stitch_adapter(None)
            self.adapter = StitchAdapter.for_model(eng.model, eng.weights_id, cfg.adapter, eng.model_name)
        eng.use_stitch_adapter(self.adapter)
        self.opt = torch.optim.AdamW(self.adapter.parameters(), lr=cfg.lr, weight_decay=0.0)
        if ckpt.exists():
            st = torch.load(ckpt, weights_only=False)
            self.opt.load_state_dict(st["optimizer"])
            self.state = TrainState(**st["state"])

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
    def _stitched(self, ctx: Context, layout):
        eng = self.engine
        kvs = eng.chunk_kvs(layout)
        from kvstitch.engine.stitch import stitch, with_adapter

        linked, _ = with_adapter(eng, layout, 0.0)
        return stitch(eng, linked, kvs, extra=self.cfg.max_answer, adapted=True), linked

    def _recompute(self, layout, ratio: float) -> tuple[torch.Tensor | None, object]:
        """At a ratio > 0: the engine's method picks the tokens (its own prefill, no gradients); the layout
        it used (a method may reorder the passages)."""
        if ratio <= 0:
            return None, layout
        pre = self.engine.prefill(layout, self.cfg.method, ratio, max_new_tokens=1)
        return pre.indices.cpu(), pre.layout.without_links()

    def loss_of(self, items: list[tuple[int, int]], contexts: list[Context], ratio: float, grad: bool) -> float:
        """The mean loss of ``items`` (backpropagated when ``grad``), one pass a question: packing a context's
        questions as rows of one pass measured no faster on a CPU (SmolLM2, 8 questions: 42 s vs 31 s), since each
        row needs its own copy of the stitched context."""
        eng, cfg = self.engine, self.cfg
        total, current = 0.0, None
        for c, q in items:
            ctx = contexts[c]
            targets = cached_targets(eng, self.teacher_dir, ctx, cfg)
            layout = eng.layout(ctx.questions[q], list(ctx.passages))
            recompute, used = self._recompute(layout, ratio)
            if current is None or current[0] != (c, tuple(used.order)):
                current = ((c, tuple(used.order)), self._stitched(ctx, used)[0])
            linked = used.with_links(self.adapter.link_ids(eng.vocab_size)) if self.adapter.n_links else used
            with torch.set_grad_enabled(grad):
                loss = questions_loss(eng, current[1], linked, [targets[q]], cfg.question_weight, recompute)
                if grad:
                    (loss / len(items)).backward()
            total += float(loss.detach()) / len(items)
        return total

    def validate(self) -> float | None:
        items = [(c, q) for c, ctx in enumerate(self.val) for q in range(len(ctx.questions))][:self.cfg.val_questions]
        if not items:
            return None
        return self.loss_of(items, self.val, 0.0, grad=False)

    def step(self) -> float:
        st, cfg = self.state, self.cfg
        for g in self.opt.param_groups:
            g["lr"] = self.lr_at(st.step)
        self.opt.zero_grad(set_to_none=True)
        ratio = cfg.ratios[st.step % len(cfg.ratios)]
        loss = self.loss_of(self.batch_items(st.step), self.contexts, ratio, grad=True)
        torch.nn.utils.clip_grad_norm_(self.adapter.parameters(), 1.0)
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
                "config": json.loads(json.dumps(asdict(self.cfg))), "cpu_hours": round(st.cpu_seconds / 3600, 3),
                "wall_hours": round(st.seconds / 3600, 3), "parameters": self.adapter.n_parameters,
                "final_loss": st.losses[-1]["loss"] if st.losses else None}

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
        fig.savefig(self.run_dir / "loss.png", dpi=110)
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
                self.log({"step": 0, "loss": val if val is not None else math.nan, "val": val, "s": 0.0})
            while st.step < cfg.steps:
                t0 = time.perf_counter()
                loss = self.step()
                row = {"step": st.step, "loss": loss, "lr": self.lr_at(st.step - 1)}
                if st.step % cfg.eval_every == 0 or st.step == cfg.steps:
                    row["val"] = self.validate()
                    bar.update(task, val=f"{row['val']:.4f}" if row["val"] is not None else "-")
                self._account(time.perf_counter() - t0, threads)
                row["s"] = round(st.seconds, 1)
                self.log(row)
                bar.update(task, advance=1, loss=f"{loss:.4f}")
                if st.step % cfg.save_every == 0 or st.step == cfg.steps:
                    self.save()
        self.save()
        return self.info()

    def _account(self, dt: float, threads: int) -> None:
        self.state.seconds += dt
        self.state.cpu_seconds += dt * threads
