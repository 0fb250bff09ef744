"""``python -m kvoffload.bench pool``: replay a request trace through the CPU block pool.

Each request is replayed the way an offload scheduler drives the pool: ``lookup`` its block
hashes, ``touch`` the leading hits, ``allocate`` and ``publish`` the missing blocks (as many
as are free; the rest are skipped), then ``free`` all of the request's blocks tail first.

The same replay runs through `BaselinePool`, a textbook pool (a dict for the hash
map, an ``OrderedDict`` as the LRU free list, a list of reference counts) with the same
semantics, so each run reports a speed ratio measured side by side on one machine.

*Block-ops* count the blocks passed through pool calls: hashes examined by ``lookup`` plus
blocks touched, allocated, published and freed.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import statistics
import sys
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Protocol

from tqdm import tqdm

from kvoffload.bench._args import CommandError, int_list, output_path, positive_int, write_output
from kvoffload.bench.trace import read_trace, useful_capacity
from kvoffload.hashing import BlockHash
from kvoffload.pool.block_pool import CpuBlockPool
from kvoffload.pool.policies import POLICY_NAMES

__all__ = [
    "BLOCK_OPS_DEFINITION",
    "LRU_REFERENCE",
    "BaselinePool",
    "CapacityResult",
    "ReplayCounts",
    "add_parser",
    "load_trace_keys",
    "main",
    "replay",
    "replay_baseline",
    "run",
]

BLOCK_OPS_DEFINITION = (
    "block-ops = blocks passed through pool calls: hashes examined by lookup "
    "+ blocks touched + allocated + published + freed"
)

LRU_REFERENCE: dict[int, float] = {1000: 0.084, 6000: 0.312, 20000: 0.572}
"""LRU prefix hit ratios of the Mooncake synthetic trace (``../shared/traces/README.md``)."""

_SYNTHETIC_NAME = "synthetic_trace.jsonl"
_SYNTHETIC_REQUESTS = 3993


@dataclass(frozen=True, slots=True)
class ReplayCounts:
    """What one replay of a trace did.

    Attributes:
        total_blocks: blocks of all prompts.
        hit_blocks: leading blocks found by ``lookup``.
        block_ops: blocks passed through pool calls (see :data:`BLOCK_OPS_DEFINITION`).
        skipped_blocks: missing blocks not stored because no block was free.
    """

    total_blocks: int
    hit_blocks: int
    block_ops: int
    skipped_blocks: int

    @property
    def hit_rate(self) -> float:
        """``hit_blocks / total_blocks`` (0 for an empty trace)."""
        return self.hit_blocks / self.total_blocks if self.total_blocks else 0.0


@dataclass(frozen=True, slots=True)
class CapacityResult:
    """The figures for one pool capacity.

    Attributes:
        capacity: pool size in blocks.
        hit_rate: hit blocks / total blocks.
        lru_reference: the trace README's LRU hit ratio, when the trace is the synthetic one.
        block_ops: block-ops of one replay.
        block_ops_per_s: median over the runs, `CpuBlockPool`.
        baseline_block_ops_per_s: median over the runs, `BaselinePool`.
        ratio: ``block_ops_per_s / baseline_block_ops_per_s``.
    """

    capacity: int
    hit_rate: float
    lru_reference: float | None
    block_ops: int
    block_ops_per_s: float
    baseline_block_ops_per_s: float
    ratio: float


def load_trace_keys(path: str | Path) -> list[list[BlockHash]]:
    """Read a Mooncake-format trace and turn each request's ``hash_ids`` into bytes keys.

    Raises:
        ValueError: a line is not a trace record.
    """
    return [
        [BlockHash(h.to_bytes(16, "little", signed=True)) for h in r.hash_ids]
        for r in read_trace(path)
    ]


def replay(pool: CpuBlockPool, requests: Sequence[Sequence[BlockHash]]) -> ReplayCounts:
    """Replay ``requests`` (per request, its block keys in prefix order) through ``pool``."""
    lookup = pool.lookup
    touch = pool.touch
    allocate = pool.allocate
    publish = pool.publish
    free = pool.free
    total = hits_total = ops = skipped = 0
    for keys in requests:
        n = len(keys)
        hits = lookup(keys)
        h = len(hits)
        touch(hits)
        want = n - h
        num_free = pool.num_free
        k = want if want <= num_free else num_free
        new = allocate(k)
        for block, key in zip(new, keys[h : h + k], strict=True):
            publish(block, key)
        held = hits + new
        held.reverse()
        free(held)
        total += n
        hits_total += h
        skipped += want - k
        # examined by lookup, touched, allocated, published, freed
        ops += (h + 1 if h < n else n) + h + 3 * k + h
    return ReplayCounts(total, hits_total, ops, skipped)


class BaselinePool:
    """A textbook pool with the semantics of `CpuBlockPool`, for comparison.

    Blocks are ints; a dict maps hashes to blocks, an ``OrderedDict`` holds the free blocks
    in LRU order, and two lists hold each block's reference count and hash.
    """

    __slots__ = ("_cached", "_free", "_hash", "_ref")

    def __init__(self, num_blocks: int) -> None:
        self._cached: dict[bytes, int] = {}
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._ref = [0] * num_blocks
        self._hash: list[bytes | None] = [None] * num_blocks

    @property
    def num_free(self) -> int:
        """Blocks with no reference."""
        return len(self._free)

    def lookup(self, keys: Sequence[bytes]) -> list[int]:
        """The leading run of published blocks for ``keys``."""
        hits: list[int] = []
        for key in keys:
            block = self._cached.get(key)
            if block is None:
                break
            hits.append(block)
        return hits

    def touch(self, blocks: Sequence[int]) -> None:
        """Take a reference on each block."""
        for block in blocks:
            if self._ref[block] == 0:
                del self._free[block]
            self._ref[block] += 1

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks, LRU first, unpublishing any that were published."""
        if n > len(self._free):
            raise ValueError(f"cannot allocate {n} blocks: only {len(self._free)} free")
        out: list[int] = []
        for _ in range(n):
            block, _ = self._free.popitem(last=False)
            key = self._hash[block]
            if key is not None:
                del self._cached[key]
                self._hash[block] = None
            self._ref[block] = 1
            out.append(block)
        return out

    def publish(self, block: int, key: bytes) -> bool:
        """Publish ``block`` under ``key`` unless another block holds it."""
        if key in self._cached:
            return self._cached[key] == block
        self._cached[key] = block
        self._hash[block] = key
        return True

    def free(self, blocks: Sequence[int]) -> None:
        """Drop a reference from each block; blocks reaching 0 join the MRU end in order."""
        for block in blocks:
            ref = self._ref[block] - 1
            if ref < 0:
                raise ValueError(f"double free of block {block}")
            self._ref[block] = ref
            if ref == 0:
                self._free[block] = None


