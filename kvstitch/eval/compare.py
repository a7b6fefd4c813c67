"""Two evaluation runs of the same samples side by side (e.g. an int8 chunk store against float16):
``kvstitch eval-compare BASE OTHER`` writes the table as markdown and JSON.

Rows are matched by sample (task, seed, index, length, chunk_tokens), method and ratio; only samples
present in both runs count. Per (method, ratio):

- ``score_*``: mean task score x100 in each run;
- ``nll_rec_*``: pooled NLL-gap recovery, *both measured against the base run's gap*:
  sum(NLL_naive,base - NLL_m) / sum(NLL_naive,base - NLL_full,base), so the other run's loss shows as
  lower recovery instead of being normalised away by its own (also shifted) naive row;
- ``kl_*``: mean KL(full || method) over the answer;
- ``same_answer``: share of samples whose greedy answer text is identical in both runs;
- ``kept_*`` (QA rows, e.g. SQuAD): of the samples the run's *own* full prefill answers correctly, the share the
  method still answers correctly (``right_*``: how many those are; ``kept_*_ci`` its 95% bootstrap interval);
  ``agree_*``: the share whose answer is full prefill's of the same run; ``speedup_*``: the median over samples of the
  run's full-prefill TTFT / the method's on the same sample. Across two models on the same samples this is "does
  stitching keep more answers as the model grows";
- ``correct_*`` (QA rows): the share of *all* the samples the method answers correctly, and ``correct_diff`` other
  minus base paired over the same samples (``correct_diff_ci`` its 95% bootstrap interval): where the two runs
  differ in what the prompt holds (e.g. two chunkings of retrieved context), the end-to-end answer to "which
  gives more right answers", that answers kept (each against its own full prefill) cannot give;
- ``identical``: share of samples whose rows agree in answer text, recomputed-token count, NLL and KL
  (within `IDENTICAL_TOL`): the check that a refactor left the numbers unchanged; ``max_dnll`` is the
  largest |NLL difference|.
"""

from __future__ import annotations

import json
import math
import os
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

from kvstitch.core.errors import InputError
from kvstitch.tasks.agreement import same_answer

from .rows import bootstrap_mean_ci, fmt_ci, has_jsonl, method_key, ratio_key, read_jsonl, ttft_speedup

SAMPLE_KEY = ("task", "seed", "index", "length", "chunk_tokens")
IDENTICAL_TOL = 1e-5  # absolute, on the answer NLL and KL: two processes running the same float32 prefill
# with different thread counts differ by up to ~2e-6 (measured: the full rows of the int8 comparison)


def _sample(r: dict) -> tuple:
    return tuple(r.get(k) for k in SAMPLE_KEY)


def _ratio(r: dict):
    return None if r.get("method") in ("full", "naive") else r.get("ratio")


