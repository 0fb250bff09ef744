"""``python -m kvoffload.bench tier --kind disk|redis|redis-cluster``: a tier's store and load GB/s.

For each block size it writes ``--total-mib`` of random blocks through the tier and reads
them back, the way the tier manager does: headers with the payload checksum built off the
event loop, ``put`` in batches of ``--batch`` blocks with ``--concurrency`` operations in
flight, then ``get`` into the host blocks and `verify_block()` on every block. In the
same run, with the same bytes, batches and concurrency, it measures a baseline:

* disk: raw ``os.pwritev`` / ``os.preadv`` of the payloads into a second file opened the
  same way (``O_DIRECT`` when the tier uses it), issued as a careful asyncio user would:
  one vectored call per batch of consecutive blocks (the tier, too, moves a run of
  consecutive slots in one call) in a worker thread, from the same event loop, with as
  many batches in flight;
* redis: a bare pipelined ``redis.asyncio`` client doing ``SET`` / ``GET`` of the
  payloads (no header, no checksum, no copy into host blocks);
* redis-cluster: the same through a bare ``redis.asyncio.cluster.RedisCluster`` pipeline
  (which splits each batch by node itself).

Tier and baseline take turns chunk by chunk (``--chunk-mib`` each, the side that goes
first alternating), so that a slow spell of the device or of another process hits both
alike. A repetition stores every block and then loads every block that way; it prints the
median GB/s of ``--reps`` repetitions of each side and the median of the per-repetition
ratios (tier over baseline; 1.0 means the tier costs nothing on top of the raw path).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import mmap
import os
import shlex
import sys
import tempfile
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread

from kvoffload._extras import needs_extra
from kvoffload.bench._args import int_list, positive_int
from kvoffload.bench._tier_common import (
    NS,
    Batch,
    against_bare_redis,
    check_copies,
    side_by_side,
    tier_ops,
)
from kvoffload.hashing import BlockHash
from kvoffload.tiers.disk import DiskTier

__all__ = ["add_parser", "run"]


def add_parser(subparsers: Any) -> None:
    """Register the ``tier`` subcommand."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "tier", help="disk / redis tier GB/s vs the raw path", description=__doc__
    )
    p.add_argument("--kind", choices=["disk", "redis", "redis-cluster"], required=True)
    p.add_argument(
        "--block-kib",
        type=int_list,
        default=[2048, 64],
        help="comma-separated block sizes in KiB (2 MiB, 64 KiB)",
    )
    p.add_argument(
        "--total-mib", type=positive_int, default=256, help="bytes moved per measurement"
    )
    p.add_argument("--reps", type=positive_int, default=5, help="repetitions (median)")
    p.add_argument("--batch", type=positive_int, default=16, help="blocks per tier operation")
    p.add_argument("--concurrency", type=positive_int, default=4, help="operations in flight")
    p.add_argument(
        "--chunk-mib",
        type=positive_int,
        default=8,
        help="bytes each side moves before the other's turn",
    )
    p.add_argument(
        "--calibrate",
        action="store_true",
        help="measure the baseline against a second copy of itself instead of the tier: the "
        "spread of its ratio around 1.0 is this machine's noise",
    )
    p.add_argument(
        "--path",
        type=_directory,
        default=None,
        metavar="DIR",
        help="disk: an existing directory, in which the tier's and the baseline's files are "
        "made and removed again (default: a new temporary directory)",
    )
    p.add_argument("--direct-io", choices=["auto", "never"], default="auto")
    p.add_argument("--url", default="redis://127.0.0.1:6379/0", help="redis: server URL")
    p.add_argument(
        "--startup-nodes",
        default="redis://127.0.0.1:7000",
        help="redis-cluster: comma-separated node URLs",
    )
    p.add_argument(
        "--budget-ms",
        type=int,
        default=10_000,
        help="redis-cluster: the tier's lookup and write budgets (large: this measures "
        "throughput, not a sick node)",
    )
    p.set_defaults(run=run)


def _directory(text: str) -> str:
    """An existing directory (argparse type): the tier's files are made inside it."""
    path = Path(text)
    if not path.exists():
        raise argparse.ArgumentTypeError(f"{text!r} does not exist (give a directory)")
    if not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is not a directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"cannot create files in {text!r}: permission denied")
    return text


