"""The tier operations every reader and writer of the tiers shares: the chained probe, the
verified read and the bounded write.

The tier manager's promoter and write-down writers call them, and so does
`kvoffload.tiers.bridge.TierBridge` (the engines' own tier interfaces): one place where a
block read from a tier is verified (header, namespace, hash, length, checksum; a block
that fails is a miss, is deleted and is counted), where every operation runs within the
tier's ``op_timeout_s`` and through its `PriorityGate`, and where a failure marks the tier
unhealthy or read-only (`TierHealth`). All run on the event loop that owns the tiers.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import anyio
import anyio.to_thread

from kvoffload._logging import get_logger
from kvoffload.errors import IntegrityError
from kvoffload.hashing import BlockHash
from kvoffload.tiers.base import BlockRead, BlockWrite
from kvoffload.tiers.format import encode_header, verify_block

if TYPE_CHECKING:
    from kvoffload.tiers.health import TierHealth, TierState

__all__ = ["probe", "read_verified", "verify_reads", "write_blocks"]

_log = get_logger("tiers")


async def probe(
    tiers: Sequence[TierState],
    health: TierHealth,
    hashes: Sequence[BlockHash],
    *,
    on_failed: Callable[[Sequence[BlockHash]], None] | None = None,
) -> list[tuple[TierState, int, int]]:
    """Find, tier by tier, the leading run of ``hashes`` the healthy tiers hold together.
    ``on_failed`` hears of the block at which a tier failed to answer.

    Returns:
        ``(tier, lo, hi)``: ``hashes[lo:hi]`` are in that tier; the runs follow each other
        from 0.
    """
    sources: list[tuple[TierState, int, int]] = []
    run = 0
    progress = True
    while progress and run < len(hashes):
        progress = False
        for t in tiers:
            if not t.healthy or run >= len(hashes):
                continue
            await t.gate.acquire(read=True)
            try:
                with anyio.fail_after(t.timeout_s):
                    k = await t.tier.exists(hashes[run:])
            except Exception as exc:
                health.fault(t, exc, "exists")
                if on_failed is not None:
                    on_failed(hashes[run : run + 1])
                continue
            finally:
                t.gate.release()
            k = max(0, min(k, len(hashes) - run))
            if k:
                sources.append((t, run, run + k))
                run += k
                progress = True
    return sources


def verify_reads(
    hashes: Sequence[BlockHash],
    views: Sequence[memoryview],
    reads: Sequence[BlockRead | None],
    *,
    namespace: bytes,
    nbytes: int,
) -> list[str | None]:
    """Per block: ``None`` when it passed `verify_block()`, ``"miss"`` when the tier had
    none, else the name of the check it failed."""
    if len(reads) != len(hashes):
        return ["length"] * len(hashes)
    reasons: list[str | None] = []
    for block_hash, view, read in zip(hashes, views, reads, strict=True):
        if read is None:
            reasons.append("miss")
            continue
        try:
            verify_block(
                read.header,
                namespace=namespace,
                block_hash=block_hash,
                expected_length=nbytes,
                received_length=read.payload_length,
                payload=view,
                payload_checksum=read.payload_checksum,
            )
        except IntegrityError as exc:
            reasons.append(exc.reason)
        else:
            reasons.append(None)
    return reasons


async def read_verified(
    t: TierState,
    health: TierHealth,
    hashes: Sequence[BlockHash],
    views: Sequence[memoryview],
    *,
    namespace: bytes,
    nbytes: int,
    on_failed: Callable[[Sequence[BlockHash]], None] | None = None,
) -> list[bool]:
    """Read blocks of tier ``t`` into ``views`` and verify each; ``on_failed`` hears of the
    blocks a tier error or a failed check lost (not of plain misses).

    Returns:
        Per block, whether it arrived and passed every check. A block that failed one is
        deleted from the tier and counted (``failed_checks``); a tier error marks the tier
        unhealthy and every block is a miss. The bytes of a block that is not good are
        undefined: never publish them.
    """
    await t.gate.acquire(read=True)
    start = time.perf_counter()
    try:
        with anyio.fail_after(t.timeout_s):
            reads = await t.tier.get(hashes, views)
    except Exception as exc:
        health.fault(t, exc, "get")
        if on_failed is not None:
            on_failed(hashes)
        return [False] * len(hashes)
    finally:
        t.read_seconds += time.perf_counter() - start
        t.gate.release()
    check = functools.partial(
        verify_reads, hashes, views, reads, namespace=namespace, nbytes=nbytes
    )
    if all(r is None or r.payload_checksum is not None for r in reads):
        # The payload checksums were taken by the thread that read them: what is left
        # (header crc, namespace, hash, length, comparing checksums) is cheap.
        reasons = check()
    else:
        reasons = await anyio.to_thread.run_sync(check)
    good: list[bool] = []
    bad: list[BlockHash] = []
    for block_hash, reason in zip(hashes, reasons, strict=True):
        if reason is None:
            t.blocks_read += 1
            t.bytes_read += nbytes
            good.append(True)
            continue
        good.append(False)
        if reason == "miss":
            t.read_misses += 1
            continue
        t.failed_checks += 1
        bad.append(block_hash)
        _log.warning(
            "tier_block_rejected", tier=t.tier.name, block_hash=block_hash.hex()[:16], reason=reason
        )
    if bad:
        if on_failed is not None:
            on_failed(bad)
        await t.gate.acquire(read=True)
        try:
            with anyio.fail_after(t.timeout_s):
                await t.tier.delete(bad)
        except Exception as exc:
            health.fault(t, exc, "delete")
        finally:
            t.gate.release()
    return good


async def write_blocks(
    t: TierState,
    health: TierHealth,
    hashes: Sequence[BlockHash],
    views: Sequence[memoryview],
    *,
    namespace: bytes,
    nbytes: int,
) -> int:
    """Write blocks into tier ``t``, each sealed with its header (`encode_header`, built in
    the tier's worker thread).

    Returns:
        Blocks the tier reported stored; 0 when the tier is unhealthy or read-only
        (counted as skipped) or the write failed (counted; the tier is marked read-only
        when it can still read, else unhealthy). The caller keeps ``views`` unchanged
        until this returns.
    """
    if not hashes:
        return 0
    # The tier builds each header (the payload's checksum) in the worker thread that
    # writes the block: no extra hand-off, and no checksum on the event loop.
    writes = [
        BlockWrite(h, b"", v, seal=functools.partial(encode_header, namespace, h, v))
        for h, v in zip(hashes, views, strict=True)
    ]
    await t.gate.acquire(read=False)
    start = time.perf_counter()
    try:
        if not (t.healthy and t.writable):
            t.skipped_unhealthy += len(hashes)
            return 0
        with anyio.fail_after(t.timeout_s):
            stored = await t.tier.put(writes)
    except Exception as exc:
        t.writes_failed += len(hashes)
        if health.reads_ok(t):
            health.fault_write(t, exc, "put")
        else:
            health.fault(t, exc, "put")
        return 0
    else:
        stored = max(0, min(stored, len(hashes)))
        t.blocks_written += stored
        t.bytes_written += stored * nbytes
        t.writes_dropped += len(hashes) - stored
        return stored
    finally:
        t.write_seconds += time.perf_counter() - start
        t.gate.release()
