"""Simulate request routing over N kvstitch replicas (`kvstitch.route`): chunk affinity against round-robin,
power-of-two choices, prefix affinity and one ideal shared memory, at several replica counts. Costs per token
come from docs/results (bench_store.json and a bench_ttft table). Writes sim.md, sim.json and sim.png
(`kvstitch bench route` runs the same with fewer options):

    .venv/bin/python scripts/route_sim.py --out docs/results/routing
    .venv/bin/python scripts/route_sim.py --replicas 8 --no-variations --mix 0 --out /tmp/routing
    .venv/bin/python scripts/route_sim.py --tier-policy mypkg.policies:S3FIFO --out /tmp/routing-s3fifo
"""

from __future__ import annotations

import argparse
import importlib
import shlex
import sys
from pathlib import Path

from kvstitch.route.costs import MODEL_SHAPES
from kvstitch.route.report import simulate_and_write, sweep_of
from kvstitch.route.tier import LRU

ROOT = Path(__file__).resolve().parents[1]


def load_policy(spec: str | None):
    """`module:Class` -> a zero-argument factory of eviction policy objects (admit / lookup / evict)."""
    if not spec:
        return LRU
    module, _, name = spec.partition(":")
    if not name:
        raise SystemExit(f"--tier-policy takes module:Class, got {spec!r}")
    return getattr(importlib.import_module(module), name)


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", default="8,64,256", help="comma-separated replica counts (2-256)")
    p.add_argument("--tier-tokens", type=int, default=65_536, help="memory tier per replica, tokens")
    p.add_argument("--docs-per-replica", type=int, default=50, help="popular documents per replica")
    p.add_argument("--requests-per-replica", type=int, default=400)
    p.add_argument("--utilization", type=float, default=0.7, help="request rate / service capacity")
    p.add_argument("--k", type=int, default=5, help="passages per request")
    p.add_argument("--mix", type=float, default=0.2, help="share of a request's passages from another document")
    p.add_argument("--novel-share", type=float, default=0.1, help="share of requests about a one-off document")
    p.add_argument("--zipf", type=float, default=1.0, help="Zipf exponent of document popularity")
    p.add_argument("--lam", type=float, default=0.5, help="chunk affinity: a queued request's weight")
    p.add_argument("--model", choices=sorted(MODEL_SHAPES), default="qwen2.5-0.5b", help="K/V size and costs")
    p.add_argument("--tier-policy", help="eviction policy module:Class (default LRU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-variations", action="store_true", help="skip the one-knob variations")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--results", type=Path, default=ROOT / "docs" / "results", help="where the benchmarks are")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "routing")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> list[Path]:
    argv = sys.argv[1:] if argv is None else argv
    a = parse(argv)
    try:
        sweep = sweep_of(a.replicas.split(","), a.tier_tokens, a.docs_per_replica, a.requests_per_replica,
                         a.utilization, a.seed, a.lam, not a.no_variations,
                         k=a.k, mix=a.mix, novel_share=a.novel_share, zipf_s=a.zipf)
    except ValueError as e:
        raise SystemExit(f"--replicas: {e}") from None
    command = " ".join([".venv/bin/python scripts/route_sim.py", *map(shlex.quote, argv)])
    return simulate_and_write(sweep, a.model, a.results, a.out, command, load_policy(a.tier_policy),
                              with_plot=not a.no_plot)


if __name__ == "__main__":
    main()
