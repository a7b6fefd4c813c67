"""Decode bench on a real model: attention recall, TPOT and NIAH accuracy of sparse decode policies.

`bench_decode_model` measures, in one run and on RULER needle-in-a-haystack samples of one context
length (``kvstitch bench decode``):

- **recall** (PRKV Eq. 3): the share of the dense attention mass that each policy's selection covers, with
  the decoder in diagnostic mode, and **oracle** recall: the best any selection of as many tokens could
  cover. Both are averaged over the layers that select (Gemma 3's sliding-window layers attend densely
  over their window, recall 1 by construction; `recall_per_layer` keeps every layer). Every policy is
  teacher-forced with the tokens that dense (`dense`) decode produces, so all see the same steps;
  **top1** is the share of those steps where the policy's greedy token equals dense decode's.
- **TPOT**: the median time of one decode step (the whole model), in a separate pass without
  diagnostics. Per budget, `dense` (dense decode over the contiguous cache, what ``decode="dense"`` does)
  and every policy run in lockstep, alternating step by step (the order rotates), so machine noise hits
  all alike; ``tpot_vs_full`` is the ratio to `full` from that same pass. With ``batch`` B > 1 each of
  them decodes B copies of the sample as one batched step (`Engine.decode_batch`, what the server runs
  for B requests in flight: sparse rows share one batched attention per layer), so ``tpot_vs_full`` is
  the inverse of decode throughput vs dense at B requests, measured in lockstep rather than one server
  run after another (on a shared machine their speeds drift apart by more than the effects measured).
- **NIAH accuracy**: free greedy decode of ``n_niah`` samples with `dense` and every (policy, budget),
  prompted and capped as ``kvstitch eval`` does (RULER's answer prefix; answer tokens + 8), scored with
  the task's RULER scorer (``kvstitch.tasks.grading``).

Each sample is prefilled once (``method``, default full prefill); every decoder starts from that cache
(`Engine.make_decoder` copies it to its host pool; `StitchCache.for_decoder` gives it a length-only cache)
and dense decode rolls the shared cache back after each run. A budget that covers the whole decode
(prompt + new tokens) makes every policy dense: such rows measure recall only (1.0, a check) and say so.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from rich.progress import Progress

from kvstitch.engine.answer import observation_queries
from kvstitch.core.cache import StitchCache
from kvstitch.select import make_selector
from .decode_setup import check_inputs, decoder_options, positive_int, probe_decoder

DEFAULT_POLICIES = ("prkv", "quest", "snapkv", "arkvale", "shadowkv")
DEFAULT_BUDGETS = (256, 512, 1024)
DEFAULT_NEW_TOKENS = 160  # > T = 128: the static set is refreshed within the measured decode
OBS_WINDOW = 64           # the local window (PRKV Sec. 5.1), also the observation window
DENSE = "dense"           # the reference row: dense decode over the contiguous cache


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _selecting_recall(dec) -> dict:
    """Recall / oracle recall / min over the layers that select (not sliding-window layers)."""
    layers = [i for i, st in enumerate(dec.layers) if st is not None and st.sliding_window is None]
    layers = [i for i in layers if dec.recall.history[i]] or [i for i, h in enumerate(dec.recall.history) if h]
    if not layers:
        return {"recall": math.nan, "oracle_recall": math.nan, "oracle_recall_kv": math.nan, "recall_min": math.nan}

    def values(hist) -> torch.Tensor:
        return torch.cat([torch.stack(hist[i]).flatten() for i in layers if hist[i]] or [torch.full((1,), math.nan)])

    rec = values(dec.recall.history)
    return {"recall": rec.mean().item(), "oracle_recall": values(dec.recall.oracle).mean().item(),
            "oracle_recall_kv": values(dec.recall.oracle_kv).mean().item(), "recall_min": rec.min().item()}


class _Sample:
    """One prefilled NIAH sample: the shared dense cache, its length and the observation queries."""

    def __init__(self, engine, sample, method: str, ratio: float, max_tokens: int, method_options: dict | None):
        from kvstitch.core.prompt import with_answer_prefix

        self.engine, self.sample = engine, sample
        # with RULER's answer prefix, as `kvstitch eval` prompts (`eval.runner.sample_layout`)
        layout = with_answer_prefix(engine.layout(sample.question, sample.chunks), engine.tokenizer,
                                    sample.meta.get("answer_prefix"))
        pre = engine.prefill(layout, make_selector(method, **(method_options or {})), ratio, max_tokens)
        self.cache, self.layout, logits = pre.cache, pre.layout, pre.logits
        self.n = self.cache.length
        self.first = int(torch.argmax(logits[-1]))
        self._obs = None
        self.obs_window = OBS_WINDOW

    @property
    def obs(self) -> dict:
        """Observation queries of the last `OBS_WINDOW` prompt tokens (each decoder keeps its local window's
        worth: the observation window is the local window, PRKV Sec. 4.1)."""
        if self._obs is None:
            self._obs = observation_queries(self.engine, self.cache, self.layout.ids, window=self.obs_window)
        return self._obs

    def runner(self, policy: str | None, budget: int | None, options: dict, diagnostic: bool = False):
        """(cache, decoder) for one decode run; ``policy=None``: dense over the shared cache."""
        eng = self.engine
        self.cache.truncate(self.n)  # drop what an earlier dense run appended
        if policy is None:
            return self.cache, None
        dec = eng.make_decoder(self.cache, policy, budget, obs_queries=self.obs, diagnostic=diagnostic, **options)
        return StitchCache.for_decoder(eng.adapter, self.n, eng.device, eng.dtype), dec

    def runners(self, policy: str | None, budget: int | None, options: dict, batch: int, extra: int) -> list:
        """``batch`` (cache, decoder) rows of one policy for a batched step: sparse rows each get a decoder of
        their own; dense rows after the first get a copy of the prompt's cache (the first is the shared one)."""
        if policy is not None:
            rows = [self.runner(policy, budget, options) for _ in range(batch)]
            for cache, dec in rows:
                cache.decoder = dec  # a batched step hands each row's K/V to its decoder
            return rows
        return [self.runner(None, None, {})] + [self.floor_runner(self.n, extra) for _ in range(batch - 1)]

    def floor_runner(self, n_tokens: int, extra: int):
        """(cache, None) for dense decode over a cache of only the prompt's last ``n_tokens`` tokens: the TPOT
        a policy attending that many tokens would reach with no selection, scoring or gather of its own
        (the same weights, the same per-layer work otherwise). The new tokens sit at positions
        ``n_tokens, ...`` instead of ``n, ...``: the step's cost does not depend on them."""
        n0 = self.n - n_tokens
        keys = torch.stack([layer.keys[0, :, n0:self.n] for layer in self.cache.layers])
        values = torch.stack([layer.values[0, :, n0:self.n] for layer in self.cache.layers])
        return StitchCache.from_stacked(keys, values, n_tokens + extra), None

    def generate(self, policy: str | None, budget: int | None, options: dict, max_tokens: int) -> str:
        """Free greedy decode (EOS / a base model's line break / ``max_tokens`` stop) -> the answer text."""
        eng = self.engine
        cache, dec = self.runner(policy, budget, options)
        tokens = [self.first]
        while len(tokens) < max_tokens and not eng.finished(tokens):
            tokens.append(int(torch.argmax(eng.decode_step(cache, tokens[-1], dec)[-1])))
        self.cache.truncate(self.n)
        return eng.answer_text(tokens)


