"""Instructions `CpuBlockPool` and vLLM's ``BlockPool`` run for the same trace replay (callgrind).

Both pools replay the same request sequence: per request of a Mooncake-format trace, its
``hash_ids`` as block keys, the leading cached run is looked up and referenced, the
missing blocks are allocated (as many as are free; the rest are skipped) and cached under
their keys, and at the request's end all its blocks are freed tail first.

* kvoffload: `kvoffload.bench.pool.replay` (``lookup``, ``touch``, ``allocate``,
  ``publish`` per new block, ``free``) through ``CpuBlockPool(capacity)`` (LRU).
* vLLM: `replay_vllm` below, through ``vllm.v1.core.block_pool.BlockPool`` called as
  vLLM's ``KVCacheManager`` calls it for one full-attention group (block size = hash
  block size, no events, no metrics): ``get_cached_block`` per key until the first miss
  (``FullAttentionManager.find_longest_cache_hit``), ``touch`` of the hit
  (``add_local_computed_blocks``), ``get_num_free_blocks`` and ``get_new_blocks``
  (``allocate_new_blocks``), ``cache_full_blocks`` over the new blocks (``cache_blocks``)
  and ``free_blocks(reversed(blocks))`` (``free``). The pool is built with
  ``capacity + 1`` blocks, as vLLM keeps block 0 as its null block, so both have
  ``capacity`` usable blocks. vLLM's "recompute the last token" cap on a hit belongs to
  the manager, not the pool, and is not applied (kvoffload's replay has none either).

Each figure comes from one process under ``valgrind --tool=callgrind --instr-atstart=no``
that imports its pool and loads the trace uninstrumented (``gc.collect(); gc.freeze()``
after, as vLLM's engine does once it has started), then builds the pool and replays the
requests ``--repeat`` times instrumented and exits at once; a baseline process per side
that stops after loading is subtracted. kvoffload runs in this interpreter, vLLM in
``--vllm-python`` (the same CPython build), each importing kvoffload from this checkout.
The two replays must reach the same hits, block for block: the script checks it.

Usage:
    .venv/bin/python scripts/pool_vs_vllm_instructions.py ../shared/traces/synthetic_trace.jsonl
        [--capacity 1000,6000,20000] [--requests 0] [--repeat 1]
        [--vllm-python .venv-vllm/bin/python]

``--requests 0`` replays the whole trace. Needs valgrind (``apt-get install valgrind``) and
a vLLM environment (``bash scripts/test_vllm.sh -k import`` builds ``.venv-vllm``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _callgrind import have_callgrind, run_after_ready

ROOT = Path(__file__).resolve().parent.parent
BLOCK_SIZE = 512
"""Tokens per block of the Mooncake traces (one ``hash_ids`` entry per 512 tokens)."""

_CHILD = r"""
import gc, os, sys
root, scripts, side, trace, capacity, requests, repeat = sys.argv[1:8]
capacity, requests, repeat = int(capacity), int(requests), int(repeat)
sys.path[:0] = [root, scripts]
import kvoffload
from kvoffload.bench.pool import load_trace_keys, replay
from kvoffload.pool.block_pool import CpuBlockPool
from pool_vs_vllm_instructions import new_vllm_pool, replay_vllm
if not kvoffload.__file__.startswith(root):
    raise SystemExit(f"imported {kvoffload.__file__}, not from {root}")
keys = load_trace_keys(trace)
if requests:
    keys = keys[:requests]
if side == "vllm":
    new_vllm_pool(1)  # imports vLLM's pool before the count starts
gc.collect()
gc.freeze()
sys.stdout.write("ready\n")
sys.stdout.flush()
sys.stdin.readline()
counts = None
if side == "kvoffload":
    for _ in range(repeat):
        counts = replay(CpuBlockPool(capacity), keys)
elif side == "vllm":
    for _ in range(repeat):
        counts = replay_vllm(new_vllm_pool(capacity), keys)
if counts is not None:
    sys.stdout.write(f"{counts.total_blocks} {counts.hit_blocks} {counts.skipped_blocks}\n")