def replay_baseline(pool: BaselinePool, requests: Sequence[Sequence[bytes]]) -> ReplayCounts:
    """`replay()` for `BaselinePool`."""
    total = hits_total = ops = skipped = 0
    for keys in requests:
        n = len(keys)
        hits = pool.lookup(keys)
        h = len(hits)
        pool.touch(hits)
        want = n - h
        k = min(want, pool.num_free)
        new = pool.allocate(k)
        for block, key in zip(new, keys[h : h + k], strict=True):
            pool.publish(block, key)
        held = hits + new
        held.reverse()
        pool.free(held)
        total += n
        hits_total += h
        skipped += want - k
        ops += (h + 1 if h < n else n) + h + 3 * k + h
    return ReplayCounts(total, hits_total, ops, skipped)


class _Replay(Protocol):
    def __call__(self, capacity: int, requests: Sequence[Sequence[BlockHash]]) -> ReplayCounts: ...


def _ours(
    capacity: int, requests: Sequence[Sequence[BlockHash]], policy: str = "lru"
) -> ReplayCounts:
    return replay(CpuBlockPool(capacity, policy=policy), requests)


def _baseline(capacity: int, requests: Sequence[Sequence[BlockHash]]) -> ReplayCounts:
    return replay_baseline(BaselinePool(capacity), requests)