@dataclass
class _Plan:
    """What every measurement of one run shares: the NIAH samples and their answer caps (``main``: the
    sample recall and TPOT use), the decoder options per policy, and what the decoders' shapes imply."""

    samples: list
    caps: list[int]           # answer tokens + 8 per sample, at least 8 (`kvstitch eval`'s answer budget)
    main: int
    length: int               # context tokens asked of the task generator (capped at positions - 256)
    opts: dict[str, dict]     # decoder options per policy
    obs_window: int           # observation queries kept: the widest local window of any decoder
    budget_counts: dict[str, str]
    on_top: int               # the local window when it is not inside k


def _plan(engine, context: int, budgets: list[int], policies: list[str], n_niah: int, task: str,
          chunk_tokens: int, seed: int, page_size: int | None, policy_options: dict | None) -> _Plan:
    """The samples of one run and the decoders' shapes (probed at the first budget)."""
    from kvstitch.tasks.tasks import generate

    length = min(context, engine.adapter.max_positions - 256)
    tok = engine.tokenizer

    def count(text: str) -> int:
        return len(tok.encode(text, add_special_tokens=False))

    samples = generate(task, max(1, n_niah), length, chunk_tokens, seed, count)
    caps = [max(8, count(", ".join(smp.answers)) + 8) for smp in samples]  # eval's answer budget
    opts = {p: decoder_options(p, policy_options, page_size) for p in policies}
    probe = {p: probe_decoder(engine, p, budgets[0], opts[p]) for p in policies}
    return _Plan(samples=samples, caps=caps, main=len(samples) // 2, length=length, opts=opts,
                 obs_window=max([OBS_WINDOW] + [d.window for d in probe.values()]),
                 budget_counts={p: d.budget_counts() for p, d in probe.items()},
                 on_top=min(d.cap - d.kv_budget for d in probe.values()))


