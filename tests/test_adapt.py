"""`kvstitch adapt`: the distillation loss, a run that resumes to the same state, and training data kept apart
from every report split and evaluation set."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from typer.testing import CliRunner

from kvstitch.adapt import AdaptConfig, Context, Trainer, squad_contexts
from kvstitch.adapt.distill import sparse_kl
from kvstitch.adapt.train import STATE_FILE
from kvstitch.cli import app
from kvstitch.core.errors import InputError
from kvstitch.eval.config import EvalConfig
from kvstitch.eval.runner import heldout_samples
from kvstitch.models.stitch_adapter import StitchAdapter
from kvstitch.tasks.datasets import load_dataset
from kvstitch.tasks.squad import read_squad

from .conftest import SAMPLE_CHUNKS
from .test_stitch_adapter import fresh_engine


def test_sparse_kl_is_zero_for_the_teacher_itself_and_positive_otherwise():
    torch.manual_seed(0)
    teacher = torch.randn(5, 50)
    logp = torch.log_softmax(teacher, -1)
    top = logp.topk(8, dim=-1)
    same = sparse_kl(teacher, top.indices.int(), top.values)
    assert same.abs().max() < 1e-5
    other = sparse_kl(torch.randn(5, 50), top.indices.int(), top.values)
    assert (other > 1e-3).all()


CONTEXTS = [Context("a", tuple(SAMPLE_CHUNKS[:2]), ("Where is Alice's house?", "Where does Bob live?")),
            Context("b", tuple(SAMPLE_CHUNKS[2:]),
                    ("What is Carol's number?", "What opened near the central park last week, and what does it sell?"))]


def _cfg(**kw) -> AdaptConfig:
    return AdaptConfig(**{"links": 2, "rank": 2, "steps": 4, "batch": 2, "max_answer": 3, "top_k": 8,
                          "save_every": 2, "eval_every": 2, "val_questions": 2, "lr": 1e-2, "warmup": 1, **kw})


def test_training_lowers_the_loss_and_resumes_to_the_same_state(tmp_path, smollm_tokenizer, monkeypatch):
    straight = Trainer(fresh_engine(smollm_tokenizer), _cfg(), CONTEXTS, CONTEXTS[:1], tmp_path / "a")
    info = straight.run(progress=False)
    assert info["steps"] == 4 and info["parameters"] == straight.adapter.n_parameters
    losses = [json.loads(line) for line in (tmp_path / "a" / "loss.jsonl").read_text().splitlines()]
    assert [r["step"] for r in losses] == [0, 1, 2, 3, 4]
    if sys.platform == "linux":  # each step's row says the process's memory then (a tiny model: under 8 GiB)
        assert all(0.05 < r["rss_gib"] < 8 for r in losses[1:])
    assert (tmp_path / "a" / "loss.png").exists()

    # a run stopped after its step-2 checkpoint, then rerun: the same adapter, bit for bit
    eng = fresh_engine(smollm_tokenizer)
    stopped = Trainer(eng, _cfg(), CONTEXTS, CONTEXTS[:1], tmp_path / "b")
    real_step = Trainer.step

    def step_then_stop(self):
        if self.state.step == 3:
            raise KeyboardInterrupt
        return real_step(self)

    monkeypatch.setattr(Trainer, "step", step_then_stop)
    with pytest.raises(KeyboardInterrupt):
        stopped.run(progress=False)
    assert torch.load(tmp_path / "b" / STATE_FILE, weights_only=False)["state"]["step"] == 2
    monkeypatch.setattr(Trainer, "step", real_step)
    eng.use_stitch_adapter(None)
    resumed = Trainer(fresh_engine(smollm_tokenizer), _cfg(), CONTEXTS, CONTEXTS[:1], tmp_path / "b")
    resumed.run(progress=False)
    a, b = StitchAdapter.load(tmp_path / "a" / "adapter.safetensors"), StitchAdapter.load(tmp_path / "b" / "adapter.safetensors")
    for k, v in a.state_dict().items():
        assert torch.equal(v, b.state_dict()[k]), k
    assert [r["step"] for r in resumed.state.losses] == [0, 1, 2, 3, 4]


def _backward_first_batch(tokenizer, run_dir, **cfg):
    """A fresh run's first batch, its loss backpropagated (learning rate 1e-3): (trainer, batch, loss)."""
    tr = Trainer(fresh_engine(tokenizer), _cfg(lr=1e-3, **cfg), CONTEXTS, [], run_dir)
    tr.setup()
    items = tr.batch_items(0)
    for g in tr.opt.param_groups:
        g["lr"] = 1e-3
    tr.opt.zero_grad()
    return tr, items, tr.loss_of(items, CONTEXTS, 0.0, grad=True)


