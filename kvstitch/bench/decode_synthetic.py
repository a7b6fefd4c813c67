"""Synthetic decode bench: attention recall (PRKV Eq. 3) and attend latency of every policy, in one run.

The K/V stream imitates what makes long-context decode attention hard for page selection:

- topic segments (32-256 tokens) whose keys share a direction, so pages are semantically coherent;
- a few heavy-hitter directions that a sparse set of tokens carries strongly;
- attention sinks (the first tokens) that every query attends to;
- two planted "needles" (4-token spans): the queries look for needle A during the first 3/8 of the
  decode, then for needle B; the observation window of the prompt looks for A. A static set chosen
  at prefill misses B until its next refresh, page-level bounds blur single heavy tokens;
- generated tokens share an "answer" topic that the queries also carry (locality).

`bench_policies_synthetic` decodes the same stream twice per budget with every policy in lockstep
(alternating call by call, so a busy machine slows all alike): once in diagnostic mode for recall,
once without for the per-step attend latency, reported as a ratio to `dense` from the same pass.
Run ``python -m kvstitch.bench.decode_synthetic`` for the default table (8192 context, budgets 256/512/1024).
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvstitch.decode.decoder import SparseDecoder, make_decoder
from kvstitch.decode.recall import decode_step_attention_recall

POLICIES = ("dense", "snapkv", "quest", "arkvale", "prkv")


@dataclass
class SyntheticStream:
    """Prefill K/V and per-step decode inputs for every layer (one sequence)."""

    prefill_keys: list[torch.Tensor]     # per layer [Hkv, n, D]
    prefill_values: list[torch.Tensor]
    obs_queries: list[torch.Tensor]      # per layer [Hq, w, D]
    step_keys: torch.Tensor              # [steps, L, Hkv, 1, D]
    step_values: torch.Tensor
    step_queries: torch.Tensor           # [steps, L, Hq, 1, D]
    needles: tuple[int, int]
    scaling: float


def _unit(g: torch.Generator, *shape: int) -> torch.Tensor:
    x = torch.randn(*shape, generator=g)
    return x / x.norm(dim=-1, keepdim=True)


def synthetic_stream(context: int, steps: int, *, num_layers: int = 2, num_q_heads: int = 8,
                     num_kv_heads: int = 2, head_dim: int = 64, obs_window: int = 64,
                     switch_at: float = 3 / 8, seed: int = 0) -> SyntheticStream:
    """Build the stream described in the module docstring (deterministic for a seed)."""
    g = torch.Generator().manual_seed(seed)
    H, G, D, w = num_kv_heads, num_q_heads // num_kv_heads, head_dim, obs_window
    total = context + steps
    needles = (int(0.3 * context), int(0.65 * context))
    keys_l, values_l, obs_l, sk, sv, sq = [], [], [], [], [], []
    for _ in range(num_layers):
        keys = torch.randn(H, total, D, generator=g)
        # topic segments: one direction per segment, shared by its tokens
        bounds = [0]
        while bounds[-1] < context:
            bounds.append(min(context, bounds[-1] + int(torch.randint(32, 257, (1,), generator=g))))
        topics = _unit(g, H, len(bounds) - 1, D)
        for s, (a, b) in enumerate(zip(bounds, bounds[1:])):
            keys[:, a:b] += 2.0 * topics[:, s : s + 1]
        # heavy hitters: 0.5% of the prompt tokens carry one of 4 directions strongly
        hh_dirs = _unit(g, H, 4, D)
        hh_tok = torch.randperm(context, generator=g)[: max(1, context // 200)]
        hh_which = torch.randint(0, 4, (hh_tok.numel(),), generator=g)
        keys[:, hh_tok] += 5.0 * hh_dirs[:, hh_which]
        sink = _unit(g, H, 1, D)
        keys[:, :4] += 10.0 * sink
        needle_dirs = _unit(g, H, 2, D)
        for i, pos in enumerate(needles):
            keys[:, pos : pos + 4] += 7.0 * needle_dirs[:, i : i + 1]
        answer = _unit(g, H, 1, D)
        keys[:, context:] += 4.0 * answer
        values = torch.randn(H, total, D, generator=g)

        def query(focus: int, noise: torch.Tensor) -> torch.Tensor:
            """Queries [H, G, D]: the focused needle (and its segment), sinks, answer topic, heavy hitters."""
            pos = needles[focus]
            seg = max(i for i, b in enumerate(bounds[:-1]) if b <= pos)
            hh = torch.randn(H, G, 4, 1, generator=g) * 0.6
            return (8.0 * needle_dirs[:, focus : focus + 1] + 3.0 * topics[:, seg : seg + 1] + 5.0 * sink
                    + 4.0 * answer + (hh * hh_dirs.unsqueeze(1)).sum(2) + noise)

        walk = torch.randn(H, G, D, generator=g)
        obs = []
        for _ in range(w):  # prompt observation window: looks for needle A
            walk = 0.9 * walk + 0.45 * torch.randn(H, G, D, generator=g)
            obs.append(query(0, walk))
        qs = []
        for t in range(steps):
            walk = 0.9 * walk + 0.45 * torch.randn(H, G, D, generator=g)
            qs.append(query(0 if t < switch_at * steps else 1, walk))
        keys_l.append(keys[:, :context].clone())
        values_l.append(values[:, :context].clone())
        obs_l.append(torch.stack(obs, dim=2).reshape(H * G, w, D))
        sk.append(keys[:, context:].transpose(0, 1).unsqueeze(2))     # [steps, H, 1, D]
        sv.append(values[:, context:].transpose(0, 1).unsqueeze(2))
        sq.append(torch.stack(qs).reshape(steps, H * G, 1, D))
    return SyntheticStream(keys_l, values_l, obs_l, torch.stack(sk, 1), torch.stack(sv, 1), torch.stack(sq, 1),
                           needles, D ** -0.5)


def _prefilled(stream: SyntheticStream, policy: str, budget: int, page_size: int, device,
               policy_kwargs: dict) -> SparseDecoder:
    steps, L, Hq = stream.step_queries.shape[:3]
    H, _, D = stream.prefill_keys[0].shape
    dec = make_decoder(policy, budget, num_layers=L, num_q_heads=Hq, num_kv_heads=H, head_dim=D,
                       page_size=page_size, device=device, **policy_kwargs.get(policy, {}))
    for layer in range(L):
        dec.load_prefill(layer, stream.prefill_keys[layer].to(device), stream.prefill_values[layer].to(device),
                         stream.obs_queries[layer].to(device), scaling=stream.scaling)
    return dec


def _lockstep(stream: SyntheticStream, decoders: dict[str, SparseDecoder], device,
              sdpa: bool = False) -> dict[str, list[float]]:
    """Decode the stream with every decoder in lockstep, alternating them call by call so that machine
    noise hits all alike; returns each decoder's per-step attend seconds (all layers). ``sdpa`` also
    times torch's dense SDPA over a contiguous token-order cache (key ``"sdpa"``): the unpaged baseline."""
    steps, L = stream.step_queries.shape[:2]
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    times = {name: [0.0] * steps for name in (*decoders, *(["sdpa"] if sdpa else []))}
    caches = [(torch.cat([stream.prefill_keys[i], stream.step_keys[:, i, :, 0].transpose(0, 1)], 1).to(device),
               torch.cat([stream.prefill_values[i], stream.step_values[:, i, :, 0].transpose(0, 1)], 1).to(device))
              for i in range(L)] if sdpa else []

    def timed(name, fn):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times[name][t] += time.perf_counter() - t0

    for t in range(steps):
        for layer in range(L):
            k, v = stream.step_keys[t, layer].to(device), stream.step_values[t, layer].to(device)
            q = stream.step_queries[t, layer].to(device)
            for name, dec in decoders.items():
                dec.append(layer, k, v)
                timed(name, lambda: dec.attend(layer, q, stream.scaling))
            if sdpa:
                n = stream.prefill_keys[layer].shape[1] + t + 1
                keys, values = (c[None, :, :n] for c in caches[layer])
                timed("sdpa", lambda: F.scaled_dot_product_attention(q[None], keys, values, scale=stream.scaling,
                                                                     enable_gqa=True))
        for dec in decoders.values():
            dec.end_step()
    return times


