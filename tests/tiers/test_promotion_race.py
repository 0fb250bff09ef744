"""A promotion from a tier never publishes a hash whose CPU store is still in flight.

The block ledger owns the pending stores and the promotions' CPU blocks together: a
promotion skips a hash that is being stored right now (no second read of it from the
tier), and the store's completion is what publishes it (counted once).
"""

from __future__ import annotations

import threading
from pathlib import Path

import anyio
import pytest
from tier_helpers import BS, check, compute_and_store, config, make_kv, settle, tier_stats, tokens

from kvoffload.hashing import BlockHash
from kvoffload.offloader import KVOffloader
from kvoffload.testing import CopyFaults
from kvoffload.transfer.thread_engine import ThreadCopyEngine

pytestmark = pytest.mark.anyio


def disk(path: Path) -> dict[str, object]:
    return {"kind": "disk", "path": str(path), "capacity_bytes": "4MiB"}


async def test_promotion_skips_a_hash_whose_store_is_in_flight(tmp_path: Path) -> None:
    kv = make_kv()
    async with KVOffloader(config([disk(tmp_path / "kv.bin")]), kv) as off:
        prompt = tokens(7, 3)
        hashes = await compute_and_store(off, kv, "a", prompt, range(3))
        await settle(off)
        assert tier_stats(off).blocks_written == 3
        assert await off.reset()
        # Store the same prompt again, behind a gate that holds every copy.
        gate = threading.Event()
        engine = off._life.engines["g0"]
        assert isinstance(engine, ThreadCopyEngine)
        engine._copy_hook = CopyFaults(gate=gate)
        try:
            await _race(off, prompt, hashes, gate)
        finally:
            gate.set()


async def _race(
    off: KVOffloader, prompt: list[int], hashes: list[BlockHash], gate: threading.Event
) -> None:
    off.update("b", [0, 1, 2], hashes, 3 * BS)
    tasks = off.store()
    assert tasks
    # Another request looks the prefix up without allow_defer: nothing is on CPU yet.
    assert off.lookup("c", hashes, len(prompt)) == 0
    off.release("c")
    tiers = off.tiers
    assert tiers is not None
    with anyio.fail_after(10):
        while tiers.statistics().promotions_in_flight:
            await anyio.sleep(0.005)
    check(off)  # no hash of a block in flight is published
    assert tier_stats(off).blocks_read == 0  # nothing read twice
    assert off.pool.num_cached == 0
    gate.set()
    for task in tasks:
        await task
    await settle(off)
    check(off)
    assert off.statistics().scheduler.stored_blocks == 6
    assert off.pool.num_cached == 3
    assert off.lookup("d", hashes, len(prompt)) == 3 * BS
    off.release("d")
    for rid in ("b", "c", "d"):
        off.finish(rid)
    check(off)