def test_a_step_lowers_the_loss_of_its_batch(tmp_path, smollm_tokenizer):
    """The gradient reaches the adapter and points downhill: one small step lowers its own batch's loss."""
    tr, items, before = _backward_first_batch(smollm_tokenizer, tmp_path)
    grads = [p.grad for p in tr.adapter.parameters()]
    assert all(g is not None for g in grads) and sum(float(g.abs().sum()) for g in grads) > 0
    tr.opt.step()
    assert tr.loss_of(items, CONTEXTS, 0.0, grad=False) < before


def test_the_questions_of_a_context_in_one_pass_are_each_one_alone(tmp_path, smollm_tokenizer):
    """Right-padded rows over copies of one stitched context: the loss of each question as its own pass."""
    from kvstitch.adapt.distill import cached_targets, questions_loss

    tr = Trainer(fresh_engine(smollm_tokenizer), _cfg(), CONTEXTS, [], tmp_path)
    tr.setup()
    ctx = CONTEXTS[1]
    targets = cached_targets(tr.engine, tr.teacher_dir, ctx, tr.cfg)
    layout = tr.engine.layout(ctx.questions[0], list(ctx.passages))
    cache, linked = tr._stitched(ctx, layout), tr._linked(layout, 1.0)
    assert targets[0].suffix.numel() + targets[0].answer.numel() != targets[1].suffix.numel() + targets[1].answer.numel()
    with torch.no_grad():
        both = questions_loss(tr.engine, cache, linked, targets, 0.5)
        alone = [questions_loss(tr.engine, cache, linked, [t], 0.5) for t in targets]
    assert abs(float(both) - float(torch.stack(alone).mean())) < 1e-5 * max(1.0, float(both))


def test_the_strength_sweep_keeps_the_lowest_validation_kl_and_resumes(tmp_path, smollm_tokenizer, monkeypatch):
    """Each ratio gets the strength of lowest validation KL; strength 0 is the plain stitched cache; a stopped
    sweep resumes without redoing a cell; the adapter file carries the schedule and the engine follows it."""
    from kvstitch.adapt.strength import STRENGTH_FILE, tune_strength

    tr = Trainer(fresh_engine(smollm_tokenizer), _cfg(steps=2), CONTEXTS, CONTEXTS, tmp_path)
    tr.run(progress=False)
    calls = []
    real = Trainer.loss_of

    def counted(self, items, contexts, ratio, grad, strength=1.0):
        calls.append((ratio, strength))
        if len(calls) == 3 and not hasattr(counted, "stopped"):
            counted.stopped = True
            raise KeyboardInterrupt
        return real(self, items, contexts, ratio, grad, strength)

    monkeypatch.setattr(Trainer, "loss_of", counted)
    with pytest.raises(KeyboardInterrupt):
        tune_strength(tr, (0.0, 0.3), (0.0, 1.0), progress=False)
    out = tune_strength(tr, (0.0, 0.3), (0.0, 1.0), progress=False)
    assert calls == [(0.0, 0.0), (0.0, 1.0), (0.3, 0.0), (0.3, 0.0), (0.3, 1.0)]  # the first two kept
    kl = out["kl"]
    for r, s in out["schedule"]:
        assert kl[str(r)][str(s)] == min(kl[str(r)].values())
    # strength 0: the stitched cache without the adapter, whose KL is the plain one
    monkeypatch.setattr(Trainer, "loss_of", real)
    tr.engine.use_stitch_adapter(None)
    plain = real(tr, tr.val_items(), tr.val, 0.0, False, 0.0)
    assert abs(plain - kl["0.0"]["0.0"]) < 1e-6
    tr.engine.use_stitch_adapter(tr.adapter)
    tr.save()
    saved = StitchAdapter.load(tmp_path / "adapter.safetensors")
    assert saved.schedule == [tuple(p) for p in out["schedule"]] and (tmp_path / STRENGTH_FILE).exists()
    # on other questions (the tuning split's): every cell measured again, over those questions
    calls.clear()
    monkeypatch.setattr(Trainer, "loss_of", counted)
    other = tune_strength(tr, (0.0, 0.3), (0.0, 1.0), progress=False, contexts=CONTEXTS[:1], on="tuning")
    assert len(calls) == 4 and other["on"] == "tuning" and other["questions"] == len(CONTEXTS[0].questions)


