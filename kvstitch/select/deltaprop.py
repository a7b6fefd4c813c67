"""`deltaprop`: kvstitch's own method. A query-driven selection (ProphetKV's by default) recomputes its
budget, and the *correction* that recompute measured is propagated to the tokens it left stale.

Why: at 20% the attention oracles recover only 0.70-0.76 of the NLL gap (docs/results/eval-13): choosing
*which* tokens to recompute is at its ceiling, and the limit is the 80% of K/V computed without
cross-chunk attention. Their error is not independent noise. Every token of chunk j missed the same thing
in precompute, attention to chunks 0..j-1, and in each layer that missing context moves its value (and
pre-RoPE key) vector along a direction shared by the chunk. The recompute pass measures that shift exactly,
on the tokens it recomputes: at layer l, token s in S gets fresh K/V, and Δ_s = fresh_s - stitched_s. So
before layer l's attention runs, every stale token t of a chunk gets

    V_t <- V_t + α_v · Δ̄V_c(t)          K_t <- R(p_t) (R(-p_t) K_t + α_k · Δ̄K_c(t))

with Δ̄ the mean of its chunk's measured shifts (``tau`` > 0: weighted by exp(-|t - s| / tau), the shifts of
nearby recomputed tokens counting more), keys un-rotated to pre-RoPE space for the mean and rotated back
to each token's own position. The queries of the same pass (the recomputed tokens and the suffix) then
attend to corrected K/V in every layer, and decoding reads them too.

``fit="linear"`` (off by default) adds a per-token part: per layer and head, a ridge regression of how a
recomputed token's shift departs from its chunk's mean, linear in how its stitched vector departs from the chunk's
mean one, applied to the stale tokens. It brings the stale K/V closer to full prefill's but not the answers
(docs/results/own-method: measured on the tuning splits, not adopted).

``budget_unit="work"`` (off by default) spends the base budget's *causal work* rather than its token count: a
token's recompute costs its linear layers plus the keys it attends to, so early tokens are cheaper and the same
time buys more of them, chosen by score per unit of work (`spend_work`; measured in docs/results/own-method).

``probe_first=True`` (off by default) is "re-select after a first recompute": the probes go through
the model in a pass of their own before the base scores, so its selection reads corrected keys; one extra pass
of ~4% of the context (measured in docs/results/own-method).

``fusion="union"`` (off by default) is the per-layer token choice RelaxKV describes, in the form kvstitch's recompute
allows. A per-layer budget proper (layer l recomputes its own set S_l) is not possible here: a recomputed token goes
through every layer, since its layer-l input is its own layer-(l-1) output. So the base's per-layer scores choose one
set: tokens ranked by their best rank over the base's layers (ties by the fused score), i.e. every layer's top r
tokens for the largest r the budget holds - the union of per-layer sets, the budget split evenly across the
layers' own choices - rather than the top of the mean, where a few layers of peaked attention decide. Needs a base
with per-layer scores (`Selector.has_layer_scores`: prophet, infoflow, qcfuse, or grouped over one of them). A
correction strength per layer was the other candidate; it changes how stale tokens are corrected, not which tokens
a layer wants, so it is not this idea.

``attend_top=k`` (off by default: None) limits what the recomputed context tokens attend to in the recompute pass
(RelaxKV's other idea): the shared prefix (and a conversation's pinned system segment), their own passage and the k
passages of most base score (the sum of its tokens' scores), through `ForwardPlan.scope`. The question and the
decoded tokens still attend to everything; a context token never sees the question anyway (causal). ``k=0``: own
passage and prefix only, which is close to what precompute already computed (shared-prefix precompute: the same
passage after the same prefix, only farther from it), so its measured shift is small. It changes attention by
design: 100% recompute is full prefill only when k covers every passage (then no scope is set).

Cost: no extra forward (``probe_first``: one). Per layer, a few elementwise passes over the context slice:
O(n_context · d) beside the pass's O(|S| · d_model²) projections and MLPs. The first chunk (already exact in
shared-prefix precompute) measures a zero shift and is left as it is.

Properties the tests check: a stale token whose chunk-mates' K/V are shifted by a common vector is
corrected exactly (the mechanism), 100% recompute leaves nothing stale (= full prefill, every option but
``attend_top``), 0% = naive; ``fusion="union"`` holds every layer's top tokens; under ``attend_top`` a recomputed
token is unmoved by the K/V of a passage outside its scope.

Implementation: ``prepare`` wraps the stitched cache in a `DeltaCache` (a `StitchCache` over the same
buffers) that keeps the stitched context K/V and applies the correction in ``update`` whenever a pass
writes context slots. Corrections are applied to the stitched values (not on top of earlier ones), so
``recompute_ratio="auto"``'s rounds each start from the stitched cache like a fixed-ratio pass. Packed
recompute passes (the batching server) route through the same ``update``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable, ClassVar, Literal

import torch

from kvstitch.core.attention import ForwardPlan
from kvstitch.core.cache import StitchCache
from kvstitch.core.errors import BadMethodOption
from kvstitch.core.rope import rotate_half
from .context import SelectionContext
from .method import Selector, Wrapper, register
from .prophet import Prophet


class DeltaCache(StitchCache):
    """A `StitchCache` sharing ``cache``'s buffers; a pass that writes context slots S also moves the stale
    context tokens by their chunk's measured shift (module doc)."""

    def __init__(self, cache: StitchCache, layout, rope: Callable, alpha_v: float, alpha_k: float,
                 tau: float, skip_first: int, fit: str = "mean", ridge_v: float = 10.0, ridge_k: float = 0.1):
        super().__init__(cache.layers)
        self.slots, self.write, self.capture, self.captured, self.decoder = (
            cache.slots, cache.write, cache.capture, cache.captured, cache.decoder)
        self.adapted, self.adapt_from = cache.adapted, cache.adapt_from  # the stitch adapter reads as before
        self.c0, self.c1 = layout.context_start, layout.context_end
        self.chunk = layout.chunk_index().to(self.layers[0].keys.device)  # [n_context]
        starts = torch.tensor(layout.chunk_starts, device=self.chunk.device) - self.c0
        self.offset = torch.arange(self.c1 - self.c0, device=self.chunk.device) - starts[self.chunk]  # in-chunk pos
        self.n_chunks = len(layout.chunk_ids)
        # layer -> cos, sin [n_context, head_dim] of the context positions (keys are corrected in pre-RoPE space)
        self.rope = rope
        self.alpha_v, self.alpha_k, self.tau, self.skip_first = alpha_v, alpha_k, tau, skip_first
        self.fit, self.ridge_v, self.ridge_k = fit, ridge_v, ridge_k
        # the stitched context K/V: each correcting pass starts from them (idempotent across auto's rounds)
        self.stitched = [(l.keys[0, :, self.c0:self.c1].clone(), l.values[0, :, self.c0:self.c1].clone())
                         for l in self.layers]
        self.estimate_from: torch.Tensor | None = None  # bool [n_context]: tokens whose shifts are measured
        self.corrected_layers = 0  # layers corrected by the last correcting pass (tests, stats)
        # context tokens some pass recomputed: never corrected again (auto's incremental rounds keep them fresh;
        # refresh rounds recompute them again anyway)
        self.fresh = torch.zeros(self.c1 - self.c0, dtype=torch.bool, device=self.chunk.device)
        self.chunk_score: torch.Tensor | None = None  # [n_chunks] the base's score per passage (``attend_top``)
        self._pass: tuple | None = None  # (slots, targets): one pass's `_targets`, the same for all its layers

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        slots = self.slots
        if slots is None or not self.write or self.decoder is not None:
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)
        ctx = (slots >= self.c0) & (slots < self.c1)
        if not bool(ctx.any()):
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)
        sel = (slots[ctx] - self.c0).to(self.chunk.device)  # context indices recomputed by this pass
        out = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        self._correct(layer_idx, sel, self._targets(slots, sel), key_states[0][:, ctx], value_states[0][:, ctx])
        self.corrected_layers = layer_idx + 1
        if layer_idx == len(self.layers) - 1:
            self.fresh[sel] = True
            self._pass = None
        return out

    def _targets(self, slots: torch.Tensor, sel: torch.Tensor) -> torch.Tensor | None:
        """Indices of the context tokens this pass must not correct (recomputed now or by an earlier pass), None
        when every context token is one of them. The same for every layer of a pass, so it is worked out once."""
        if self._pass is None or self._pass[0] is not slots:
            stale = ~self.fresh
            stale[sel] = False
            keep = (~stale).nonzero().flatten()
            self._pass = (slots, keep if bool(stale.any()) else None)
        return self._pass[1]

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: float = 1.0) -> torch.Tensor:
        """``x [H, m, d]`` (float32) rotated to the positions of ``cos, sin [m, d]`` (``sign=-1``: from them)."""
        return x * cos + rotate_half(x) * (sin if sign > 0 else -sin)

    @torch.no_grad()
    def _correct(self, li: int, sel: torch.Tensor, keep: torch.Tensor | None, fresh_k: torch.Tensor,
                 fresh_v: torch.Tensor) -> None:
        """Layer ``li``: every stale token (not in ``keep``) takes its estimated shift. Written over the whole context
        slice at once (contiguous elementwise ops), then the ``keep`` tokens get their K/V back: a gather and scatter
        of the ~90% stale tokens cost several times more."""
        if keep is None:
            return
        sk, sv = self.stitched[li]
        layer = self.layers[li]
        use = self.offset[sel] >= self.skip_first  # the measured shifts that enter the estimate
        if self.estimate_from is not None:
            use &= self.estimate_from[sel]
        src = sel[use]
        # the tokens a linear fit learns from: every recomputed token outside the first chunk (exact already)
        fit = self.chunk[sel] > 0 if self.fit == "linear" else None
        values, keys = layer.values[0, :, self.c0:self.c1], layer.keys[0, :, self.c0:self.c1]
        kept = values.index_select(1, keep), keys.index_select(1, keep)
        if self.alpha_v:
            dv = fresh_v[:, use].float() - sv[:, src].float()  # [H, m, d]
            if self.tau or fit is not None:
                shift = self._spread(dv, src, self._every)
                if fit is not None:
                    shift = shift + self._linear(sv.float(), fresh_v[:, fit].float(), dv, src, sel[fit], self._every,
                                                 self.ridge_v)
            else:
                shift = self._chunk_mean(dv, src).index_select(1, self.chunk)
            torch.add(sv, shift, alpha=self.alpha_v, out=values)
        else:
            values.copy_(sv)
        if self.alpha_k:
            cos, sin = self.rope(li)
            dk = self._rotate(fresh_k[:, use].float() - sk[:, src].float(), cos[src], sin[src], -1)  # pre-RoPE
            if self.tau or fit is not None:
                shift = self._spread(dk, src, self._every)
                if fit is not None:
                    xk = self._rotate(sk.float(), cos, sin, -1)  # every stitched context key, pre-RoPE
                    fk = self._rotate(fresh_k[:, fit].float(), cos[sel[fit]], sin[sel[fit]], -1)
                    shift = shift + self._linear(xk, fk, dk, src, sel[fit], self._every, self.ridge_k)
                shift = self._rotate(shift, cos, sin)
            else:  # a chunk's mean shift rotated to each token's position: rotate_half commutes with the gather
                mean = self._chunk_mean(dk, src)
                shift = mean.index_select(1, self.chunk).mul_(cos)
                shift.addcmul_(rotate_half(mean).index_select(1, self.chunk), sin)
            torch.add(sk, shift, alpha=self.alpha_k, out=keys)
        else:
            keys.copy_(sk)
        values[:, keep], keys[:, keep] = kept

    @property
    def _every(self) -> torch.Tensor:
        return torch.arange(self.c1 - self.c0, device=self.chunk.device)

    def _chunk_mean(self, delta: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        """Shifts measured at ``src`` [H, m, d] -> each chunk's mean ``[H, n_chunks, d]`` (zero where none)."""
        H, m, d = delta.shape
        total = torch.zeros(self.n_chunks, H, d, dtype=delta.dtype, device=delta.device)
        count = torch.zeros(self.n_chunks, dtype=delta.dtype, device=delta.device)
        if m:
            cs = self.chunk[src]
            total.index_add_(0, cs, delta.permute(1, 0, 2))
            count.index_add_(0, cs, torch.ones(m, dtype=delta.dtype, device=delta.device))
        return (total / count.clamp(min=1)[:, None, None]).permute(1, 0, 2).contiguous()

    def _linear(self, x: torch.Tensor, fresh: torch.Tensor, delta: torch.Tensor, src: torch.Tensor,
                fs: torch.Tensor, tgt: torch.Tensor, ridge: float) -> torch.Tensor:
        """The per-token part of the shift (``fit="linear"``): how a token's shift departs from its chunk's mean
        shift, as a linear function of how its stitched vector departs from the mean stitched vector of the same
        tokens (``src``, whose shifts ``delta`` gave the mean), so a shift that is exactly linear in the stitched
        vector is recovered exactly. One ridge regression per head, fitted on the recomputed tokens ``fs``
        (``fresh`` [H, f, d] their fresh vectors), applied to the stale ``tgt``; chunks without a measured shift
        get none. ``x`` [H, n_context, d]: stitched vectors (keys pre-RoPE). ``ridge``: lambda as a multiple of
        the mean diagonal of X'X."""
        H, _, d = x.shape
        out = torch.zeros(H, tgt.numel(), d, dtype=x.dtype, device=x.device)
        measured = torch.bincount(self.chunk[src], minlength=self.n_chunks) > 0
        keep = measured[self.chunk[fs]]
        fs, fresh = fs[keep], fresh[:, keep]
        if fs.numel() == 0:
            return out
        x_src = x[:, src]
        X = x[:, fs] - self._spread(x_src, src, fs)
        Y = fresh - x[:, fs] - self._spread(delta, src, fs)
        if ridge:
            A = X.transpose(1, 2) @ X
            lam = ridge * A.diagonal(dim1=1, dim2=2).mean(-1).clamp(min=1e-12)
            A = A + lam[:, None, None] * torch.eye(d, dtype=x.dtype, device=x.device)
            W = torch.linalg.solve(A, X.transpose(1, 2) @ Y)  # [H, d, d]
        else:  # least squares (minimum norm where the fitted tokens do not determine W)
            W = torch.linalg.lstsq(X.cpu(), Y.cpu(), driver="gelsd").solution.to(X.device)
        on = measured[self.chunk[tgt]]
        out[:, on] = (x[:, tgt[on]] - self._spread(x_src, src, tgt[on])) @ W
        return out

    def _spread(self, delta: torch.Tensor, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        """Shifts measured at ``src`` [H, m, d] -> estimated shifts at ``tgt`` [H, t, d]: the mean over the
        target's chunk (``tau`` 0), or weighted by exp(-distance / tau) within it."""
        H, m, d = delta.shape
        out = torch.zeros(H, tgt.numel(), d, dtype=delta.dtype, device=delta.device)
        if m == 0:
            return out
        if not self.tau:
            return self._chunk_mean(delta, src).index_select(1, self.chunk[tgt])
        cs, ct = self.chunk[src], self.chunk[tgt]
        w = torch.exp(-(tgt[:, None] - src[None, :]).abs().to(delta.dtype) / self.tau) * (ct[:, None] == cs[None, :])
        w = w / w.sum(1, keepdim=True).clamp(min=1e-12)  # [t, m]; a chunk with no measured shift: zero
        return torch.einsum("tm,hmd->htd", w, delta)


@register
@dataclass
class DeltaProp(Wrapper):
    name: ClassVar[str] = "deltaprop"
    base: Selector = field(default_factory=Prophet)  # the selection (a method that recomputes a budget)
    alpha_v: float = 1.0  # how much of the measured value shift stale tokens take
    alpha_k: float = 0.25  # ... and of the key shift (pre-RoPE); see the ablation (docs/results/own-method)
    tau: float = 0.0  # 0: chunk mean; > 0: shifts weighted by exp(-distance / tau) within the chunk
    skip_first: int = 0  # leave each chunk's first tokens' shifts out of the estimate
    # > 0: every probe_stride-th token of each chunk is recomputed too (out of the budget) and only these
    # evenly spread tokens measure the shift (the top-scored ones are needles, not typical of their chunk)
    probe_stride: int = 25
    # "mean": every stale token of a chunk takes the chunk's mean shift. "linear": plus a per-token part, linear
    # in how the token's stitched vector departs from the mean of the chunk's measuring tokens (ridge fit on the
    # recomputed tokens; `DeltaCache._linear`)
    fit: Literal["mean", "linear"] = "mean"
    # the linear fit's ridge lambda, a multiple of the mean diagonal of X'X; values need far more shrinkage than
    # keys (stale-token error against full prefill on the tuning split, docs/results/own-method)
    ridge_v: float = 10.0
    ridge_k: float = 0.1
    # "tokens": the base's budget, ratio x n_context tokens. "work": the causal work of those tokens (the base's top
    # ones, probes included) buys the tokens of most score per unit of work (`SelectionContext.token_work`, `spend_work`):
    # an early token attends to fewer keys, so the same time recomputes more tokens, earlier ones
    budget_unit: Literal["tokens", "work"] = "tokens"
    # True: the probes are recomputed in a pass of their own *before* the base scores the context, so the base's
    # selection (prophet: the question's attention) reads keys the probes' shift already corrected; the budget
    # pass then recomputes the probes again with the base's top tokens. Costs one extra pass of the probes (~4% of
    # the context at stride 25). The "re-select after a first recompute" (docs/results/own-method)
    probe_first: bool = False
    # "mean": the base's own score (prophet: the uniform fusion of its layers). "union": tokens by their best rank
    # over the base's layers, the union of every layer's top tokens (module doc); needs a base with per-layer scores
    fusion: Literal["mean", "union"] = "mean"
    # None: recomputed tokens attend to every earlier key. k >= 0: to the shared prefix, their own passage and the k
    # passages of most base score only; the question and decoding still see everything (module doc)
    attend_top: int | None = None

    def __post_init__(self, base_options: dict | None = None):
        super().__post_init__(base_options)  # the base built, every option's type checked
        if self.base.zero_budget:
            raise BadMethodOption(f"deltaprop needs a base that recomputes a budget, got {self.base.name!r}")
        for k in ("alpha_v", "alpha_k", "tau", "ridge_v", "ridge_k"):
            if not getattr(self, k) >= 0:
                raise BadMethodOption(f"deltaprop: {k} must be a number >= 0, got {getattr(self, k)!r}")
        for k in ("skip_first", "probe_stride"):
            if getattr(self, k) < 0:
                raise BadMethodOption(f"deltaprop: {k} must be an integer >= 0, got {getattr(self, k)!r}")
        if self.probe_first and not self.probe_stride:
            raise BadMethodOption("deltaprop: probe_first needs probes (probe_stride > 0)")
        if self.fusion == "union" and not self.base.has_layer_scores():
            raise BadMethodOption(f"deltaprop: fusion=union needs a base with per-layer scores (prophet, infoflow, "
                                  f"qcfuse, or a wrapper over one), got {self.base.spec!r}")
        if self.attend_top is not None and self.attend_top < 0:
            raise BadMethodOption(f"deltaprop: attend_top must be an integer >= 0 or none, got {self.attend_top!r}")

    @property
    def exact_budget(self) -> bool:  # budget_unit="work": the budget's work, in more (or fewer) tokens
        return self.budget_unit == "tokens" and self.base.exact_budget

    def prepare(self, ctx: SelectionContext) -> None:
        self.base.prepare(ctx)  # may reorder the chunks (then ctx.cache is the new stitched cache)
        ctx.cache = DeltaCache(ctx.cache, ctx.layout, ctx.context_rope, float(self.alpha_v),
                               float(self.alpha_k), float(self.tau), self.skip_first, self.fit,
                               float(self.ridge_v), float(self.ridge_k))

    def score(self, ctx: SelectionContext) -> torch.Tensor:
        if self.probe_first and isinstance(ctx.cache, DeltaCache) and ctx.budget > 0:
            dc = ctx.cache
            probes = self._probes(dc, ctx.budget)
            dc.estimate_from = torch.zeros_like(dc.fresh)
            dc.estimate_from[probes.to(dc.fresh.device)] = True
            ctx.recompute(probes)  # probes fresh, every stale token corrected by their shift
        if self.fusion == "union":
            per_layer = self.base.layer_scores(ctx)
            fused = torch.stack([s.float().cpu() for s in per_layer.values()]).mean(0)
            scores = union_scores(list(per_layer.values()), fused)
        else:
            scores = fused = self.base.score(ctx)
        if self.attend_top is not None and isinstance(ctx.cache, DeltaCache):
            ctx.cache.chunk_score = chunk_score(fused, ctx.cache.chunk, ctx.cache.n_chunks)
        return scores

    def recompute_plan(self, ctx: SelectionContext) -> ForwardPlan | None:
        plan = self.base.recompute_plan(ctx)
        scope = self.scope(ctx) if self.attend_top is not None else None
        if scope is None:
            return plan
        return ForwardPlan(scope=scope) if plan is None else dataclasses.replace(plan, scope=scope)

    def scope(self, ctx: SelectionContext) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`ForwardPlan.scope` of ``attend_top`` (None: nothing to limit): segment 0 is the prefix, a pinned system
        segment and the suffix (seen by all, seeing all); passage c is segment c + 1, seeing segment 0, itself and
        the top passages."""
        lay = ctx.layout
        n_chunks, pinned = len(lay.chunk_ids), lay.pinned
        if ctx.budget <= 0 or self.attend_top >= n_chunks - pinned:
            return None  # only the suffix is recomputed, or every passage is in scope
        score = ctx.cache.chunk_score if isinstance(ctx.cache, DeltaCache) else None
        if score is None:  # a full budget skips scoring: the base's scores decide the top passages all the same
            score = chunk_score(self.base.score(ctx).float().cpu(), lay.chunk_index(), n_chunks)
        score = score[pinned:]
        top = (torch.sort(score, descending=True, stable=True).indices[:self.attend_top] + pinned).tolist()
        segment = torch.zeros(lay.n_total, dtype=torch.long)
        chunk = lay.chunk_index()
        segment[lay.context_start:lay.context_end] = torch.where(chunk < pinned, 0, chunk + 1)
        sees = torch.eye(n_chunks + 1, dtype=torch.bool)
        sees[0, :] = sees[:, 0] = True
        sees[:, [c + 1 for c in top]] = True
        ctx.stats["attend_top_chunks"] = [lay.order[c] for c in sorted(top)]
        return segment.to(ctx.device), sees.to(ctx.device)

    def _probes(self, dc: DeltaCache, budget: int) -> torch.Tensor:
        """Every probe_stride-th token of each chunk (its middle one first), at most ``budget`` of them."""
        return (dc.offset.cpu() % self.probe_stride == self.probe_stride // 2).nonzero().flatten()[:budget]

    def pick(self, scores: torch.Tensor, ctx: SelectionContext) -> torch.Tensor:
        if not self.probe_stride or not isinstance(ctx.cache, DeltaCache):
            idx = self.base.pick(scores, ctx)
        else:
            dc = ctx.cache
            probes = self._probes(dc, ctx.budget)
            scores = scores.clone()
            scores[probes] = float("inf")  # the probes first, then the base's own pick fills the budget
            idx = self.base.pick(scores, ctx)
            dc.estimate_from = torch.zeros_like(dc.fresh)
            dc.estimate_from[probes.to(dc.fresh.device)] = True
        if self.budget_unit == "work":
            idx = spend_work(scores, idx, ctx.token_work())
        return idx


def union_scores(per_layer: list[torch.Tensor], fused: torch.Tensor) -> torch.Tensor:
    """``fusion="union"``: per-layer scores (each [n]) -> scores [n] whose top k are the tokens of best rank over
    the layers (rank 0 = a layer's top token; ties by ``fused``, then position): the union of every layer's top r
    tokens, r as large as k allows. Scores are n - place in that order (exact integers in float32)."""
    n = fused.numel()
    best = torch.stack([_ranks(s.float().cpu()) for s in per_layer]).amin(0)
    order = torch.argsort(best * n + _ranks(fused.float().cpu()))  # distinct keys: fused ranks are distinct
    out = torch.empty(n)
    out[order] = torch.arange(n, 0, -1, dtype=torch.float32)
    return out


def _ranks(scores: torch.Tensor) -> torch.Tensor:
    """[n] -> each token's place in the descending order (ties by position), int64."""
    order = torch.sort(scores, descending=True, stable=True).indices
    ranks = torch.empty_like(order)
    ranks[order] = torch.arange(order.numel())
    return ranks


def chunk_score(scores: torch.Tensor, chunk: torch.Tensor, n_chunks: int) -> torch.Tensor:
    """[n_chunks] float64: each passage's sum of the base's token scores (shifted to be >= 0), ``attend_top``'s
    ranking of passages."""
    s = scores.double().cpu()
    s = torch.where(torch.isfinite(s), s, torch.zeros_like(s))
    s = s - s.min().clamp(max=0)
    return torch.zeros(n_chunks, dtype=torch.float64).index_add_(0, chunk.cpu(), s)


def spend_work(scores: torch.Tensor, chosen: torch.Tensor, work: torch.Tensor) -> torch.Tensor:
    """The tokens to recompute for the work of ``chosen`` (sorted indices): greedily by score per unit of work
    (``work`` [n]: each token's cost; scores shifted to be >= 0, +inf first, ties by position) while the total
    stays within ``chosen``'s. -> sorted indices. Cheap (early) tokens of fair score displace expensive ones of
    slightly higher score, and the work left over buys more of them."""
    s = scores.double()
    finite = s[torch.isfinite(s)]
    if finite.numel():
        s = s - finite.min()
    order = torch.sort(s / work, descending=True, stable=True).indices
    take = order[work[order].cumsum(0) <= float(work[chosen].sum()) * (1 + 1e-12)]
    return take.sort().values
