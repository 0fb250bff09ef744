"""What the kinds of ``python -m kvoffload.bench tier`` share: the namespace, the
side-by-side turn-taking of the tier and its baseline, the tier's operations, the medians
and the copy check."""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import anyio

from kvoffload.hashing import BlockHash
from kvoffload.tiers.base import BlockWrite, SecondaryTier
from kvoffload.tiers.format import encode_header, verify_block

__all__ = [
    "NS",
    "Batch",
    "against_bare_redis",
    "check_copies",
    "concurrently",
    "gbps",
    "medians",
    "pipelined_ops",
    "side_by_side",
    "tier_ops",
]

NS = bytes(range(32))


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


Batch = Callable[[int, int], Awaitable[None]]
"""One operation over blocks ``[lo, hi)``."""


async def concurrently(begin: int, end: int, concurrency: int, batch: int, op: Batch) -> float:
    """Run ``op(lo, hi)`` over ``[begin, end)`` in batches, ``concurrency`` at once; seconds."""
    limiter = anyio.Semaphore(concurrency)
    start = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for lo in range(begin, end, batch):

            async def one(lo: int = lo) -> None:
                async with limiter:
                    await op(lo, min(end, lo + batch))

            tg.start_soon(one)
    return time.perf_counter() - start


async def side_by_side(
    args: argparse.Namespace,
    n: int,
    nbytes: int,
    *,
    ours: dict[str, Batch],
    base: dict[str, Batch],
    reset: Callable[[], Awaitable[None]],
    check: Callable[[], None],
) -> list[tuple[str, float, float, float]]:
    """Per repetition: ``reset()``, then store and then load all ``n`` blocks, tier and
    baseline taking turns chunk by chunk; then ``check()``. Returns `medians()`."""
    chunk = max(args.batch * args.concurrency, (args.chunk_mib << 20) // nbytes)
    samples: dict[str, list[tuple[float, float]]] = {"store": [], "load": []}
    for rep in range(args.reps):
        await reset()
        for op in ("store", "load"):
            seconds = {"ours": 0.0, "base": 0.0}
            for k, lo in enumerate(range(0, n, chunk)):
                hi = min(n, lo + chunk)
                turns = [("ours", ours[op]), ("base", base[op])]
                if (rep + k) % 2:
                    turns.reverse()
                for side, fn in turns:
                    seconds[side] += await concurrently(lo, hi, args.concurrency, args.batch, fn)
            samples[op].append(
                (gbps(n * nbytes, seconds["ours"]), gbps(n * nbytes, seconds["base"]))
            )
        check()
    return medians(samples)


def tier_ops(
    tier: SecondaryTier,
    args: argparse.Namespace,
    *,
    nbytes: int,
    hashes: Sequence[BlockHash],
    src: Sequence[memoryview],
    dst: Sequence[memoryview],
) -> dict[str, Batch]:
    """A store batch and a verified load batch through ``tier``."""

    async def store(lo: int, hi: int) -> None:
        writes = [
            BlockWrite(
                hashes[i],
                b"",
                src[i],
                seal=functools.partial(encode_header, NS, hashes[i], src[i]),
            )
            for i in range(lo, hi)
        ]
        stored = await tier.put(writes)
        if stored != hi - lo:
            raise RuntimeError(f"the tier stored {stored} of {hi - lo} blocks")

    async def load(lo: int, hi: int) -> None:
        reads = await tier.get(hashes[lo:hi], dst[lo:hi])
        summed = all(r is not None and r.payload_checksum is not None for r in reads)

        def check() -> None:
            for i, read in zip(range(lo, hi), reads, strict=True):
                if read is None:
                    raise RuntimeError(f"block {i} missing")
                verify_block(
                    read.header,
                    namespace=NS,
                    block_hash=hashes[i],
                    expected_length=nbytes,
                    received_length=read.payload_length,
                    payload=dst[i],
                    payload_checksum=read.payload_checksum,
                )

        if summed:  # as the tier manager does: the rest of the check is cheap
            check()
        else:
            await anyio.to_thread.run_sync(check)

    return {"store": store, "load": load}


def medians(
    samples: dict[str, list[tuple[float, float]]],
) -> list[tuple[str, float, float, float]]:
    """Per op: median tier GB/s, median baseline GB/s, median of the per-repetition ratios."""
    return [
        (
            op,
            statistics.median(s[0] for s in rows),
            statistics.median(s[1] for s in rows),
            statistics.median(s[0] / s[1] if s[1] else float("nan") for s in rows),
        )
        for op, rows in samples.items()
    ]


def check_copies(src: Sequence[memoryview], dst: Sequence[memoryview]) -> None:
    n = len(src)
    for i in (0, n // 2, n - 1):
        if dst[i] != src[i]:
            raise RuntimeError(f"block {i} read back differs")


def pipelined_ops(
    client: Any, keys: Sequence[bytes], src: Sequence[memoryview], nbytes: int
) -> dict[str, Batch]:
    """The baseline's store and load: one pipelined ``SET`` / ``GET`` per block of a batch
    on a bare redis-py client (a `Redis` or a `RedisCluster`, whose pipeline splits the
    batch per node), moving the same bytes as the tier."""

    async def bare_set(lo: int, hi: int) -> None:
        async with client.pipeline(transaction=False) as pipe:
            for i in range(lo, hi):
                pipe.set(keys[i], src[i])
            await pipe.execute()

    async def bare_get(lo: int, hi: int) -> None:
        async with client.pipeline(transaction=False) as pipe:
            for i in range(lo, hi):
                pipe.get(keys[i])
            values = await pipe.execute()
        if any(v is None or len(v) != nbytes for v in values):
            raise RuntimeError("bare GET missed")

    return {"store": bare_set, "load": bare_get}


async def against_bare_redis(
    args: argparse.Namespace,
    n: int,
    nbytes: int,
    *,
    tier: SecondaryTier,
    bare: Any,
    keys: tuple[Sequence[bytes], Sequence[bytes]],
    hashes: Sequence[BlockHash],
    src: Sequence[memoryview],
    dst: Sequence[memoryview],
    reset: Callable[[], Awaitable[None]],
) -> list[tuple[str, float, float, float]]:
    """`side_by_side()` of a Redis or Redis Cluster tier against pipelined ``SET``/``GET``
    on the bare client ``bare`` (``keys[0]``); with ``--calibrate``, the bare client against
    itself on ``keys[1]``, for the noise floor. A bare ``GET`` copies nothing into the host
    blocks: only the tier's copies are checked."""
    return await side_by_side(
        args,
        n,
        nbytes,
        ours=(
            pipelined_ops(bare, keys[1], src, nbytes)
            if args.calibrate
            else tier_ops(tier, args, nbytes=nbytes, hashes=hashes, src=src, dst=dst)
        ),
        base=pipelined_ops(bare, keys[0], src, nbytes),
        reset=reset,
        check=(lambda: None) if args.calibrate else functools.partial(check_copies, src, dst),
    )