def _answer_ce(logits, t, n_s):
    logq = torch.log_softmax(logits.float(), -1)[n_s:]
    return float(-logq.gather(-1, t.answer.view(-1, 1)).mean())


def _answer_margin(logits, t, n_s):
    from kvstitch.adapt.distill import margin_hinge

    return float(margin_hinge(logits[n_s:], t.answer, t.top_logp[n_s:]).mean())


@pytest.mark.parametrize("name,weight,item,term", [("answer_ce", 2.0, (0, 0), _answer_ce),
                                                   ("answer_margin", 3.0, (1, 1), _answer_margin)])
def test_an_answer_term_adds_to_the_kl_in_training_only(tmp_path, smollm_tokenizer, name, weight, item, term):
    """--answer-ce / --answer-margin: the loss is the KL plus the weight x the term over the teacher's answer tokens
    (the cross-entropy, or the mean `margin_hinge`; computed here from the student's logits); validation (no
    gradients) stays the KL; the setting is recorded only when set."""
    from kvstitch.adapt.distill import cached_targets, questions_loss, student_logits

    tr = Trainer(fresh_engine(smollm_tokenizer), _cfg(**{name: weight}), CONTEXTS, [], tmp_path)
    tr.setup()
    ctx = CONTEXTS[item[0]]
    t = cached_targets(tr.engine, tr.teacher_dir, ctx, tr.cfg)[item[1]]
    layout = tr.engine.layout(ctx.questions[item[1]], list(ctx.passages))
    cache, linked = tr._stitched(ctx, layout), tr._linked(layout, 1.0)
    with torch.no_grad():
        kl = float(questions_loss(tr.engine, cache, linked, [t], 0.5))
        both = float(questions_loss(tr.engine, cache, linked, [t], 0.5, **{name: weight}))
        logits = student_logits(tr.engine, cache, linked, [torch.cat([t.suffix, t.answer[:-1]])])[0]
    extra = term(logits, t, t.suffix.numel() - 1)
    assert extra > 0.01 and abs(both - (kl + weight * extra)) < 1e-4 * max(1.0, both)
    assert abs(tr.loss_of([item], CONTEXTS, 0.0, grad=False) - kl) < 1e-4 * max(1.0, kl)
    assert abs(tr.loss_of([item], CONTEXTS, 0.0, grad=True) - both) < 1e-4 * max(1.0, both)
    assert name not in _cfg().identity() and _cfg(**{name: weight}).identity()[name] == weight
    with pytest.raises(InputError, match=f"{name} must be >= 0"):
        _cfg(**{name: -1.0})


def test_validation_counts_the_answer_tokens_the_student_gets_as_full_prefill_does(tmp_path, smollm_tokenizer):
    """Beside the KL, validation reports how often the stitched student's argmax is full prefill's answer token
    (teacher forced), over all answer tokens and over each answer's first, as recounted here from its logits."""
    from kvstitch.adapt.distill import cached_targets, student_logits

    tr = Trainer(fresh_engine(smollm_tokenizer), _cfg(max_answer=4), CONTEXTS, CONTEXTS, tmp_path)
    tr.setup()
    got = tr.validate()
    hits = []
    for c, q in tr.val_items():
        ctx = CONTEXTS[c]
        t = cached_targets(tr.engine, tr.teacher_dir, ctx, tr.cfg)[q]
        layout = tr.engine.layout(ctx.questions[q], list(ctx.passages))
        with torch.no_grad():
            logits = student_logits(tr.engine, tr._stitched(ctx, layout), tr._linked(layout, 1.0),
                                    [torch.cat([t.suffix, t.answer[:-1]])])[0]
        hits.append((logits[t.suffix.numel() - 1:].argmax(-1) == t.answer).tolist())
    tokens = [h for row in hits for h in row]
    assert len(tokens) > len(hits)  # answers of more than one token: the two counts differ in what they weigh
    assert got["val_agree"] == round(sum(tokens) / len(tokens), 4)
    assert got["val_first"] == round(sum(row[0] for row in hits) / len(hits), 4)
    assert got["val"] == pytest.approx(tr.loss_of(tr.val_items(), CONTEXTS, 0.0, grad=False), rel=1e-5)
    assert Trainer(tr.engine, _cfg(), CONTEXTS, [], tmp_path / "none").validate() == {"val": None}