def run(args: argparse.Namespace) -> int:
    """Run the benchmark; return 0 (2 when the Redis extra is missing)."""
    if args.kind in ("redis", "redis-cluster"):
        try:
            import redis.asyncio  # noqa: F401, PLC0415
        except ImportError:
            print(needs_extra(f"--kind {args.kind}", "redis"))
            return 2
    print("command: python -m kvoffload.bench " + shlex.join(args.argv))
    if args.calibrate:
        print("# --calibrate: the tier column is a second copy of the baseline")
    print(f"{'kind':6} {'block':>8} {'op':5} {'tier GB/s':>10} {'baseline GB/s':>14} {'ratio':>6}")
    for kib in args.block_kib:
        nbytes = kib * 1024
        n = max(args.batch, (args.total_mib << 20) // nbytes)
        rows = anyio.run(_measure, args, nbytes, n)
        for op, ours, base, ratio in rows:
            print(f"{args.kind:6} {kib:>6}Ki {op:5} {ours:>10.2f} {base:>14.2f} {ratio:>6.2f}")
    return 0


async def _measure(
    args: argparse.Namespace, nbytes: int, n: int
) -> list[tuple[str, float, float, float]]:
    memory = mmap.mmap(-1, 2 * n * nbytes)
    view = memoryview(memory)
    try:
        view[: n * nbytes] = os.urandom(n * nbytes)
        src = [view[i * nbytes : (i + 1) * nbytes] for i in range(n)]
        dst = [view[(n + i) * nbytes : (n + i + 1) * nbytes] for i in range(n)]
        hashes = [BlockHash(i.to_bytes(32, "little")) for i in range(n)]
        if args.kind == "disk":
            return await _disk(args, nbytes, hashes, src, dst)
        if args.kind == "redis-cluster":
            from kvoffload.bench._tier_cluster import redis_cluster  # noqa: PLC0415

            return await redis_cluster(args, nbytes, hashes, src, dst)
        return await _redis(args, nbytes, hashes, src, dst)
    finally:
        src = dst = []
        # While an error propagates, its traceback still holds slices of the buffer and
        # close() would raise BufferError over it: the mapping then goes with the last slice.
        with contextlib.suppress(BufferError):
            view.release()
            memory.close()


async def _disk(
    args: argparse.Namespace,
    nbytes: int,
    hashes: Sequence[BlockHash],
    src: Sequence[memoryview],
    dst: Sequence[memoryview],
) -> list[tuple[str, float, float, float]]:
    n = len(hashes)
    with tempfile.TemporaryDirectory(dir=args.path, prefix="kvoffload-bench-") as tmp:
        tier = DiskTier(
            Path(tmp) / "tier.bin",
            DiskTier.file_bytes(n, nbytes),
            block_nbytes=nbytes,
            namespace=NS,
            direct_io=args.direct_io,
            io_threads=args.concurrency,
        )
        await tier.open()
        raw_path = Path(tmp) / "raw.bin"
        flags = os.O_RDWR | os.O_CREAT | (os.O_DIRECT if tier.direct_io else 0)
        fd = os.open(raw_path, flags, 0o600)
        os.posix_fallocate(fd, 0, n * nbytes)
        fd2 = os.open(Path(tmp) / "raw2.bin", flags, 0o600) if args.calibrate else -1
        if fd2 >= 0:
            os.posix_fallocate(fd2, 0, n * nbytes)
        limiter = anyio.CapacityLimiter(args.concurrency)
        try:
            iov_max = min(os.sysconf("SC_IOV_MAX"), 1024)

            def raw(write: bool, fd: int = fd) -> Batch:
                # What a careful asyncio user of the raw file does: per batch of
                # consecutive blocks, one vectored call straight from and into the same
                # buffers, in a worker thread, as many batches in flight as the tier has.
                call = os.pwritev if write else os.preadv
                bufs = src if write else dst

                def chunk(lo: int, hi: int) -> None:
                    for at in range(lo, hi, iov_max):
                        part = bufs[at : min(hi, at + iov_max)]
                        if call(fd, part, at * nbytes) != len(part) * nbytes:
                            raise RuntimeError("short raw I/O")

                async def batch(lo: int, hi: int) -> None:
                    await anyio.to_thread.run_sync(chunk, lo, hi, limiter=limiter)

                return batch

            async def reset() -> None:
                await tier.delete(hashes)

            rows = await side_by_side(
                args,
                n,
                nbytes,
                ours=(
                    {"store": raw(True, fd2), "load": raw(False, fd2)}
                    if args.calibrate
                    else tier_ops(tier, args, nbytes=nbytes, hashes=hashes, src=src, dst=dst)
                ),
                base={"store": raw(True), "load": raw(False)},
                reset=reset,
                check=functools.partial(check_copies, src, dst),
            )
            print(f"# disk: O_DIRECT={tier.direct_io} {tier.statistics()}", file=sys.stderr)
        finally:
            os.close(fd)
            if fd2 >= 0:
                os.close(fd2)
            await tier.close()
    return rows


async def _redis(
    args: argparse.Namespace,
    nbytes: int,
    hashes: Sequence[BlockHash],
    src: Sequence[memoryview],
    dst: Sequence[memoryview],
) -> list[tuple[str, float, float, float]]:
    import redis.asyncio as aioredis  # noqa: PLC0415 - optional extra

    from kvoffload.tiers.redis import RedisTier  # noqa: PLC0415 - optional extra

    n = len(hashes)
    prefix = f"kvoffload-bench:{uuid.uuid4().hex[:8]}:"
    tier = RedisTier(
        args.url,
        block_nbytes=nbytes,
        namespace=NS,
        key_prefix=prefix + "tier:",
        max_connections=args.concurrency,
    )
    await tier.open()
    bare = aioredis.Redis.from_url(args.url, max_connections=args.concurrency + 1)
    keys = [f"{prefix}bare:{i}".encode() for i in range(n)]
    keys2 = [f"{prefix}bare2:{i}".encode() for i in range(n)]

    async def reset() -> None:
        await bare.delete(*keys, *keys2)
        await tier.delete(hashes)

    try:
        rows = await against_bare_redis(
            args,
            n,
            nbytes,
            tier=tier,
            bare=bare,
            keys=(keys, keys2),
            hashes=hashes,
            src=src,
            dst=dst,
            reset=reset,
        )
    finally:
        await reset()
        await bare.aclose()
        await tier.close()
    return rows
