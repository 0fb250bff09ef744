"""The adaptive policy against every static policy, on every reuse shape and capacity.

For each trace (the four generated shapes of `kvoffload.bench.tracegen` and, when given,
a Mooncake-format trace file) and each capacity, replays every registered policy through
`CpuBlockPool` (`kvoffload.replay.replay_pool`) and prints a Markdown table: the static
policies' hit rates, the best of them, the adaptive policy's, its distance to the best
static policy and to LRU, and whether it meets its target (at most ``--tolerance`` below
the best static policy and below LRU). Exits 1 if any row misses the target.

Usage:
    .venv/bin/python scripts/adaptive_grid.py [--trace ../shared/traces/synthetic_trace.jsonl]
        [--capacity 500,750,1000,...,40000] [--requests 4000] [--tolerance 0.005]
"""

from __future__ import annotations

import argparse
import sys

from kvoffload.bench.tracegen import SHAPES, generate
from kvoffload.pool.policies import STATIC_POLICY_NAMES
from kvoffload.replay import Trace, load_trace, replay_pool

CAPACITIES = "500,750,1000,1500,2000,3000,4000,6000,8000,10000,15000,20000,30000,40000"
"""The default capacities: 500 to 40,000 blocks, about 1.5 times apart."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", action="append", default=[], help="a Mooncake-format trace")
    parser.add_argument("--capacity", default=CAPACITIES)
    parser.add_argument("--requests", type=int, default=4000, help="requests per shape")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--tolerance", type=float, default=0.005)
    args = parser.parse_args(argv)
    capacities = [int(c) for c in args.capacity.split(",")]
    traces: list[tuple[str, Trace]] = [
        (s, Trace("", tuple(tuple(r) for r in generate(s, args.requests))))
        for s in args.shapes.split(",")
        if s
    ]
    traces += [(path.rsplit("/", 1)[-1], load_trace(path)) for path in args.trace]
    statics = list(STATIC_POLICY_NAMES)
    print(
        "| trace | capacity | "
        + " | ".join(statics)
        + " | best static | adaptive | vs best | vs lru | target |"
    )
    print("|---|---:|" + "---:|" * (len(statics) + 4) + "---|")
    missed = 0
    for name, trace in traces:
        for capacity in capacities:
            rates = {p: replay_pool(trace, capacity, p).hit_rate for p in statics}
            best = max(rates, key=rates.__getitem__)
            adaptive = replay_pool(trace, capacity, "adaptive").hit_rate
            vs_best = adaptive - rates[best]
            vs_lru = adaptive - rates["lru"]
            ok = vs_best >= -args.tolerance and vs_lru >= -args.tolerance
            missed += not ok
            cells = " | ".join(f"{rates[p]:.4f}" for p in statics)
            print(
                f"| {name} | {capacity:,} | {cells} | {rates[best]:.4f} ({best}) | "
                f"{adaptive:.4f} | {vs_best:+.4f} | {vs_lru:+.4f} | {'met' if ok else 'missed'} |",
                flush=True,
            )
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