def test_the_margin_hinge_asks_the_teachers_margin_up_to_its_cap():
    """`margin_hinge`: 0 where the student prefers the teacher's token by the teacher's margin (or by the cap, when
    the teacher's is larger); else the shortfall, measured against the student's best other token."""
    from kvstitch.adapt.distill import MARGIN_CAP, margin_hinge

    answer = torch.tensor([2, 2, 0])
    teacher = torch.log_softmax(torch.tensor([[0.0, 0.0, 0.5, -1.0], [0.0, 0.0, 9.0, 0.0], [3.0, 2.9, 0.0, 0.0]]), -1)
    student = torch.tensor([[0.0, 0.0, 2.0, 0.0],  # teacher's token ahead by 2 > its margin 0.5: nothing to pay
                            [0.0, 1.5, 2.0, 0.0],  # ahead by 0.5 < the cap (the teacher's 9 is capped)
                            [1.0, 3.0, 0.0, 0.0]])  # wrong argmax: behind by 2, and the teacher wanted 0.1
    top = teacher.topk(2, dim=-1).values
    got = margin_hinge(student, answer, top)
    assert got[0] == 0
    assert abs(float(got[1]) - (MARGIN_CAP - 0.5)) < 1e-5 and abs(float(got[2]) - (0.1 + 2.0)) < 1e-5


def test_a_writer_adapter_trains_through_its_passages(tmp_path, smollm_tokenizer):
    """The writer's gradient comes through the passages' K/V (nothing else reads it), and a step lowers the loss."""
    tr, items, before = _backward_first_batch(smollm_tokenizer, tmp_path, links=0, rank=0, writer=2)
    # B starts at zero, so B gets the first gradient (the last layer's queries and output write no K/V: none)
    grads = [p.grad for p in tr.adapter.writer_b.values() if p.grad is not None]
    assert len(grads) > len(tr.adapter.writer_b) // 2 and sum(float(g.abs().sum()) for g in grads) > 0
    tr.opt.step()
    assert tr.loss_of(items, CONTEXTS, 0.0, grad=False) < before
    with pytest.raises(Exception, match="trains at ratio 0"):
        _cfg(writer=2, ratios=(0.0, 0.1))


def test_a_run_directory_with_other_settings_is_refused(tmp_path, smollm_tokenizer):

    Trainer(fresh_engine(smollm_tokenizer), _cfg(steps=1), CONTEXTS, [], tmp_path).run(progress=False)
    with pytest.raises(InputError, match="other settings"):
        Trainer(fresh_engine(smollm_tokenizer), _cfg(steps=1, rank=3), CONTEXTS, [], tmp_path).run(progress=False)


def test_training_data_is_disjoint_from_every_report_split_and_evaluation_set():
    train = squad_contexts(10, 1000, groupings=2) + squad_contexts(40, 1000, groupings=3)
    train += squad_contexts(10, 1000, validation=True)
    passages = {p for c in train for p in c.passages}
    questions = {q.split("\n")[0] for c in train for q in c.questions}
    assert len(passages) > 300 and len(questions) > 1500
    cfg = EvalConfig(tasks=[], lengths=[], methods=[], ratios=[], dataset="squad", heldout=True)
    v1 = heldout_samples(cfg, load_dataset("squad", 0, 400, passages=40))
    v2 = heldout_samples(EvalConfig(tasks=[], lengths=[], methods=[], ratios=[], dataset="squad2", heldout=True),
                         load_dataset("squad2", 0, 250, passages=40))
    assert 330 < len(v1) < 400 and len(v2) == 250  # v2.0 holds none of the training articles
    for s in v1 + v2:
        assert not passages & set(s.chunks)
        assert s.meta["raw_question"] not in questions
    musique = load_dataset("musique", 0, None)
    assert not passages & {c for s in musique for c in s.chunks}
    # the rule: a question is dropped exactly when its article is a training article
    squad = read_squad("squad")
    dropped = {q.qid for q in squad.questions[:400] if not squad.heldout(q)}
    assert {s.meta["qid"] for s in load_dataset("squad", 0, 400)} - {s.meta["qid"] for s in v1} == dropped