class _Steps:
    """The progress bar of one run: the current stage and the work units done."""

    def __init__(self, bar: Progress, total: int):
        self.bar = bar
        self.job = bar.add_task("bench decode", total=total)

    def stage(self, text: str) -> None:
        self.bar.update(self.job, description=text)

    def advance(self, units: int = 1) -> None:
        self.bar.advance(self.job, units)


def _reference(engine, s: _Sample, new_tokens: int, steps: _Steps) -> list[int]:
    """Dense greedy decode, EOS ignored (also warms the decode path up): the tokens every run is forced with."""
    steps.stage(f"reference ({DENSE})")
    cache, _ = s.runner(None, None, {})
    ref = [s.first]
    for _ in range(new_tokens):
        ref.append(int(torch.argmax(engine.decode_step(cache, ref[-1])[-1])))
        steps.advance()
    return ref


def _time_steps(engine, s: _Sample, ref: list[int], budgets: list[int], policies: list[str], opts: dict,
                new_tokens: int, warmup: int, steps: _Steps, on_top: int, batch: int = 1) -> dict[tuple, list[float]]:
    """TPOT: per budget, dense + the floor + every policy in lockstep (the order rotates step by step),
    teacher-forced with the reference tokens -> ``{(policy or "dense" or "floor", budget): step seconds
    after warm-up}``. The floor is dense decode over ``budget + on_top`` tokens (`_Sample.floor_runner`).
    ``batch`` > 1: each step is a batched step of that many copies (`_Sample.runners`)."""
    from kvstitch.engine.batch import DecodeStep

    device = engine.device
    times: dict[tuple, list[float]] = {}
    extra = new_tokens + 1
    for b in budgets:
        steps.stage(f"TPOT, budget {b}" + (f", batch {batch}" if batch > 1 else ""))
        if batch == 1:
            runners = {(DENSE, None): [s.runner(None, None, {})], ("floor", b): [s.floor_runner(b + on_top, extra)]}
            runners.update({(p, b): [s.runner(p, b, opts[p])] for p in policies})
        else:
            runners = {(DENSE, None): s.runners(None, None, {}, batch, extra),
                       ("floor", b): [s.floor_runner(b + on_top, extra) for _ in range(batch)]}
            runners.update({(p, b): s.runners(p, b, opts[p], batch, extra) for p in policies})
        names = list(runners)
        step_times = {name: [] for name in names}
        for t in range(new_tokens):
            for name in names[t % len(names):] + names[:t % len(names)]:
                rows = runners[name]
                _sync(device)
                t0 = time.perf_counter()
                if batch == 1:
                    engine.decode_step(rows[0][0], ref[t], rows[0][1])
                else:
                    engine.decode_batch([DecodeStep(cache, ref[t], dec) for cache, dec in rows])
                    for _, dec in rows:
                        if dec is not None:
                            dec.end_step()
                _sync(device)
                step_times[name].append(time.perf_counter() - t0)
            steps.advance(len(names))
        s.cache.truncate(s.n)
        for name, ts in step_times.items():
            times[(name[0], b)] = ts[warmup:]
        del runners
    return times


