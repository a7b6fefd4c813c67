"""The trace, the memory sizing and the report of `kvstitch bench replicas` (no Ray here: tested without a cluster).

The trace is the routing simulator's (`kvstitch.route.trace.make_trace`: Zipf-popular documents, a request's
passages mostly of its topic document, some of others) over real text: SQuAD v1.1 dev articles as documents,
their paragraphs of ~100-200 tokens as passages, each request a SQuAD question of its first passage over
its passages as inline ``documents``. Its working set is every distinct passage it names; each replica's
memory tier is sized to ``share`` of that working set's K/V bytes (plus the system segment every request
shares), so what a replica keeps local depends on which requests the router sends it.

A replica's answer says, per chunk, where its cache came from (``kvstitch.chunk_sources``: its memory tier,
the shared store behind it, or computed); segment 0 is the system prompt, the rest are the passages. The
local hit rate is the passages found in the answering replica's memory tier over all passages requested.
"""

from __future__ import annotations

import math
import random
import statistics
from collections import Counter

from kvstitch.core.errors import InputError

SYSTEM = "Answer the question from the passages in a few words."
PASSAGE_WORDS = (60, 150)  # words per passage: about 100-200 tokens
TIER_SHARE = 1 / 3  # of the working set, in each replica's memory tier
MAX_SPREAD = 1.25  # max/mean requests per replica the acceptance allows
MIN_RATIO = 2.0  # affinity's local hit rate over the default router's


def squad_pool(n_docs: int, per_doc: int, seed: int = 0) -> list[list[tuple[str, tuple[str, ...]]]]:
    """``n_docs`` SQuAD articles (a seeded draw among those with ``per_doc`` paragraphs of `PASSAGE_WORDS` words
    that have questions), each as its first ``per_doc`` such paragraphs with their questions."""
    from kvstitch.tasks.squad import read_squad

    squad = read_squad("squad")
    questions: dict[tuple[int, int], list[str]] = {}
    for q in squad.questions:
        questions.setdefault((q.article, q.paragraph), []).append(q.text)
    docs = []
    for a, paragraphs in enumerate(squad.articles):
        keep = [(p, tuple(sorted(questions[(a, i)]))) for i, p in enumerate(paragraphs)
                if PASSAGE_WORDS[0] <= len(p.split()) <= PASSAGE_WORDS[1] and (a, i) in questions]
        if len(keep) >= per_doc:
            docs.append(keep[:per_doc])
    if len(docs) < n_docs:
        raise InputError(f"--docs: SQuAD has {len(docs)} articles of {per_doc} short passages, asked for {n_docs}")
    return random.Random(seed).sample(docs, n_docs)


def trace_bodies(pool, n_requests: int, k: int, zipf: float, seed: int = 0, max_tokens: int = 16,
                 mix: float = 0.2) -> list[dict]:
    """The chat request bodies of the trace (the same for the same arguments)."""
    from kvstitch.route.trace import TraceConfig, make_trace

    per_doc = len(pool[0])
    if not 1 <= k <= per_doc:
        raise InputError(f"--passages-per-request must be in [1, {per_doc}] (passages per document), got {k}")
    cfg = TraceConfig(n_requests=n_requests, n_docs=len(pool), zipf_s=zipf, passages=(per_doc, per_doc), k=k,
                      mix=mix, novel_share=0.0, seed=seed)
    rng = random.Random(seed)
    bodies = []
    for req in make_trace(cfg):
        where = [(int(d[1:]), int(i)) for d, i in (key.split(":") for key, _ in req.chunks)]
        question = rng.choice(pool[where[0][0]][where[0][1]][1])
        bodies.append({"model": "bench", "messages": [{"role": "system", "content": SYSTEM},
                                                      {"role": "user", "content": question}],
                       "documents": [pool[d][i][0] for d, i in where], "max_tokens": max_tokens, "temperature": 0})
    return bodies


def working_set(bodies: list[dict], tokens_of) -> dict:
    """The distinct passages of the trace and their tokens (``tokens_of(text)``: a passage's chunk tokens)."""
    distinct = {p for b in bodies for p in b["documents"]}
    return {"passages": len(distinct), "tokens": sum(tokens_of(p) for p in distinct)}


def token_bytes(num_layers: int, num_kv_heads: int, head_dim: int, element_bytes: int) -> int:
    """One token of a chunk cache in memory: K and V of every layer, plus its token id (int64)."""
    return num_layers * 2 * num_kv_heads * head_dim * element_bytes + 8


def tier_bytes(working_tokens: int, per_token: int, share: float = TIER_SHARE, reserve_tokens: int = 0) -> int:
    """A memory tier of ``share`` of the working set, plus ``reserve_tokens`` (the system segment)."""
    return int(math.ceil(working_tokens * share)) * per_token + reserve_tokens * per_token