def test_the_strength_is_tuned_on_held_out_tuning_questions_as_the_eval_asks_them():
    """--tune-on tuning: SQuAD tuning-split questions of held-out articles only, each over the passages the eval
    gives it, none of them a training passage or a report question."""
    from kvstitch.adapt import tuning_contexts

    tuning = tuning_contexts(10, 1000)
    cfg = EvalConfig(tasks=[], lengths=[], methods=[], ratios=[], dataset="squad", heldout=True)
    as_eval = {s.meta["raw_question"]: s for s in heldout_samples(cfg, load_dataset("squad", 0, 100, passages=10))}
    assert len(tuning) == len(as_eval) > 50
    train = {p for c in squad_contexts(10, 1000) + squad_contexts(10, 1000, validation=True) for p in c.passages}
    report = {s.meta["qid"] for s in load_dataset("squad", 100, None, passages=10)}
    for c in tuning:
        (q,) = c.questions
        s = as_eval[q.split("\n")[0]]
        assert list(c.passages) == s.chunks and q == s.question and c.key == f"squad-tuning:{s.meta['qid']}"
        assert not train & set(c.passages) and s.meta["qid"] not in report
    assert len(tuning_contexts(10, 5)) == 5


def test_training_and_validation_contexts_do_not_share_an_article():
    train, val = squad_contexts(10, 4), squad_contexts(10, 4, validation=True)
    assert train and val
    assert not {c.key.split(":")[1] for c in train} & {c.key.split(":")[1] for c in val}


def test_more_groupings_add_new_contexts_of_the_same_training_articles():
    one, three = squad_contexts(40, 16), squad_contexts(40, 16, groupings=3)
    assert len(three) == 3 * len(one) > 0 and three[:len(one)] == one
    groups = [frozenset(c.passages) for c in three]
    assert len(set(groups)) == len(groups)  # each shuffle cuts other groups
    articles = {c.key.split(":")[1] for c in one}
    assert {c.key.split(":")[1] for c in three} == articles
    assert squad_contexts(40, 16, validation=True, groupings=3) == squad_contexts(40, 16, validation=True)
    assert "groupings" not in AdaptConfig().identity() and AdaptConfig(groupings=2).identity()["groupings"] == 2
    with pytest.raises(InputError, match="groupings"):
        squad_contexts(40, 16, groupings=0)
    with pytest.raises(InputError, match="groupings"):
        AdaptConfig(groupings=0)


def test_cli_errors_are_one_line(tmp_path):
    runner = CliRunner()
    res = runner.invoke(app, ["adapt", "--out", str(tmp_path / "r"), "--corpus", str(tmp_path / "nowhere")])
    assert res.exit_code == 2 and "--corpus must be 'squad' or a folder" in res.output
    res = runner.invoke(app, ["adapt", "--out", str(tmp_path / "r"), "--ratios", "0,1.5"])
    assert res.exit_code == 2 and "ratios must be in [0, 1)" in res.output
    res = runner.invoke(app, ["adapt", "--out", str(tmp_path / "r"), "--strengths", "0,2"])
    assert res.exit_code == 2 and "strengths lie in [0, 1]" in res.output
    res = runner.invoke(app, ["adapt", "--out", str(tmp_path / "r"), "--tune-on", "report"])
    assert res.exit_code == 2 and "--tune-on takes validation or tuning" in res.output
    res = runner.invoke(app, ["adapt", "--out", str(tmp_path / "r"), "--tune-ratios", "x"])
    assert res.exit_code == 2 and "--tune-ratios takes comma-separated numbers" in res.output
    res = runner.invoke(app, ["adapt", "--out", str(tmp_path / "r"), "--corpus", str(tmp_path), "--groupings", "2"])
    assert res.exit_code == 2 and "--groupings needs --corpus squad" in res.output
    res = runner.invoke(app, ["adapt", "--out", str(tmp_path / "r"), "--targets", "q_proj,lm_head"])
    assert res.exit_code == 2 and "--targets takes attention, all or projections among" in res.output
    res = runner.invoke(app, ["adapt", "--out", str(tmp_path / "r"), "--writer", "8", "--freeze", "writer"])
    assert res.exit_code == 2 and "adapt freeze keeps parts of the adapter training starts from: pass --init" in res.output
    bad = tmp_path / "bad.safetensors"
    bad.write_text("nope")
    res = runner.invoke(app, ["ask", "Who?", "--chunk", str(bad), "--stitch-adapter", str(bad)])
    assert res.exit_code == 2 and "not a readable stitch adapter" in res.output
    res = runner.invoke(app, ["adapt", "--out", str(tmp_path / "r"), "--init", str(bad)])
    assert res.exit_code == 2 and "--init:" in res.output and "not a readable stitch adapter" in res.output