def _recall(engine, s: _Sample, ref: list[int], budgets: list[int], policies: list[str], opts: dict,
            new_tokens: int, steps: _Steps) -> dict[tuple, dict]:
    """Recall: diagnostic mode, one policy at a time, teacher-forced with the reference tokens ->
    ``{(policy, budget): recall fields of its row}``."""
    recall: dict[tuple, dict] = {}
    for b in budgets:
        for p in policies:
            steps.stage(f"recall {p} @ {b}")
            cache, dec = s.runner(p, b, opts[p], diagnostic=True)
            agree = 0
            for t in range(new_tokens):
                agree += int(torch.argmax(engine.decode_step(cache, ref[t], dec)[-1])) == ref[t + 1]
                steps.advance()
            st = dec.stats()
            recall[(p, b)] = {**_selecting_recall(dec), "top1_agreement": agree / new_tokens,
                              "recall_per_layer": st["recall_per_layer"],
                              "max_abs_err_vs_dense": st["max_abs_err_vs_dense"],
                              "mean_selected_tokens": st["mean_selected_tokens"],
                              "pages_copied_per_step": st["pages_copied"] / max(1, st["steps"]),
                              "static_refreshes": st["static_refreshes"],
                              "budget_counts": st["budget_counts"]}
            del dec
    return recall


def _niah(engine, plan: _Plan, s: _Sample, budgets: list[int], policies: list[str], n_niah: int, task: str,
          method: str, recompute_ratio: float, method_options: dict | None,
          steps: _Steps) -> tuple[dict[tuple, list[float]], list[dict]]:
    """NIAH: free greedy decode of every sample with dense and every (policy, sparse budget) ->
    (``{(policy, budget): scores}``, one prediction record per run). ``s``: the main sample, prefilled."""
    from kvstitch.tasks.grading import scorer_for

    score = scorer_for(task)
    niah: dict[tuple, list[float]] = {(DENSE, None): []}
    niah.update({(p, b): [] for b in budgets for p in policies})
    preds: list[dict] = []
    for i in range(n_niah):
        if i != plan.main:
            steps.stage(f"prefill sample {i}")
            s_i = _Sample(engine, plan.samples[i], method, recompute_ratio, plan.caps[i], method_options)
            s_i.obs_window = plan.obs_window
            steps.advance()
        else:
            s_i = s
        answers = plan.samples[i].answers
        for key in niah:
            p, b = key
            steps.stage(f"NIAH {i + 1}/{n_niah}: {p}" + (f" @ {b}" if b else ""))
            text = s_i.generate(None if p == DENSE else p, b, plan.opts.get(p, {}), plan.caps[i])
            niah[key].append(score(text, answers))
            preds.append({"sample": i, "policy": p, "budget": b, "pred": text, "answers": answers,
                          "score": niah[key][-1]})
            steps.advance(plan.caps[i])
        del s_i
    return niah, preds


