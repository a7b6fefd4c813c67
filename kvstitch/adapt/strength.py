"""The reader LoRA's strength by recompute ratio, measured after training (`StitchAdapter.strength_at`).

An adapter trained where nobody recomputed corrects a stitched cache fully; once a method has recomputed part of
the context, the same correction overshoots (SmolLM2's pilot: it halves naive reuse's KL to full prefill, yet at
20% recompute its KL is above no adapter's). So after training, each ratio in ``ratios`` gets the strength in
``strengths`` whose KL is lowest on questions never reported (the validation article's, or the tuning split's
held-out ones: `kvstitch.adapt.data.tuning_contexts`); 0 means
the adapter stays off there. The table of every (ratio, strength) cell is kept in ``strength.json`` and filled
cell by cell, so a stopped sweep resumes where it stopped.
"""

from __future__ import annotations

import json

from kvstitch.core.errors import InputError

STRENGTH_FILE = "strength.json"


def _key(trainer, ratios, strengths, n: int, on: str) -> dict:
    ad = trainer.adapter
    saved = ad.info.pop("strength", None)
    try:
        digest = ad.digest()
    finally:
        if saved is not None:
            ad.info["strength"] = saved
    key = {"adapter": digest, "ratios": list(ratios), "strengths": list(strengths), "questions": n}
    return key if on == "validation" else {**key, "on": on}  # a validation key names no source: its files stay valid


def check_sweep(ratios, strengths) -> None:
    if not ratios or not strengths:
        raise InputError("tuning the adapter's strength needs at least one ratio and one strength")
    if any(not 0 <= s <= 1 for s in strengths) or any(not 0 <= r < 1 for r in ratios):
        raise InputError(f"strengths lie in [0, 1] and ratios in [0, 1); got strengths {list(strengths)}, "
                         f"ratios {list(ratios)}")


def tune_strength(trainer, ratios: tuple[float, ...], strengths: tuple[float, ...], progress: bool = True,
                  contexts=None, on: str = "validation") -> dict:
    """Sweep ``strengths`` at each of ``ratios`` over ``trainer``'s validation questions (or every question of
    ``contexts``, named ``on``); set and return the schedule (``{"schedule": [[ratio, strength], ...], "kl": {ratio:
    {strength: KL}}, "questions": n, "on": ...}``)."""
    from rich.progress import Progress

    check_sweep(ratios, strengths)
    if contexts is None:
        contexts, items = trainer.val, trainer.val_items()
    else:
        items = [(c, q) for c, ctx in enumerate(contexts) for q in range(len(ctx.questions))]
    if not items:
        raise InputError("no questions to tune the adapter's strength on")
    ratios, strengths = tuple(sorted(set(ratios))), tuple(sorted(set(strengths)))
    path = trainer.run_dir / STRENGTH_FILE
    key = _key(trainer, ratios, strengths, len(items), on)
    done = json.loads(path.read_text()) if path.exists() else {}
    kl = done.get("kl", {}) if done.get("key") == key else {}
    ad = trainer.adapter
    cells = [(r, s) for r in ratios for s in strengths if str(s) not in kl.get(str(r), {})]
    with Progress(disable=not progress) as bar:
        if cells:  # the teacher's targets first (a full prefill per context, kept on disk): minutes of their own
            from .distill import cached_targets

            need = sorted({c for c, _ in items})
            teach = bar.add_task("teacher targets", total=len(need))
            for c in need:
                cached_targets(trainer.engine, trainer.teacher_dir, contexts[c], trainer.cfg)
                bar.advance(teach)
        task = bar.add_task("strength", total=len(ratios) * len(strengths),
                            completed=len(ratios) * len(strengths) - len(cells))
        for r, s in cells:
            ad.info["strength"] = [[0.0, s]]  # the method's own selection pass reads through it as the student does
            kl.setdefault(str(r), {})[str(s)] = trainer.loss_of(items, contexts, r, grad=False, strength=s)
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(json.dumps({"key": key, "kl": kl}, indent=1))
            tmp.replace(path)
            bar.advance(task)
    schedule = [[r, min(strengths, key=lambda s: (kl[str(r)][str(s)], -s))] for r in ratios]
    ad.info["strength"] = schedule
    trainer.schedule = schedule
    out = {"key": key, "kl": kl, "schedule": schedule, "questions": len(items), "on": on}
    path.write_text(json.dumps(out, indent=1))
    return out
