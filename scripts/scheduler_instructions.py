"""Instructions the scheduler's hot paths execute, in another checkout and in this one.

Timings on a shared VM move by ±10 % between identical runs; the number of machine
instructions a workload executes does not. Each figure comes from one process under
``valgrind --tool=callgrind --instr-atstart=no``: it imports the scheduler from a
checkout and prepares the workload uninstrumented, then the parent switches
instrumentation on (``callgrind_control -i on``) and the process runs one stage and
exits at once. The stages, on the ``python -m kvoffload.bench scheduler`` workload
(``--requests`` running requests of ``--blocks`` blocks, ``--chunk`` new blocks each
per step):

* ``update``: every step's ``update()`` calls, without planning;
* ``steps``: every step's ``update()`` calls, then ``plan_stores()`` and ``complete()``
  (``steps - update`` is the store planning and completion);
* ``lookups``: after everything was stored (uninstrumented), one ``lookup()``,
  ``plan_load()`` and ``complete()`` per request, from a new request id.

The ratio is this checkout over the other (1.00 = the same work).

With ``--grouped`` this checkout runs the same stages through a ``GroupedScheduler``
with one full-attention group of the same geometry (tables and hashes as one-entry
mappings, ``complete_all()``), against ``OffloadScheduler`` in the other checkout (this
one when none is given): the ratio is then what one full group costs in the grouped
scheduler over the single-group scheduler.

Usage:
    git worktree add /tmp/base 60d60b6
    .venv/bin/python scripts/scheduler_instructions.py /tmp/base [--requests 256]
        [--blocks 64] [--chunk 4]
    .venv/bin/python scripts/scheduler_instructions.py --grouped

Needs valgrind (``apt-get install valgrind``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from _callgrind import count_after_ready, have_callgrind

STAGES = ("update", "steps", "lookups")

_CHILD = r"""
import os, sys
checkout, stage, requests, blocks, chunk, grouped = sys.argv[1:7]
sys.path.insert(0, checkout)
from kvoffload.config import OffloadConfig
from kvoffload.hashing import HashNamespace, hash_block_tokens
from kvoffload.pool import CpuBlockPool
import kvoffload
from kvoffload.scheduler import OffloadScheduler
if not kvoffload.__file__.startswith(checkout):
    raise SystemExit(f"imported {kvoffload.__file__}, not from {checkout}")
requests, blocks, chunk, bs = int(requests), int(blocks), int(chunk), 16
root = HashNamespace(model_id="bench").root
chains = []
for r in range(requests):
    parent, chain = root, []
    for b in range(blocks):
        parent = hash_block_tokens(
            parent, range(r * 1_000_000 + b * bs, r * 1_000_000 + (b + 1) * bs)
        )
        chain.append(parent)
    chains.append(chain)
total = requests * blocks
config = OffloadConfig(block_size=bs, num_cpu_blocks=total, max_store_blocks_per_step=1 << 24)
tables = [list(range(r * blocks, (r + 1) * blocks)) for r in range(requests)]
steps = blocks // chunk + 1
if grouped == "1":
    from kvoffload.groups import KVCacheGroup
    from kvoffload.scheduler.groups import GroupedScheduler

    group = KVCacheGroup(
        name="full", kind="full", block_size=bs, num_layers=1, bytes_per_layer_block=64
    )
    sched = GroupedScheduler([group], {"full": CpuBlockPool(total)}, config=config)
    one = lambda x: {"full": x}
    complete = sched.complete_all
else:
    sched = OffloadScheduler(config, CpuBlockPool(total))
    one = lambda x: x
    complete = sched.complete


def run_steps(plan):
    for step in range(1, steps + 1):
        for r, chain in enumerate(chains):
            n = min(blocks, step * chunk)
            sched.update(f"r{r}", one(tables[r][:n]), one(chain[:n]), n * bs)
        if plan:
            p = sched.plan_stores()
            if p is not None:
                complete(p, ok=True)


def run_lookups():
    for r, chain in enumerate(chains):
        rid = f"q{r}"
        hit = sched.lookup(rid, one(chain), blocks * bs + 1)
        p = sched.plan_load(rid, one(tables[r]), hit)
        if p is not None:
            complete(p, ok=True)
        sched.finish(rid)


if stage == "lookups":
    run_steps(True)
sys.stdout.write("ready\n")
sys.stdout.flush()
sys.stdin.readline()
if stage == "update":
    run_steps(False)
elif stage == "steps":
    run_steps(True)
else:
    run_lookups()
sys.stdout.flush()
os._exit(0)
"""


def count(checkout: Path, stage: str, args: argparse.Namespace, *, grouped: bool = False) -> int:
    """Instructions of one stage, run from ``checkout`` (``grouped``: through a
    ``GroupedScheduler`` with one full group)."""
    return count_after_ready(
        _CHILD,
        [
            str(checkout),
            stage,
            str(args.requests),
            str(args.blocks),
            str(args.chunk),
            "1" if grouped else "0",
        ],
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "base",
        type=Path,
        nargs="?",
        help="a checkout to compare with (git worktree; with --grouped, default: this one)",
    )
    parser.add_argument(
        "--grouped",
        action="store_true",
        help="run this checkout's stages through a GroupedScheduler with one full group",
    )
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--blocks", type=int, default=64)
    parser.add_argument("--chunk", type=int, default=4)
    parser.add_argument("--stages", default=",".join(STAGES))
    args = parser.parse_args()
    if not have_callgrind():
        print("valgrind is not installed (apt-get install valgrind)", file=sys.stderr)
        return 2
    here = Path(__file__).resolve().parent.parent
    if args.base is None and not args.grouped:
        parser.error("give a checkout to compare with, or --grouped")
    base = here if args.base is None else args.base.resolve()
    new_name = f"{here.name} (grouped, one full group)" if args.grouped else here.name
    print(
        f"scheduler instructions, {args.requests} requests x {args.blocks} blocks, "
        f"chunk {args.chunk}; ratio = {new_name} / {base.name}"
    )
    print(f"{'stage':>8} {'base (M)':>10} {'new (M)':>10} {'ratio':>6}")
    figures: dict[str, tuple[int, int]] = {}
    for stage in args.stages.split(","):
        old = count(base, stage, args)
        new = count(here, stage, args, grouped=args.grouped)
        figures[stage] = (old, new)
        print(f"{stage:>8} {old / 1e6:>10.1f} {new / 1e6:>10.1f} {new / old:>6.3f}")
    if "update" in figures and "steps" in figures:
        old = figures["steps"][0] - figures["update"][0]
        new = figures["steps"][1] - figures["update"][1]
        print(f"{'plan':>8} {old / 1e6:>10.1f} {new / 1e6:>10.1f} {new / old:>6.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
