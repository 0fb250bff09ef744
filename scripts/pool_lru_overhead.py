"""Side-by-side speed of CpuBlockPool (LRU) at a git ref and in the working tree.

Loads ``kvoffload/pool/block_pool.py`` as it was at ``REF`` into a private module and
replays the trace through both pools alternately (``python -m kvoffload.bench pool``'s
replay), then prints the median block-ops/s of each and their ratio.

Usage:
    .venv/bin/python scripts/pool_lru_overhead.py REF TRACE [--capacity 1,2,3] [--runs 7]
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvoffload.bench.pool import load_trace_keys, replay
from kvoffload.pool.block_pool import CpuBlockPool


def old_pool_class(ref: str) -> type:
    source = subprocess.run(
        ["git", "show", f"{ref}:kvoffload/pool/block_pool.py"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    path = Path(tempfile.mkdtemp()) / "old_block_pool.py"
    path.write_text(source, encoding="utf-8")
    spec = importlib.util.spec_from_file_location("old_block_pool", path)
    if spec is None or spec.loader is None:
        raise RuntimeError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    cls: type = module.CpuBlockPool
    return cls


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("ref")
    parser.add_argument("trace", type=Path)
    parser.add_argument("--capacity", default="1000,6000,20000")
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    old_cls = old_pool_class(args.ref)
    requests = load_trace_keys(args.trace)
    print(f"ratio = working tree / {args.ref}, median of {args.runs} alternating runs")
    print("paired = median over runs of (new / old) within each back-to-back pair")
    print(f"{'capacity':>9} {'old Mops/s':>10} {'new Mops/s':>10} {'ratio':>6} {'paired':>7}")
    for capacity in [int(c) for c in args.capacity.split(",")]:
        speeds: dict[str, list[float]] = {"old": [], "new": []}
        pair = [("old", old_cls), ("new", CpuBlockPool)]
        for run in range(args.runs):
            for name, cls in pair if run % 2 == 0 else pair[::-1]:  # no first-mover bias
                pool = cls(capacity)
                gc.collect()
                gc.disable()
                start = time.perf_counter()
                counts = replay(pool, requests)
                seconds = time.perf_counter() - start
                gc.enable()
                speeds[name].append(counts.block_ops / seconds / 1e6)
        old, new = statistics.median(speeds["old"]), statistics.median(speeds["new"])
        paired = statistics.median(n / o for o, n in zip(speeds["old"], speeds["new"], strict=True))
        print(f"{capacity:>9,} {old:>10.2f} {new:>10.2f} {new / old:>6.3f} {paired:>7.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