def _timed(
    fn: _Replay, capacity: int, requests: Sequence[Sequence[BlockHash]]
) -> tuple[ReplayCounts, float]:
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        start = time.perf_counter()
        counts = fn(capacity, requests)
        seconds = time.perf_counter() - start
    finally:
        if was_enabled:
            gc.enable()
    return counts, seconds


def _is_synthetic(path: Path, num_requests: int) -> bool:
    return path.name == _SYNTHETIC_NAME and num_requests == _SYNTHETIC_REQUESTS


def measure(
    requests: Sequence[Sequence[BlockHash]],
    capacities: Sequence[int],
    *,
    runs: int = 5,
    lru_reference: dict[int, float] | None = None,
    progress: bool = True,
    policy: str = "lru",
) -> list[CapacityResult]:
    """Replay ``requests`` at each capacity ``runs`` times through both pools.

    ``policy`` is the eviction policy of `CpuBlockPool` (the textbook pool is always LRU).

    Raises:
        RuntimeError: under LRU, the two pools disagree on hits (they implement the same
            semantics).
        ConfigError: an unknown policy.
    """
    ours_fn = functools.partial(_ours, policy=policy)
    results: list[CapacityResult] = []
    with tqdm(
        total=len(capacities) * runs * 2,
        desc="pool replay",
        unit="replay",
        file=sys.stderr,
        disable=not progress,
    ) as bar:
        for capacity in capacities:
            ours: list[float] = []
            base: list[float] = []
            counts: ReplayCounts | None = None
            for _ in range(runs):
                counts, seconds = _timed(ours_fn, capacity, requests)
                ours.append(counts.block_ops / seconds)
                bar.update()
                base_counts, base_seconds = _timed(_baseline, capacity, requests)
                base.append(base_counts.block_ops / base_seconds)
                bar.update()
                if policy == "lru" and base_counts != counts:
                    raise RuntimeError(
                        f"capacity {capacity}: CpuBlockPool {counts} != baseline {base_counts}"
                    )
            if counts is None:  # runs >= 1 is checked by the caller
                raise ValueError("runs must be >= 1")
            ours_median = statistics.median(ours)
            base_median = statistics.median(base)
            results.append(
                CapacityResult(
                    capacity=capacity,
                    hit_rate=counts.hit_rate,
                    lru_reference=(lru_reference or {}).get(capacity),
                    block_ops=counts.block_ops,
                    block_ops_per_s=ours_median,
                    baseline_block_ops_per_s=base_median,
                    ratio=ours_median / base_median,
                )
            )
    return results