def test_an_adapter_run_has_its_own_protocol_and_old_logs_stay_valid():
    plain = EvalConfig(tasks=[], lengths=[], methods=[], ratios=[], dataset="squad")
    assert "stitch_adapter" not in plain.protocol() and "heldout" not in plain.protocol()
    adapted = EvalConfig(tasks=[], lengths=[], methods=[], ratios=[], dataset="squad", heldout=True,
                         stitch_adapter={"form": "links=8", "sha256": "ab"})
    p = adapted.protocol()
    assert p["stitch_adapter"] == {"form": "links=8", "sha256": "ab"} and p["heldout"] is True
    with pytest.raises(Exception, match="--heldout"):
        heldout_samples(EvalConfig(tasks=[], lengths=[], methods=[], ratios=[], dataset="musique", heldout=True), [])


def test_a_run_can_start_from_another_adapter_of_the_same_form(tmp_path, smollm_tokenizer):
    """``--init``: the run starts from the given weights (not a fresh adapter), records their digest, and refuses
    an adapter of another form."""

    Trainer(fresh_engine(smollm_tokenizer), _cfg(steps=2), CONTEXTS, [], tmp_path / "a").run(progress=False)
    start = StitchAdapter.load(tmp_path / "a" / "adapter.safetensors")
    tr = Trainer(fresh_engine(smollm_tokenizer), _cfg(steps=2, init=start.digest()), CONTEXTS, [], tmp_path / "b",
                 init=start)
    tr.setup()
    assert tr.adapter.digest() == start.digest() and tr.adapter is not start
    assert any(float(v.abs().sum()) > 0 for k, v in tr.adapter.state_dict().items() if k.startswith("lora_b"))
    assert json.loads((tmp_path / "b" / "run.json").read_text())["config"]["init"] == start.digest()
    tr.run(progress=False)
    assert tr.adapter.digest() != start.digest()
    with pytest.raises(InputError, match="digest"):
        Trainer(fresh_engine(smollm_tokenizer), _cfg(steps=2), CONTEXTS, [], tmp_path / "c", init=start)
    with pytest.raises(InputError, match="same form"):
        Trainer(fresh_engine(smollm_tokenizer), _cfg(steps=2, rank=3, init=start.digest()), CONTEXTS, [],
                tmp_path / "d", init=start).setup()


def test_a_run_of_zero_steps_validates_its_starting_adapter_and_keeps_it(tmp_path, smollm_tokenizer):
    """``--steps 0 --init A``: one validation row for A (what a trained run's step-0 row would be), and A written back
    unchanged, so adapters trained elsewhere are measured on the same validation questions."""
    Trainer(fresh_engine(smollm_tokenizer), _cfg(steps=2), CONTEXTS, [], tmp_path / "a").run(progress=False)
    start = StitchAdapter.load(tmp_path / "a" / "adapter.safetensors")
    tr = Trainer(fresh_engine(smollm_tokenizer), _cfg(steps=0, init=start.digest()), CONTEXTS, CONTEXTS[:1],
                 tmp_path / "v", init=start)
    info = tr.run(progress=False)
    rows = [json.loads(line) for line in (tmp_path / "v" / "loss.jsonl").read_text().splitlines()]
    assert info["steps"] == 0 and [r["step"] for r in rows] == [0] and rows[0]["val"] > 0
    assert {"val_agree", "val_first"} <= set(rows[0])
    assert StitchAdapter.load(tmp_path / "v" / "adapter.safetensors").digest() == start.digest()
    with pytest.raises(InputError, match="steps must be an integer >= 0"):
        _cfg(steps=-1)