sys.stdout.flush()
os._exit(0)
"""


class _Request:
    """What ``BlockPool.cache_full_blocks`` reads of a vLLM ``Request`` (events off): its
    block hashes."""

    __slots__ = ("block_hashes",)

    def __init__(self) -> None:
        self.block_hashes: Sequence[bytes] = ()


def new_vllm_pool(capacity: int) -> Any:
    """vLLM's ``BlockPool`` with ``capacity`` usable blocks (plus its null block), prefix
    caching on, events and metrics off."""
    from vllm.v1.core.block_pool import BlockPool  # noqa: PLC0415 - only in vLLM's env

    return BlockPool(capacity + 1, enable_caching=True, hash_block_size=BLOCK_SIZE)


def replay_vllm(pool: Any, requests: Sequence[Sequence[bytes]]) -> Any:
    """`kvoffload.bench.pool.replay` through vLLM's ``BlockPool`` (one full-attention
    group, group id 0), calling it as vLLM's ``KVCacheManager`` does; returns the same
    `ReplayCounts` (``block_ops`` as kvoffload's replay counts them)."""
    from kvoffload.bench.pool import ReplayCounts  # noqa: PLC0415 - the child imports it

    get_cached_block = pool.get_cached_block
    touch = pool.touch
    get_num_free_blocks = pool.get_num_free_blocks
    get_new_blocks = pool.get_new_blocks
    cache_full_blocks = pool.cache_full_blocks
    free_blocks = pool.free_blocks
    group_ids = [0]
    request = _Request()
    total = hits_total = ops = skipped = 0
    for keys in requests:
        n = len(keys)
        # find_longest_cache_hit: the leading run of cached blocks.
        blocks: list[Any] = []
        append = blocks.append
        for block_hash in keys:
            cached = get_cached_block(block_hash, group_ids)
            if not cached:
                break
            append(cached[0])
        h = len(blocks)
        # add_local_computed_blocks, then allocate_new_blocks (as many as are free).
        touch(blocks)
        want = n - h
        num_free = get_num_free_blocks()
        k = want if want <= num_free else num_free
        blocks += get_new_blocks(k)
        # cache_blocks: the new full blocks join the prefix cache.
        request.block_hashes = keys
        cache_full_blocks(request, blocks, h, h + k, BLOCK_SIZE, 0)
        # free: tail first, so that the tail is evicted first.
        free_blocks(reversed(blocks))
        total += n
        hits_total += h
        skipped += want - k
        ops += (h + 1 if h < n else n) + h + 3 * k + h
    return ReplayCounts(total, hits_total, ops, skipped)


def count(
    python: str, side: str, args: argparse.Namespace, capacity: int
) -> tuple[int, tuple[int, ...]]:
    """Instructions of one child, and the (total, hit, skipped) blocks it printed."""
    instructions, out = run_after_ready(
        _CHILD,
        [
            str(ROOT),
            str(ROOT / "scripts"),
            side,
            str(args.trace.resolve()),
            str(capacity),
            str(args.requests),
            str(args.repeat),
        ],
        python=python,
    )
    return instructions, tuple(int(v) for v in out.split())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", type=Path)
    parser.add_argument("--capacity", default="1000,6000,20000")
    parser.add_argument("--requests", type=int, default=0, help="first N requests; 0: all")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm/bin/python"))
    args = parser.parse_args()
    if not have_callgrind():
        print("valgrind is not installed (apt-get install valgrind)", file=sys.stderr)
        return 2
    if not args.trace.is_file():
        print(f"no trace at {args.trace}", file=sys.stderr)
        return 2
    if not Path(args.vllm_python).is_file():
        print(f"no vLLM interpreter at {args.vllm_python} (--vllm-python)", file=sys.stderr)
        return 2
    ours_base, _ = count(sys.executable, "none", args, 1)
    vllm_base, _ = count(args.vllm_python, "none", args, 1)
    shown = f"first {args.requests:,}" if args.requests else "all"
    print(
        f"{args.trace.name}: {shown} requests x {args.repeat}; "
        "M instructions over a process that only loads; ratio = vLLM / kvoffload"
    )
    print(f"{'capacity':>9} {'kvoffload':>10} {'vLLM':>10} {'ratio':>6} {'hit rate':>9}")
    for capacity in (int(c) for c in args.capacity.split(",")):
        ours, ours_counts = count(sys.executable, "kvoffload", args, capacity)
        theirs, their_counts = count(args.vllm_python, "vllm", args, capacity)
        if ours_counts != their_counts:
            raise SystemExit(
                f"capacity {capacity}: the replays differ (total, hit, skipped blocks): "
                f"kvoffload {ours_counts}, vLLM {their_counts}"
            )
        o, v = (ours - ours_base) / 1e6, (theirs - vllm_base) / 1e6
        total, hits, _ = ours_counts
        print(f"{capacity:>9,} {o:>10.1f} {v:>10.1f} {v / o:>6.3f} {hits / total:>9.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
