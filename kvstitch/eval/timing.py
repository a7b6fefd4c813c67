"""What a row's TTFT is charged, and when it cannot be trusted.

- What would redo the sample's full prefill reuses the reference's (`SampleFullPrefill`): the oracles' exact context
  and `auto`'s fallback get the same K/V and logits, and are charged its measured time, so TTFTs stay what a lone
  request measures. Scores that do not depend on the budget are computed once per sample (`score_memo`) and
  charged to every ratio that reuses them.
- A prefill timed while the process was paused or starved (a stopped job, a suspended machine: the process got far
  less CPU than the wall clock says) is measured again (`paused`, `timed_again`): the computation is the same, only
  its time was wrong.
"""

from __future__ import annotations

import logging
import time

log = logging.getLogger("kvstitch.eval")

# Scorers whose per-token scores depend on the prompt only (not on the budget) and are expensive enough to
# compute once per sample for all ratios: the oracles run a full prefill to score.
SCORE_CACHED = ("oracle", "oracle_ideal")
# A timed prefill whose process got less than this share of one core over at least this long was paused or
# starved: its TTFT says nothing about the method.
PAUSED_CPU_SHARE = 0.25
PAUSED_MIN_S = 1.0


def cpu_clock() -> float:
    """The process's CPU seconds (every thread's), read beside the wall clock."""
    return time.process_time()


class SampleFullPrefill:
    """The sample's full prefill (the reference row's), kept for what would compute the very same thing again:
    the oracles' exact context K/V and `auto`'s fallback to full prefill. Same prompt, same computation, so the
    same K/V and logits; the time it took is charged to whoever reuses it, so TTFTs stay what a lone request
    measures. The engine's full prefills reach it only inside `recording` / `replaying` (its ``full_prefill``
    hook, `Engine.hooked`)."""

    def __init__(self, engine, layout):
        self.engine, self.layout = engine, layout
        self.cache = self.logits = None
        self.seconds = 0.0
        self.charged = 0.0  # reused seconds not yet charged (`take_charge`)

    def _same(self, layout, plan, logits_to_keep) -> bool:
        return layout is self.layout and plan is None and logits_to_keep == 1

    def recording(self):
        """Keep the sample's full prefill as the engine computes it."""

        def full_prefill(layout, extra, plan, logits_to_keep, compute):
            t0 = time.perf_counter()
            cache, logits = compute(layout, extra, plan, logits_to_keep)
            if self._same(layout, plan, logits_to_keep):
                self.cache, self.logits, self.seconds = cache, logits, time.perf_counter() - t0
            return cache, logits

        return self.engine.hooked(full_prefill=full_prefill)

    def replaying(self):
        """Hand the kept full prefill to whatever asks the engine for the same one (charging its time)."""

        def full_prefill(layout, extra, plan, logits_to_keep, compute):
            if (self.cache is None or not self._same(layout, plan, logits_to_keep)
                    or self.cache.layers[0].capacity < layout.n_total + extra):
                return compute(layout, extra, plan, logits_to_keep)
            self.cache.truncate(layout.n_total)  # drop the answer a previous user decoded into it
            self.charged += self.seconds
            return self.cache, self.logits

        return self.engine.hooked(full_prefill=full_prefill)

    def take_charge(self) -> float:
        charged, self.charged = self.charged, 0.0
        return charged


def score_memo(method: str, cache: dict | None, full: SampleFullPrefill | None = None):
    """A score hook (`EngineHooks.score`) memoising the scores of `SCORE_CACHED` methods without options in
    `cache` (per sample); they score over the sample's full prefill (``full``) instead of prefilling the
    context again. -> (the hook, or None for other methods; a function giving the scoring time reused,
    0.0 when everything was computed here: the caller charges it)."""
    saved = [0.0]
    if cache is None or method not in SCORE_CACHED:
        return None, lambda: saved[0]

    def score(selector, ctx, compute):
        if method in cache:
            scores, dt = cache[method]
            saved[0] = dt
            return scores
        reused = 0.0
        if full is not None and full.cache is not None and selector.needs_full_prefill:
            ctx.exact_cache, reused = full.cache, full.seconds  # this request's context: the oracle scores over it
        t0 = time.perf_counter()
        scores = compute(ctx)
        cache[method] = (scores, time.perf_counter() - t0 + reused)
        saved[0] = reused
        return scores

    return score, lambda: saved[0]


def paused(run) -> bool:  # run: a `MethodRun`
    """Its timed prefill ran on a paused or starved process (`PAUSED_CPU_SHARE`)."""
    share = run.stats.get("cpu_share")
    return share is not None and run.stats.get("timed_s", 0.0) >= PAUSED_MIN_S and share < PAUSED_CPU_SHARE


def timed_again(measure, first, what: str):
    """``measure()`` once more, for a run whose prefill was timed on a paused process (`paused`): the same
    computation, so only its times differ; the new run is kept, marked ``retimed``."""
    log.warning("%s: timed while the process was paused (%.0f%% of a core over %.1f s); timing it again",
                what, 100 * first.stats["cpu_share"], first.stats["timed_s"])
    again = measure()
    again.stats["retimed"] = True
    return again


