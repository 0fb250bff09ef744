"""The write-down writers of one tier all take work (no lost wake-ups)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import anyio
import pytest
from tier_helpers import compute_and_store, config, make_kv, settle, tier_stats, wait_until

from kvoffload.offloader import KVOffloader
from kvoffload.tiers.base import BlockWrite
from kvoffload.tiers.disk import DiskTier

pytestmark = pytest.mark.anyio


async def test_every_writer_of_a_tier_takes_a_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    release = anyio.Event()
    running = 0
    most = 0
    put = DiskTier.put

    async def held_put(self: DiskTier, blocks: Sequence[BlockWrite]) -> int:
        nonlocal running, most
        running += 1
        most = max(most, running)
        try:
            await release.wait()
            return await put(self, blocks)
        finally:
            running -= 1

    monkeypatch.setattr(DiskTier, "put", held_put)
    tier = {
        "kind": "disk",
        "path": str(tmp_path / "kv.bin"),
        "capacity_bytes": 1 << 20,
        "max_in_flight": 4,  # three writers
        "max_batch_blocks": 1,
    }
    kv = make_kv()
    async with KVOffloader(config([tier]), kv) as off:
        for i in range(3):
            await compute_and_store(off, kv, f"r{i}", [i * 1000 + t for t in range(5)], [i])
        # Three batches queued: each writer takes one, all three wait in put at once.
        await wait_until(lambda: most == 3)
        release.set()
        await settle(off)
        assert tier_stats(off).blocks_written == 3