def _mean(xs) -> float:
    v = [float(x) for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return sum(v) / len(v) if v else math.nan


def compare_runs(base: Sequence[dict], other: Sequence[dict]) -> list[dict]:
    """One dict per (method, ratio) present in both runs (see the module doc for the fields)."""
    a = {(_sample(r), r.get("method"), _ratio(r)): r for r in base}
    b = {(_sample(r), r.get("method"), _ratio(r)): r for r in other}
    naive, full = _references(a)
    groups: dict[tuple, list[tuple]] = defaultdict(list)
    for key in a:  # in the base run's row order, not a set's: the bootstrap resamples by position
        if key in b:
            groups[key[1:]].append(key)

    def recovery(rows: list[dict]) -> float:
        return _recovery(rows, naive, full)

    def close(x, y) -> bool:
        if x is None or y is None:
            return x is None and y is None
        return abs(float(x) - float(y)) <= IDENTICAL_TOL

    def identical(x: dict, y: dict) -> bool:
        return (x.get("pred") == y.get("pred") and x.get("recomputed") == y.get("recomputed")
                and close(x.get("nll"), y.get("nll")) and close(x.get("kl"), y.get("kl")))

    out = []
    answers_a, answers_b = _full_answers(a), _full_answers(b)
    for method, ratio in sorted(groups, key=lambda k: (method_key(str(k[0])), ratio_key(k[1]))):
        keys = groups[(method, ratio)]
        ra, rb = [a[k] for k in keys], [b[k] for k in keys]
        out.append({
            "method": method, "ratio": ratio, "n": len(keys),
            "score_base": 100 * _mean(r.get("score") for r in ra), "score_other": 100 * _mean(r.get("score") for r in rb),
            "nll_rec_base": recovery(ra), "nll_rec_other": recovery(rb),
            "kl_base": _mean(r.get("kl") for r in ra), "kl_other": _mean(r.get("kl") for r in rb),
            "same_answer": sum(x.get("pred") == y.get("pred") for x, y in zip(ra, rb)) / len(keys),
            "identical": sum(identical(x, y) for x, y in zip(ra, rb)) / len(keys),
            "max_dnll": max((abs(float(x["nll"]) - float(y["nll"])) for x, y in zip(ra, rb)
                             if x.get("nll") is not None and y.get("nll") is not None), default=math.nan),
        })
        if any(r.get("correct") is not None for r in ra):
            diffs = [float(bool(y.get("correct"))) - float(bool(x.get("correct"))) for x, y in zip(ra, rb)]
            out[-1].update({"correct_base": _mean(float(bool(r.get("correct"))) for r in ra),
                            "correct_other": _mean(float(bool(r.get("correct"))) for r in rb),
                            "correct_diff": _mean(diffs), "correct_diff_ci": bootstrap_mean_ci([diffs])})
            for side, rows, answers in (("base", ra, answers_a), ("other", rb, answers_b)):
                right = [r for r in rows if answers.get(_sample(r), (False, ""))[0]]
                kept = [float(bool(r.get("correct"))) for r in right]
                out[-1].update({f"right_{side}": len(right), f"kept_{side}": _mean(kept),
                                f"kept_{side}_ci": bootstrap_mean_ci([kept]),
                                f"speedup_{side}": ttft_speedup(rows),
                                f"nll_rec_own_{side}": _recovery(rows, *_references(a if side == "base" else b)),
                                f"agree_{side}": _mean(float(same_answer(r.get("pred", ""), answers[_sample(r)][1]))
                                                       for r in rows if _sample(r) in answers)})
    return out


def _references(rows: dict) -> tuple[dict, dict]:
    """sample -> answer NLL of the naive and of the full rows of one run (keyed as `compare_runs` keys them)."""
    naive = {s: r["nll"] for (s, m, _), r in rows.items() if m == "naive" and r.get("nll") is not None}
    full = {s: r["nll"] for (s, m, _), r in rows.items() if m == "full" and r.get("nll") is not None}
    return naive, full


def _recovery(rows: list[dict], naive: dict, full: dict) -> float:
    """Pooled NLL-gap recovery of ``rows`` against the given naive and full NLLs."""
    num = den = 0.0
    for r in rows:
        s = _sample(r)
        if s not in naive or s not in full or r.get("nll") is None:
            continue
        num += naive[s] - float(r["nll"])
        den += naive[s] - full[s]
    return num / den if abs(den) > 1e-9 else math.nan


def _full_answers(rows: dict) -> dict[tuple, tuple[bool, str]]:
    """sample -> (full prefill answered correctly, its answer), from one run's ``full`` rows."""
    return {s: (bool(r.get("correct")), r.get("pred", "")) for (s, m, _), r in rows.items()
            if m == "full" and r.get("correct") is not None}


def _f(x: float, digits: int) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def compare_table(rows: Sequence[dict], base_label: str = "base", other_label: str = "other",
                  same_model: bool = True) -> str:
    """The comparison as a markdown table (the README's int8 table). Runs of two different models
    (``same_model=False``) get only the answers-kept table: matching their rows' NLLs or answer texts would
    compare two models, not two settings."""
    b, o = base_label, other_label
    header = (f"| method | r | n | score {b} | score {o} | NLL rec. {b} | NLL rec. {o} | KL {b} | KL {o} | same answer | "
              "identical rows | max abs NLL diff |")
    rule = "|---|---|---|---|---|---|---|---|---|---|---|---|"
    lines = [header, rule]
    qa = [r for r in rows if "kept_base" in r]
    if qa:
        lines = [f"Answers kept: of the questions each run's own full prefill answers correctly (right), the share the "
                 f"method still answers correctly; agrees: the method's answer is its run's full prefill's; correct: "
                 f"the share of all n questions the method answers correctly, and {o} - {b} paired over them.", "",
                 f"| method | r | n | right {b} | kept {b} | right {o} | kept {o} | agrees {b} | agrees {o} | "
                 f"NLL rec. (own gap) {b} | NLL rec. (own gap) {o} | TTFT speed-up {b} | TTFT speed-up {o} | "
                 f"correct {b} | correct {o} | correct {o} - {b} |",
                 "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"] + [
            f"| {r['method']} | {_ratio_cell(r['ratio'])} | {r['n']} | {r['right_base']} | "
            f"{fmt_ci(r['kept_base'], r['kept_base_ci'], 2)} | {r['right_other']} | "
            f"{fmt_ci(r['kept_other'], r['kept_other_ci'], 2)} | {_f(r['agree_base'], 2)} | {_f(r['agree_other'], 2)} | "
            f"{_f(r['nll_rec_own_base'], 2)} | {_f(r['nll_rec_own_other'], 2)} | {_f(r['speedup_base'], 2)} | "
            f"{_f(r['speedup_other'], 2)} | {_f(r['correct_base'], 2)} | {_f(r['correct_other'], 2)} | "
            f"{fmt_ci(r['correct_diff'], r['correct_diff_ci'], 2)} |"
            for r in qa]
        if not same_model:
            return "\n".join(lines) + "\n"
        lines += ["", f"Below, both runs' NLL recovery is measured against {b}'s gap.", "", header, rule]
    for r in rows:
        ratio = _ratio_cell(r["ratio"])
        dnll = "–" if math.isnan(r["max_dnll"]) else f"{r['max_dnll']:.1e}"
        lines.append(f"| {r['method']} | {ratio} | {r['n']} | {_f(r['score_base'], 1)} | {_f(r['score_other'], 1)} | "
                     f"{_f(r['nll_rec_base'], 2)} | {_f(r['nll_rec_other'], 2)} | {_f(r['kl_base'], 3)} | "
                     f"{_f(r['kl_other'], 3)} | {100 * r['same_answer']:.0f}% | {100 * r['identical']:.0f}% | {dnll} |")
    return "\n".join(lines) + "\n"


def _ratio_cell(ratio) -> str:
    return "–" if ratio is None else str(ratio) if ratio == "auto" else f"{ratio:g}"


def _results(path: str | os.PathLike) -> Path:
    p = Path(path)
    p = p / "results.jsonl" if p.is_dir() else p
    if not has_jsonl(p):
        raise InputError(f"{path}: no results.jsonl (pass a `kvstitch eval --out` directory or its results.jsonl)")
    return p


def _model(results: Path) -> str | None:
    """The weights' fingerprint recorded in the run.json beside ``results`` (None when there is none)."""
    try:
        return json.loads((results.parent / "run.json").read_text())["model"]["fingerprint"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write_comparison(base: str | os.PathLike, other: str | os.PathLike, out: str | os.PathLike,
                     base_label: str = "base", other_label: str = "other", name: str = "compare",
                     command: str | None = None, tasks: Sequence[str] | None = None,
                     lengths: Sequence[int] | None = None,
                     across_tasks: bool = False) -> tuple[Path, Path, list[dict]]:
    """Compare two eval outputs (only `tasks` / `lengths` when given); write ``<out>/<name>.md`` and
    ``<out>/<name>.json`` -> (md, json, rows). ``across_tasks``: each run holds one task and the two differ
    only in how the same samples were prompted (e.g. ``--merge-passages``, ``--chunk-tokens`` with
    ``--retrieve``): rows are matched by sample, not by task name or chunk size."""
    pa, pb = _results(base), _results(other)

    def keep(r: dict) -> bool:
        return (not tasks or r.get("task") in tasks) and (not lengths or r.get("length") in lengths)

    runs = [[r for r in read_jsonl(p) if keep(r)] for p in (pa, pb)]
    if across_tasks:
        for p, rs in zip((pa, pb), runs):
            names = sorted({str(r.get("task")) for r in rs})
            if len(names) > 1:
                raise InputError(f"{p}: matching samples across tasks needs one task per run, this one holds "
                                 f"{', '.join(names)} (choose one with --tasks)")
        runs = [[dict(r, task="", chunk_tokens=None) for r in rs] for rs in runs]  # the prompt's shape differs
    rows = compare_runs(*runs)
    if not rows:
        raise InputError(f"{pa} and {pb} share no (sample, method, ratio) rows: nothing to compare")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    md, js = out / f"{name}.md", out / f"{name}.json"
    models = _model(pa), _model(pb)
    same_model = None in models or models[0] == models[1]
    md.write_text(compare_table(rows, base_label, other_label, same_model=same_model))
    meta = {"base": str(pa), "other": str(pb), "base_label": base_label, "other_label": other_label,
            "command": command, "rows_matched": sum(r["n"] for r in rows), "same_model": same_model}
    js.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=str) + "\n")
    return md, js, rows