def test_a_run_with_more_parts_or_projections_starts_from_an_adapter_with_fewer(tmp_path, smollm_tokenizer):
    """``--targets all --init`` of an attention-only writer: its weights carried over and the MLP's LoRA at the
    identity, so the start reads as the given adapter does. Link tokens and a reader added beside the writer start
    fresh (the reader at the identity). A start with parts or projections the run lacks is refused."""
    from kvstitch.models.stitch_adapter import LORA_TARGETS

    Trainer(fresh_engine(smollm_tokenizer), _cfg(steps=1, links=0, rank=0, writer=2), CONTEXTS, [],
            tmp_path / "a").run(progress=False)
    start = StitchAdapter.load(tmp_path / "a" / "adapter.safetensors")
    items = [(0, 0), (1, 1)]
    same = Trainer(fresh_engine(smollm_tokenizer), _cfg(links=0, rank=0, writer=2, init=start.digest()), CONTEXTS,
                   [], tmp_path / "b", init=start)
    same.setup()
    wide = Trainer(fresh_engine(smollm_tokenizer), _cfg(links=0, rank=0, writer=2, targets=LORA_TARGETS,
                                                        init=start.digest()), CONTEXTS, [], tmp_path / "c", init=start)
    wide.setup()
    assert len(wide.adapter.writer_b) > len(start.writer_b)
    for k, v in wide.adapter.state_dict().items():
        if k in start.state_dict():
            assert torch.equal(v, start.state_dict()[k].float()), k
        elif k.startswith("writer_b"):
            assert not v.any(), k
    assert json.loads((tmp_path / "c" / "run.json").read_text())["config"]["targets"] == list(LORA_TARGETS)
    assert "targets" not in json.loads((tmp_path / "b" / "run.json").read_text())["config"]
    assert wide.loss_of(items, CONTEXTS, 0.0, grad=False) == pytest.approx(same.loss_of(items, CONTEXTS, 0.0,
                                                                                        grad=False), abs=1e-6)
    beside = Trainer(fresh_engine(smollm_tokenizer), _cfg(links=2, rank=2, writer=2, init=start.digest()), CONTEXTS,
                     [], tmp_path / "e", init=start)
    beside.setup()
    got = beside.adapter.state_dict()
    assert all(torch.equal(got[k], v.float()) for k, v in start.state_dict().items() if k.startswith("writer_"))
    assert not any(v.any() for k, v in got.items() if k.startswith("lora_b")) and got["links"].abs().sum() > 0
    wide.save()
    beside.save()
    for path in (tmp_path / "c" / "adapter.safetensors", tmp_path / "e" / "adapter.safetensors"):
        back = StitchAdapter.load(path)
        with pytest.raises(InputError, match="same form or one with more parts, on the same projections or more"):
            Trainer(fresh_engine(smollm_tokenizer), _cfg(links=0, rank=0, writer=2, init=back.digest()), CONTEXTS,
                    [], tmp_path / "d", init=back).setup()
    assert not (tmp_path / "d").exists()  # refused before the run directory is written