def bench_policies_synthetic(context: int = 8192, budgets=(256, 512, 1024), policies=POLICIES, *,
                             steps: int = 256, num_layers: int = 2, num_q_heads: int = 8, num_kv_heads: int = 2,
                             head_dim: int = 64, page_size: int = 32, obs_window: int = 64, seed: int = 0,
                             warmup: int = 8, device="cpu", policy_kwargs: dict | None = None,
                             recall: bool = True) -> list[dict]:
    """Recall and attend latency for every (policy, budget) on one synthetic stream.

    Per budget, two lockstep passes over the same stream: a diagnostic one (recall) and a timed one
    (``dense`` always runs in it, so latency ratios come from the same run). One row per (policy, budget):
    ``recall`` (mean over steps, layers, query heads), ``oracle_recall`` (ground-truth top-k with as many
    tokens), ``recall_min``, ``recall_after_switch`` (steps looking for needle B), ``attend_ms`` (median
    per step over all layers, after ``warmup`` steps), ``latency_vs_full``, ``latency_vs_sdpa`` (torch SDPA
    over a contiguous, unpaged cache: what a gather-free paged kernel would approach), ``pages_copied_per_step``,
    ``mean_selected_tokens`` and ``max_abs_err_vs_dense``. ``recall=False`` skips the diagnostic pass
    (recall columns are nan): a quicker latency-only run.
    """
    policy_kwargs = policy_kwargs or {}
    stream = synthetic_stream(context, steps, num_layers=num_layers, num_q_heads=num_q_heads,
                              num_kv_heads=num_kv_heads, head_dim=head_dim, obs_window=obs_window, seed=seed)
    switch = math.ceil(3 / 8 * steps)
    timed_policies = dict.fromkeys(("dense", *policies))
    rows = []
    for budget in budgets:
        timed = {p: _prefilled(stream, p, budget, page_size, device, policy_kwargs) for p in timed_policies}
        times = _lockstep(stream, timed, device, sdpa=True)
        full_ms, sdpa_ms = (1e3 * statistics.median(times[name][warmup:]) for name in ("dense", "sdpa"))
        decoders = {p: timed[p] for p in policies}
        if recall:
            decoders = {p: _prefilled(stream, p, budget, page_size, device, policy_kwargs) for p in policies}
            for dec in decoders.values():
                dec.diagnostic = True
            _lockstep(stream, decoders, device)
        for policy, dec in decoders.items():
            stats, per_step = dec.stats(), decode_step_attention_recall(dec)  # [steps, L, Hq]
            attend_ms = 1e3 * statistics.median(times[policy][warmup:])
            rows.append({
                "policy": policy, "budget": budget, "context": context,
                "recall": stats.get("recall", math.nan), "oracle_recall": stats.get("oracle_recall", math.nan),
                "recall_min": stats.get("recall_min", math.nan),
                "recall_after_switch": per_step[switch:].mean().item() if per_step.numel() else math.nan,
                "attend_ms": attend_ms, "latency_vs_full": attend_ms / full_ms,
                "latency_vs_sdpa": attend_ms / sdpa_ms,
                "pages_copied_per_step": stats["pages_copied"] / steps,
                "mean_selected_tokens": stats["mean_selected_tokens"],
                "max_abs_err_vs_dense": stats.get("max_abs_err_vs_dense", math.nan),
            })
    return rows


_COLUMNS = (  # (title, row key, width, format)
    ("budget", "budget", 6, "d"), ("policy", "policy", 8, "s"),
    ("recall", "recall", 7, ".3f"), ("oracle", "oracle_recall", 7, ".3f"), ("min", "recall_min", 6, ".3f"),
    ("after B", "recall_after_switch", 7, ".3f"), ("attend ms", "attend_ms", 9, ".3f"),
    ("vs full", "latency_vs_full", 7, ".2f"), ("vs sdpa", "latency_vs_sdpa", 7, ".2f"),
    ("pages/step", "pages_copied_per_step", 10, ".1f"), ("tokens", "mean_selected_tokens", 7, ".0f"),
)


def format_table(rows: list[dict]) -> str:
    """A plain-text table of `bench_policies_synthetic` rows."""
    lines = [" ".join(f"{title:>{width}}" for title, _, width, _ in _COLUMNS)]
    lines += [" ".join(f"{r[key]:>{width}{fmt}}" for _, key, width, fmt in _COLUMNS) for r in rows]
    return "\n".join(lines)


if __name__ == "__main__":
    torch.set_num_threads(1)  # steadier timings on a small shared machine; every policy runs alike
    print(format_table(bench_policies_synthetic()))