def _policy(text: str) -> str:
    name = text.strip().lower()
    if name not in POLICY_NAMES:
        raise argparse.ArgumentTypeError(
            f"unknown policy {text!r}; known policies: {', '.join(POLICY_NAMES)}"
        )
    return name


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register the ``pool`` subcommand."""
    parser = subparsers.add_parser(
        "pool",
        help="replay a Mooncake-format trace through CpuBlockPool",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--trace", required=True, type=Path, help="Mooncake-format trace (JSON lines)"
    )
    parser.add_argument(
        "--capacity",
        type=int_list,
        default=[1000, 6000, 20000],
        help="comma-separated pool sizes in blocks (default: 1000,6000,20000)",
    )
    parser.add_argument(
        "--runs", type=positive_int, default=5, help="timed runs per capacity; the median is shown"
    )
    parser.add_argument(
        "--json", type=output_path, default=None, help="also write the figures here"
    )
    parser.add_argument(
        "--policy",
        type=_policy,
        default="lru",
        help=f"CpuBlockPool's eviction policy ({', '.join(POLICY_NAMES)}; default lru)",
    )
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    parser.set_defaults(run=run)


def _format_rate(value: float) -> str:
    return f"{value / 1e6:,.2f}M"


def run(args: argparse.Namespace) -> int:
    """Run the benchmark described by parsed ``args``; print a table; return 0."""
    path: Path = args.trace
    try:
        requests = load_trace_keys(path)
    except OSError as exc:
        raise CommandError(f"cannot read trace {str(path)!r}: {exc.strerror or exc}") from None
    except ValueError as exc:  # TraceFormatError: names the file, line and field
        raise CommandError(str(exc)) from None
    if not any(requests):
        raise CommandError(f"{path}: the trace holds no request with a block")
    synthetic = _is_synthetic(path, len(requests))
    # A pool larger than the trace's distinct blocks plus its longest request never evicts:
    # build no larger one (the figures are the same; the memory is not).
    useful = useful_capacity(requests)
    if any(c > useful for c in args.capacity):
        print(f"capacities above {useful:,} (the most this trace can use) run with {useful:,}")
    results = measure(
        requests,
        [min(c, useful) for c in args.capacity],
        runs=args.runs,
        lru_reference=LRU_REFERENCE if synthetic else None,
        progress=not args.no_progress,
        policy=args.policy,
    )
    results = [replace(r, capacity=c) for r, c in zip(results, args.capacity, strict=True)]
    total = sum(len(r) for r in requests)
    print(f"trace: {path} ({len(requests):,} requests, {total:,} blocks)")
    per_block = bookkeeping_bytes_per_block()
    print(f"pool bookkeeping: {per_block:.1f} bytes per block (tracemalloc, 100,000 blocks)")
    print(f"eviction policy: {args.policy}")
    print(f"{BLOCK_OPS_DEFINITION}; speeds are the median of {args.runs} run(s)")
    print("ratio = CpuBlockPool block-ops/s / baseline (dict + OrderedDict) block-ops/s, same run")
    header = f"{'capacity':>9}  {'hit rate':>8}"
    if synthetic:
        header += f"  {'LRU ref':>7}"
    header += f"  {'block-ops/s':>11}  {'baseline':>9}  {'ratio':>5}"
    print(header)
    for r in results:
        line = f"{r.capacity:>9,}  {r.hit_rate:>8.4f}"
        if synthetic:
            ref = f"{r.lru_reference:.3f}" if r.lru_reference is not None else "-"
            line += f"  {ref:>7}"
        line += (
            f"  {_format_rate(r.block_ops_per_s):>11}  "
            f"{_format_rate(r.baseline_block_ops_per_s):>9}  {r.ratio:>5.2f}"
        )
        print(line)
    if args.json is not None:
        payload = {
            "trace": str(path),
            "requests": len(requests),
            "blocks": total,
            "runs": args.runs,
            "policy": args.policy,
            "block_ops_definition": BLOCK_OPS_DEFINITION,
            "bookkeeping_bytes_per_block": per_block,
            "results": [asdict(r) for r in results],
        }
        write_output(args.json, json.dumps(payload, indent=2) + "\n")
    return 0


def bookkeeping_bytes_per_block(num_blocks: int = 100_000) -> float:
    """Python memory one `CpuBlockPool` block costs, measured with ``tracemalloc`` over a
    pool of ``num_blocks`` (the figure `POOL_BOOKKEEPING_BYTES_PER_BLOCK` rounds up)."""
    import gc  # noqa: PLC0415 - only this measurement needs them
    import tracemalloc  # noqa: PLC0415

    gc.collect()
    tracemalloc.start()
    try:
        pool = CpuBlockPool(num_blocks)
        used, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    del pool
    return used / num_blocks


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``pool`` on its own: ``main(["--trace", path, ...])``."""
    parser = argparse.ArgumentParser(prog="python -m kvoffload.bench")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["pool", *(sys.argv[1:] if argv is None else argv)])
    try:
        code: int = args.run(args)
    except CommandError as exc:
        print(f"{parser.prog} pool: error: {exc}", file=sys.stderr)
        return 1
    return code