def test_a_frozen_writer_keeps_its_weights_and_the_parts_beside_it_train_over_its_stored_passages(
        tmp_path, smollm_tokenizer, monkeypatch):
    """``--freeze writer --init W``: W's writer stays bit for bit, its passages come from the store (written through
    it, as precompute writes them: never in the student's graph), and link tokens and a reader LoRA beside it train,
    at ratios > 0 too. A resumed run reaches the same adapter."""
    from kvstitch.adapt import distill, train

    Trainer(fresh_engine(smollm_tokenizer), _cfg(steps=1, links=0, rank=0, writer=2), CONTEXTS, [],
            tmp_path / "w").run(progress=False)
    start = StitchAdapter.load(tmp_path / "w" / "adapter.safetensors")
    assert any(v.any() for k, v in start.state_dict().items() if k.startswith("writer_b"))

    def no_graph(*a, **k):
        raise AssertionError("a frozen writer's passages are read from the store")

    monkeypatch.setattr(train, "written_chunks", no_graph)
    cfg = _cfg(steps=2, links=2, rank=2, writer=2, init=start.digest(), freeze=("writer",), ratios=(0.0, 0.1))
    tr = Trainer(fresh_engine(smollm_tokenizer), cfg, CONTEXTS, CONTEXTS[:1], tmp_path / "r", init=start)
    tr.run(progress=False)
    got = tr.adapter.state_dict()
    writer = [k for k in start.state_dict() if k.startswith("writer_")]
    assert writer and all(torch.equal(got[k], start.state_dict()[k].float()) for k in writer)
    assert any(v.any() for k, v in got.items() if k.startswith("lora_b"))  # the reader left the identity
    assert json.loads((tmp_path / "r" / "run.json").read_text())["config"]["freeze"] == ["writer"]
    # the store's passages are the writer's: what the student's graph would have written
    monkeypatch.undo()
    layout = tr.engine.layout(CONTEXTS[0].questions[0], list(CONTEXTS[0].passages))
    with torch.no_grad():
        written = distill.written_chunks(tr.engine, layout)
    for a, b in zip(tr.engine.chunk_kvs(layout), written):
        n = a.n_tokens
        assert torch.allclose(a.keys, b.keys[..., :n, :], atol=1e-4) and torch.allclose(a.values, b.values[..., :n, :], atol=1e-4)
    tr.engine.use_stitch_adapter(None)
    plain = tr.engine.chunk_kvs(layout)[0]
    assert not torch.allclose(plain.values, written[0].values[..., :plain.n_tokens, :], atol=1e-4)

    resumed = Trainer(fresh_engine(smollm_tokenizer), cfg, CONTEXTS, CONTEXTS[:1], tmp_path / "r", init=start)
    resumed.setup()
    assert resumed.adapter.digest() == tr.adapter.digest()
    assert not any(p.requires_grad for n, p in resumed.adapter.named_parameters() if n.startswith("writer_"))

    for kw, match in ((dict(freeze=("writer",), writer=2), "pass --init"),
                      (dict(freeze=("lora",), init="x"), "takes parts among"),
                      (dict(freeze=("writer",), init="x"), "has no writer"),
                      (dict(freeze=("writer", "links", "reader"), writer=2, init="x"), "nothing to train"),
                      (dict(writer=2, ratios=(0.0, 0.1)), "--freeze writer trains the parts beside it")):
        with pytest.raises(InputError, match=match):
            _cfg(**kw)
    reader_only = StitchAdapter.load(tmp_path / "r" / "adapter.safetensors")
    with pytest.raises(InputError, match="lacks it"):
        Trainer(fresh_engine(smollm_tokenizer), _cfg(links=2, rank=2, writer=2, init=start.digest(),
                                                     freeze=("reader",)), CONTEXTS, [], tmp_path / "x",
                init=start).setup()
    assert reader_only.config.writer == 2


def test_a_checkpointed_writer_pass_gives_one_passs_values_and_gradients(tmp_path, smollm_tokenizer):
    """Training writes passages a group at a time, each group recomputed in the backward: the same K/V and the
    same gradients as one pass over all passages that keeps its activations."""
    from kvstitch.adapt.distill import _written, written_chunks

    tr = Trainer(fresh_engine(smollm_tokenizer), _cfg(links=0, rank=0, writer=2), CONTEXTS, [], tmp_path)
    tr.setup()
    torch.manual_seed(0)
    with torch.no_grad():
        for b in tr.adapter.writer_b.values():
            b.normal_(0, 0.05)  # B starts at zero: A would get no gradient
    eng = tr.engine
    layout = eng.layout(CONTEXTS[0].questions[0], list(CONTEXTS[0].passages) + list(CONTEXTS[1].passages))
    pk, pv = eng.prefix_kv(layout.prefix_ids)

    def grads(kvs):
        loss = sum((c.keys.float() ** 2).mean() + (c.values.float() ** 2).mean() for c in kvs)
        params = list(tr.adapter.parameters())
        for q in params:
            q.grad = None
        loss.backward()
        return [kv for c in kvs for kv in (c.keys.detach(), c.values.detach())], \
            [q.grad.clone() if q.grad is not None else torch.zeros_like(q) for q in params]

    grouped_kv, grouped = grads(written_chunks(eng, layout, group=1))
    one_kv, one = grads(_written(eng, layout.chunk_ids, pk, pv, layout.prefix_ids.numel()))
    assert len(grouped_kv) == 2 * len(layout.chunk_ids)
    for a, b in zip(grouped_kv, one_kv):
        assert (a - b).abs().max() < 1e-4
    assert sum(float(g.abs().sum()) for g in one) > 0
    for a, b in zip(grouped, one):
        assert torch.allclose(a, b, rtol=1e-3, atol=1e-6)
