"""Instructions the LRU pool executes, at a git ref and in the working tree (callgrind).

Timings on a shared VM move by ±10 % between identical runs; the number of machine
instructions a replay executes does not. For each capacity this runs three processes under
``valgrind --tool=callgrind``: one that only imports and loads both pools, one that replays
the first ``--requests`` requests of the trace ``--repeat`` times through the pool at
``REF``, and one through the working tree's pool. The replay's instructions are each
process's count minus the first's; the ratio is new over old (1.00 = the same work).

Usage:
    .venv/bin/python scripts/pool_lru_instructions.py REF TRACE [--capacity 1000,20000]
        [--requests 1500] [--repeat 3]

Needs valgrind (``apt-get install valgrind``).
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from pool_lru_overhead import old_pool_class

from kvoffload.bench.pool import load_trace_keys, replay
from kvoffload.pool.block_pool import CpuBlockPool


def child(ref: str, trace: Path, which: str, *, capacity: int, requests: int, repeat: int) -> None:
    old = old_pool_class(ref)
    keys = load_trace_keys(trace)[:requests]
    cls = old if which == "old" else CpuBlockPool
    if which != "none":
        for _ in range(repeat):
            replay(cls(capacity), keys)


def count(argv: list[str]) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        out = subprocess.run(
            [
                "valgrind",
                "--tool=callgrind",
                f"--callgrind-out-file={tmp}/cg.out",
                sys.executable,
                *argv,
            ],
            check=True,
            capture_output=True,
            text=True,
        )
    found = re.search(r"Collected : (\d+)", out.stderr)
    if found is None:
        raise RuntimeError(f"no instruction count in valgrind's output:\n{out.stderr[-2000:]}")
    return int(found.group(1))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("ref")
    parser.add_argument("trace", type=Path)
    parser.add_argument("--capacity", default="1000,20000")
    parser.add_argument("--requests", type=int, default=1500)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--child", nargs=2, metavar=("WHICH", "CAPACITY"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        which, capacity = args.child
        child(
            args.ref,
            args.trace,
            which,
            capacity=int(capacity),
            requests=args.requests,
            repeat=args.repeat,
        )
        return 0
    if shutil.which("valgrind") is None:
        print("valgrind is not installed (apt-get install valgrind)", file=sys.stderr)
        return 2
    print(f"replay instructions, {args.requests} requests x {args.repeat}; ratio = new / old")
    print(f"{'capacity':>9} {'old (M)':>10} {'new (M)':>10} {'ratio':>6}")
    for capacity in (int(c) for c in args.capacity.split(",")):
        base = [__file__, args.ref, str(args.trace), "--requests", str(args.requests)]
        base += ["--repeat", str(args.repeat), "--child"]
        # Once outside valgrind first, so that no run counts the compiling of a .pyc file.
        subprocess.run([sys.executable, *base, "none", str(capacity)], check=True)
        none, old, new = (count([*base, w, str(capacity)]) for w in ("none", "old", "new"))
        o, n = (old - none) / 1e6, (new - none) / 1e6
        print(f"{capacity:>9,} {o:>10.1f} {n:>10.1f} {n / o:>6.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