def ideal_hit_rate(bodies: list[dict], tokens_of, per_token: int, capacity: int) -> float:
    """The local hit rate of one shared memory tier of ``capacity`` bytes (all the replicas' together, the same
    S3-FIFO policy) over the trace's passages: no routing, nothing held twice. The reference a router's local
    hit rate is read against: the most any router could keep in memory with that much of it."""
    from kvstitch.store.policy import make_policy

    tier = make_policy("s3fifo", capacity)
    size = {}
    hits = looked = 0
    for body in bodies:
        for p in body["documents"]:
            looked += 1
            if p in tier:
                hits += 1
                tier.touch(p)
                continue
            size.setdefault(p, tokens_of(p) * per_token)
            tier.admit(p, size[p])
            tier.evict(capacity, keep=p)
    return hits / looked if looked else 0.0


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def router_row(router: str, results: list[dict | None], reference: list[str | None], replicas: int) -> dict:
    """One router's measurements; ``results[i]``: request i's answer (None: not sent before the deadline)."""
    ok = [(i, r) for i, r in enumerate(results) if r and r.get("status") == 200]
    sources = Counter(s for _, r in ok for s in (r.get("chunk_sources") or [])[1:])
    looked = sum(sources.values())
    per = Counter(r.get("replica") for _, r in ok)
    mean = len(ok) / replicas if replicas else 0.0
    ttft = [r["ttft_s"] for _, r in ok if r.get("ttft_s") is not None]
    differ = [i for i, r in ok if r.get("text") != reference[i]]
    return {"router": router, "requests": len(results), "sent": sum(r is not None for r in results),
            "answered": len(ok), "passages": looked,
            "local_hits": sources["memory"], "shared_hits": sources["store"], "computed": sources["computed"],
            "local_hit_rate": sources["memory"] / looked if looked else 0.0,
            "ttft_p50_s": _pct(ttft, 0.5), "ttft_p95_s": _pct(ttft, 0.95),
            "ttft_mean_s": statistics.fmean(ttft) if ttft else None,
            "server_ttft_p50_s": _pct([r["server_ttft_s"] for _, r in ok if r.get("server_ttft_s") is not None], 0.5),
            "per_replica": dict(sorted(per.items(), key=lambda kv: str(kv[0]))),
            "max_over_mean": max(per.values()) / mean if per and mean else None,
            "answers_equal": not differ and len(ok) == len(results), "differ": differ}


def verdict(rows: list[dict]) -> dict:
    """The acceptance checks: affinity against the default router."""
    by = {r["router"]: r for r in rows}
    aff, base = by.get("chunk-affinity"), by.get("default")
    if aff is None or base is None:
        return {}
    ratio = aff["local_hit_rate"] / base["local_hit_rate"] if base["local_hit_rate"] else math.inf
    ttft_ok = None if aff["ttft_p50_s"] is None or base["ttft_p50_s"] is None else \
        aff["ttft_p50_s"] <= base["ttft_p50_s"]
    spread = aff["max_over_mean"]
    return {"hit_rate_ratio": ratio, "ratio_ok": ratio >= MIN_RATIO, "ttft_p50_ok": ttft_ok,
            "spread_ok": spread is not None and spread <= MAX_SPREAD,
            "answers_equal": all(r["answers_equal"] for r in rows)}


def _fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def replicas_table(rows: list[dict], meta: dict) -> str:
    """The markdown table, a line of the checks under it."""
    lines = ["| router | requests | answered | local hit rate | shared-store hits | computed | TTFT p50 (s) | "
             "TTFT p95 (s) | server TTFT p50 (s) | requests per replica | max/mean | equal to one server |",
             "|" + "---|" * 12]
    for r in rows:
        eq = "yes" if r["answers_equal"] else f"no ({len(r['differ'])} differ, {r['requests'] - r['answered']} lost)"
        lines.append(f"| {r['router']} | {r['requests']} | {r['answered']} | {r['local_hit_rate']:.1%} "
                     f"({r['local_hits']}/{r['passages']}) | {r['shared_hits']} | {r['computed']} | "
                     f"{_fmt(r['ttft_p50_s'], '.3f')} | {_fmt(r['ttft_p95_s'], '.3f')} | "
                     f"{_fmt(r['server_ttft_p50_s'], '.3f')} | {', '.join(map(str, r['per_replica'].values()))} | "
                     f"{_fmt(r['max_over_mean'], '.2f')} | {eq} |")
    ideal = meta.get("ideal_hit_rate")
    if ideal:
        lines.append(f"| ideal: one shared memory of {meta.get('replicas')} tiers | | | {ideal:.1%} | | | | | | | | |")
    v = meta.get("verdict") or {}
    if v:
        yes = lambda ok: "-" if ok is None else ("yes" if ok else "NO")  # noqa: E731
        lines.append("")
        lines.append(f"affinity / default local hit rate: {v['hit_rate_ratio']:.2f}x (>= {MIN_RATIO:g}: "
                     f"{yes(v['ratio_ok'])}); p50 TTFT no worse: {yes(v['ttft_p50_ok'])}; affinity max/mean <= "
                     f"{MAX_SPREAD:g}: {yes(v['spread_ok'])}; every answer equal to one server: "
                     f"{yes(v['answers_equal'])}")
        by = {r["router"]: r["local_hit_rate"] for r in rows}
        if ideal and by.get("default"):
            lines.append("of the ideal's local hit rate: " + ", ".join(f"{k} {x / ideal:.2f}" for k, x in by.items())
                         + f"; the ideal over the default router: {ideal / by['default']:.2f}x")
    lines.append("")
    lines.append(f"{meta.get('model')}, {meta.get('replicas')} replicas x {meta.get('threads')} thread(s); "
                 f"{meta.get('requests')} requests over {meta.get('working_set_passages')} passages "
                 f"({meta.get('working_set_tokens')} tokens, {meta.get('working_set_bytes', 0) / 2**20:.1f} MiB of "
                 f"K/V); memory tier {meta.get('memory_bytes', 0) / 2**20:.1f} MiB per replica "
                 f"({meta.get('tier_share', TIER_SHARE):.2f} of the working set)")
    return "\n".join(lines)