def _rows(s: _Sample, new_tokens: int, budgets: list[int], policies: list[str], dense: list[int], n_max: int,
          times: dict, recall: dict, niah: dict, on_top: int) -> list[dict]:
    """The `dense` row, then per budget a `floor` row (sparse budgets) and one row per policy; what was not
    measured is None."""
    def ms(ts: list[float]) -> float:
        return 1e3 * statistics.median(ts) if ts else math.nan

    def acc(key) -> float:
        return statistics.mean(niah[key]) if niah.get(key) else math.nan

    base = {"context_tokens": s.layout.n_context, "prompt_tokens": s.n, "new_tokens": new_tokens}
    full_all = [t for b in budgets if b not in dense for t in times[(DENSE, b)]]
    rows = [{"policy": DENSE, "budget": None, **base, "recall": 1.0, "oracle_recall": 1.0,
             "oracle_recall_kv": 1.0, "recall_min": 1.0,
             "top1_agreement": 1.0, "tpot_ms": ms(full_all), "tpot_vs_full": 1.0 if full_all else math.nan,
             "niah_acc": acc((DENSE, None)), "niah_n": len(niah[(DENSE, None)]),
             "note": "dense decode over the contiguous cache (reference)"}]
    for b in budgets:
        if b not in dense:
            tp, tf = ms(times[("floor", b)]), ms(times[(DENSE, b)])
            rows.append({"policy": "floor", "budget": b, **base, "recall": None, "oracle_recall": None,
                         "oracle_recall_kv": None, "recall_min": None, "top1_agreement": None, "tpot_ms": tp, "full_tpot_ms": tf,
                         "tpot_vs_full": tp / tf, "niah_acc": None, "niah_n": 0, "mean_selected_tokens": b + on_top,
                         "note": f"dense decode over {b + on_top} tokens (k + window): no policy attending as many "
                                 f"is faster with these weights"})
        for p in policies:
            row = {"policy": p, "budget": b, **base, **recall[(p, b)]}
            if b in dense:
                row.update(tpot_ms=math.nan, full_tpot_ms=math.nan, tpot_vs_full=math.nan, niah_acc=math.nan,
                           niah_n=0, note=f"budget + window >= {n_max} tokens (prompt + new tokens): dense; "
                                          f"TPOT and NIAH not run")
            else:
                tp, tf = ms(times[(p, b)]), ms(times[(DENSE, b)])
                row.update(tpot_ms=tp, full_tpot_ms=tf, tpot_vs_full=tp / tf, niah_acc=acc((p, b)),
                           niah_n=len(niah[(p, b)]), note="")
            rows.append(row)
    return [{k: None if isinstance(v, float) and math.isnan(v) else v for k, v in r.items()} for r in rows]


def _add_bounds(engine, rows: list[dict], plan: _Plan, context: int, batch: int = 1) -> None:
    """The bytes-read floor of each sparse row's TPOT ratio (`kvstitch.bench.bound`, ``batch`` rows, a cache of
    the prompt + half the decode): ``bound_tpot`` (and the ``bound_*`` bytes) beside ``tpot_vs_full``."""
    from .bound import bytes_bound, model_bytes

    m = model_bytes(engine)
    for r in rows:
        if r["policy"] == DENSE:
            continue
        if r["policy"] == "floor":
            cap = r["mean_selected_tokens"]
        else:
            cap = probe_decoder(engine, r["policy"], r["budget"], plan.opts[r["policy"]]).cap
        r.update(bytes_bound(m, context, batch, cap, plan.opts.get(r["policy"], {}).get("page_size", 32)))


def bench_decode_model(engine, context: int = 8192, budgets: Sequence[int] = DEFAULT_BUDGETS,
                       policies: Sequence[str] = DEFAULT_POLICIES, n_niah: int = 5,
                       new_tokens: int = DEFAULT_NEW_TOKENS, *,
                       method: str = "full", recompute_ratio: float = 0.2, method_options: dict | None = None,
                       task: str = "niah_multikey", chunk_tokens: int = 256, seed: int = 0, warmup: int = 2,
                       page_size: int | None = None, policy_options: dict[str, dict] | None = None,
                       batch: int = 1, progress: bool = True) -> tuple[list[dict], dict]:
    """Recall, TPOT and NIAH accuracy of every (policy, budget) at one context length (module docstring).

    ``context``: context tokens, capped like `kvstitch.bench.ttft.context_of_length` (model positions - 256;
    ``meta["capped"]`` says so and rows carry the real ``context_tokens`` / ``prompt_tokens``).
    ``new_tokens``: decode steps after the prefill's first token, for recall and TPOT (teacher-forced,
    EOS ignored); the default 160 passes the refresh period T = 128 (rows report ``static_refreshes``). NIAH answers are capped as `kvstitch eval` caps them (answer tokens + 8, at least 8).
    ``warmup`` steps are left out of the TPOT medians.
    ``n_niah``: NIAH samples (``task``, needle depths spread over [0, 1]); recall and TPOT use the
    middle one. ``page_size`` / ``policy_options`` (per policy: its fields) go to the decoders.
    ``batch``: rows per timed step (copies of the recall sample decoded as one batch; recall and NIAH stay
    per request). Each row holds a cache of its own: memory grows with it.

    Returns (rows, meta): a `dense` row (budget None) then one row per (budget, policy); what was not
    measured (TPOT / NIAH of a dense budget, NIAH with ``n_niah=0``) is None.
    """
    budgets, policies = check_inputs(engine, context, budgets, policies, n_niah, new_tokens, method, task,
                                      policy_options, page_size)
    warmup = max(0, min(warmup, new_tokens - 1))
    batch = positive_int("batch", batch)
    plan = _plan(engine, context, budgets, policies, n_niah, task, chunk_tokens, seed, page_size, policy_options)
    samples, caps, main = plan.samples, plan.caps, plan.main

    # work units: prefills, decode steps (reference, timing, recall) and NIAH runs (their answer cap each)
    n_budgets = len(budgets)
    total = (len(samples) + new_tokens * (1 + n_budgets * (2 + 2 * len(policies)))  # timing: dense, floor, policies
             + sum(caps[:n_niah]) * (1 + n_budgets * len(policies)))
    with Progress(disable=not progress) as bar:
        steps = _Steps(bar, total)
        steps.stage(f"prefill sample {main}")
        s = _Sample(engine, samples[main], method, recompute_ratio, max(new_tokens + 1, caps[main]),
                    method_options)
        s.obs_window = plan.obs_window
        steps.advance()
        n_max = s.n + new_tokens  # tokens in the cache at the last step
        dense = [b for b in budgets if b + plan.on_top >= n_max]  # every policy selects everything: dense attention
        sparse_budgets = [b for b in budgets if b + plan.on_top < n_max]

        ref = _reference(engine, s, new_tokens, steps)
        times = _time_steps(engine, s, ref, sparse_budgets, policies, plan.opts, new_tokens, warmup, steps,
                            plan.on_top, batch)
        steps.advance(new_tokens * len(dense) * (2 + len(policies)))
        recall = _recall(engine, s, ref, budgets, policies, plan.opts, new_tokens, steps)
        niah, preds = _niah(engine, plan, s, sparse_budgets, policies, n_niah, task, method, recompute_ratio,
                            method_options, steps)
        steps.advance(sum(caps[:n_niah]) * len(policies) * len(dense))

    rows = _rows(s, new_tokens, budgets, policies, dense, n_max, times, recall, niah, plan.on_top)
    _add_bounds(engine, rows, plan, s.n + new_tokens // 2, batch)
    limit = engine.adapter.max_positions
    meta = {"model": engine.adapter.describe(), "device": str(engine.device), "dtype": str(engine.dtype),
            "context_requested": context, "context_tokens": s.layout.n_context, "prompt_tokens": s.n,
            "capped": context > plan.length, "max_positions": limit, "budgets": budgets, "policies": policies,
            "new_tokens": new_tokens, "warmup": warmup, "batch": batch, "n_niah": n_niah, "task": task,
            "method": method,
            "recompute_ratio": recompute_ratio if method != "full" else None, "chunk_tokens": chunk_tokens,
            "seed": seed, "page_size": page_size or 32, "policy_options": policy_options or {},
            "observation_window": plan.obs_window, "budget_counts": plan.budget_counts,
            "recall_sample": {"index": main, "depth": samples[main].meta.get("depth")},
            "niah_answer_caps": caps[:n_niah], "reference_tokens": ref, "niah_predictions": preds}
    return rows, meta
