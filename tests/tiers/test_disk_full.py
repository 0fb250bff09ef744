"""FM-42, the disk filling up mid-run: a real, tiny tmpfs and a sparse disk tier file.

The file system is a tmpfs mounted for the test (root needed; the tests skip, saying so,
where ``mount`` is refused). A filler file leaves room for a few slots only, so writes
fail with ``ENOSPC`` part-way through the run; removing the filler frees the space.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest
from tier_helpers import (
    check,
    compute_and_store,
    config,
    lookup_load,
    make_kv,
    settle,
    tier_stats,
    tokens,
    wait_until,
)

from kvoffload.errors import TierError
from kvoffload.hashing import BlockHash
from kvoffload.offloader import KVOffloader
from kvoffload.tiers.base import BlockWrite
from kvoffload.tiers.disk import DiskTier
from kvoffload.tiers.format import encode_header, verify_block

pytestmark = pytest.mark.anyio

FS_BYTES = 512 * 1024
NS = hashlib.sha256(b"full").digest()
NBYTES = 8192
SLOT = 4096 + NBYTES


class SmallFs:
    """A mounted tmpfs of ``FS_BYTES`` and a filler file that takes most of it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.filler = root / "filler"

    def free(self) -> int:
        st = os.statvfs(self.root)
        return st.f_bavail * st.f_frsize

    def leave_free(self, nbytes: int) -> None:
        """Grow the filler until about ``nbytes`` stay free (whole pages)."""
        grow = self.free() - nbytes
        assert grow > 0, (self.free(), nbytes)
        with self.filler.open("ab") as f:
            f.write(b"\xa5" * grow)
        assert self.free() <= nbytes + 4096

    def make_room(self) -> None:
        self.filler.unlink()


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[SmallFs]:
    root = tmp_path / "small"
    root.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", f"size={FS_BYTES}", "tmpfs", str(root)]
    if shutil.which("mount") is None or subprocess.run(mount, check=False).returncode:
        pytest.skip("cannot mount a tmpfs here (needs mount and CAP_SYS_ADMIN)")
    try:
        yield SmallFs(root)
    finally:
        subprocess.run(["umount", str(root)], check=False)


def h(i: int) -> BlockHash:
    return BlockHash(hashlib.sha256(f"full{i}".encode()).digest())


def payload(i: int) -> bytes:
    return hashlib.sha256(f"data{i}".encode()).digest() * (NBYTES // 32)


def write(i: int) -> BlockWrite:
    data = payload(i)
    return BlockWrite(h(i), encode_header(NS, h(i), data), memoryview(bytearray(data)))


async def read_ok(t: DiskTier, i: int) -> None:
    buf = memoryview(bytearray(NBYTES))
    (read,) = await t.get([h(i)], [buf])
    assert read is not None, i
    verify_block(
        read.header,
        namespace=NS,
        block_hash=h(i),
        expected_length=NBYTES,
        received_length=read.payload_length,
        payload=buf,
        payload_checksum=read.payload_checksum,
    )
    assert bytes(buf) == payload(i)


@pytest.mark.parametrize("direct_io", ["auto", "never"])
async def test_enospc_mid_run_indexes_nothing_and_recovers(
    small_fs: SmallFs, direct_io: str, caplog: pytest.LogCaptureFixture
) -> None:
    # A sparse file far larger than the file system: its slots take space as written.
    t = DiskTier(
        small_fs.root / "kv.bin",
        4096 + 128 * SLOT,
        block_nbytes=NBYTES,
        namespace=NS,
        preallocate=False,
        direct_io=direct_io,
    )
    await t.open()
    assert t.statistics()["preallocated"] is False
    small_fs.leave_free(5 * SLOT + 2048)
    stored: list[int] = []
    failed: list[int] = []
    errors: list[str] = []
    with caplog.at_level(logging.WARNING, logger="kvoffload"):
        for lo in range(0, 30, 3):  # runs of three consecutive slots, one pwritev each
            batch = list(range(lo, lo + 3))
            try:
                await t.put([write(i) for i in batch])
            except TierError as exc:
                errors.append(str(exc))
                failed = batch
                break
            stored += batch
    assert failed, "the file system never filled up"
    assert "ENOSPC" in errors[0], errors
    assert 3 <= len(stored) <= 6
    stats = t.statistics()
    assert stats["enospc_errors"] == 1
    # No index entry for any block of the failed call, even one written in full.
    for i in failed:
        assert await t.exists([h(i)]) == 0
    assert stats["slots_used"] == len(stored)
    # The errno is logged (an ENOSPC error, or the short write that ENOSPC causes).
    logged = [r.getMessage() for r in caplog.records]
    assert any("ENOSPC" in m or "disk_tier_short_write" in m for m in logged), logged
    # What was stored before is intact and verified.
    for i in stored:
        await read_ok(t, i)
    # Still full: ping says so, with the errno, and keeps saying so.
    with pytest.raises(TierError, match="ENOSPC"):
        await t.ping()
    with pytest.raises(TierError, match="ENOSPC"):
        await t.ping()
    small_fs.make_room()
    await t.ping()
    assert await t.put([write(i) for i in failed]) == 3
    for i in [*stored, *failed]:
        await read_ok(t, i)
    await t.close()


async def test_engine_keeps_serving_from_cpu_while_the_disk_is_full(small_fs: SmallFs) -> None:
    # 1 KiB blocks: a slot is 4 KiB (without persist, header pages are never written)
    kv = make_kv()
    slot = 4096
    tier = {
        "kind": "disk",
        "path": str(small_fs.root / "kv.bin"),
        "capacity_bytes": "1MiB",  # more than the file system holds
        "preallocate": False,
        "retry_initial_s": 0.02,
        "retry_max_s": 0.05,
        "max_batch_blocks": 2,
    }
    async with KVOffloader(config([tier]), kv) as off:
        small_fs.leave_free(3 * slot + 2048)
        prompts = [tokens(40 + p, 4) for p in range(3)]
        for p, prompt in enumerate(prompts):
            await compute_and_store(off, kv, f"s{p}", prompt, range(4 * p, 4 * p + 4))
            await settle(off)
        stats = tier_stats(off)
        assert stats.writes_failed >= 1
        assert stats.unhealthy_events >= 1
        # It cannot write, but it still reads: healthy, not writable.
        assert stats.healthy
        assert not stats.writable
        assert "ENOSPC" in stats.last_error
        assert int(stats.details["enospc_errors"]) >= 1
        assert stats.blocks_written <= 3
        check(off)
        # The engine keeps serving every prompt from the CPU pool, bit-exact.
        for p, prompt in enumerate(prompts):
            assert await lookup_load(off, kv, f"l{p}", prompt, range(16, 20)) == 4 * 4
        # While the disk stays full the retries fail (backing off) and nothing is written.
        errors = tier_stats(off).errors
        await anyio.sleep(0.2)
        stats = tier_stats(off)
        assert stats.healthy
        assert not stats.writable
        assert stats.errors > errors
        assert "ENOSPC" in stats.last_error
        assert stats.writes_skipped_unhealthy >= 1
        # Room again: the tier comes back, takes write-downs, and serves them after a reset.
        small_fs.make_room()
        await wait_until(lambda: tier_stats(off).writable)
        assert tier_stats(off).recoveries >= 1
        written = tier_stats(off).blocks_written
        fresh = tokens(50, 4)
        await compute_and_store(off, kv, "fresh", fresh, range(20, 24))
        await settle(off)
        assert tier_stats(off).blocks_written == written + 4
        await off.reset()
        assert await lookup_load(off, kv, "again", fresh, range(24, 28)) == 4 * 4
        assert tier_stats(off).blocks_promoted >= 4
        check(off)


async def test_blocks_written_before_the_disk_filled_are_served_while_it_is_full(
    small_fs: SmallFs,
) -> None:
    # 1 KiB blocks: a slot is 4 KiB (without persist, header pages are never written).
    kv = make_kv()
    slot = 4096
    tier = {
        "kind": "disk",
        "path": str(small_fs.root / "kv.bin"),
        "capacity_bytes": "1MiB",  # more than the file system holds
        "preallocate": False,
        "retry_initial_s": 0.02,
        "retry_max_s": 0.05,
        "max_batch_blocks": 4,
    }
    async with KVOffloader(config([tier], num_cpu_blocks=48), kv) as off:
        # Ten prompts of four blocks, written down while there is room.
        prompts = [tokens(60 + p, 4) for p in range(10)]
        for p, prompt in enumerate(prompts):
            await compute_and_store(off, kv, f"s{p}", prompt, range(4 * (p % 2), 4 * (p % 2) + 4))
            await settle(off)
        assert tier_stats(off).blocks_written == 40
        # Now the file system fills up: the next write-down fails with ENOSPC.
        small_fs.leave_free(slot // 2)
        await compute_and_store(off, kv, "more", tokens(70, 4), range(8, 12))
        await settle(off)
        await wait_until(lambda: not tier_stats(off).writable)
        stats = tier_stats(off)
        assert "ENOSPC" in stats.last_error
        assert stats.healthy  # it cannot write, but it reads
        # The CPU pool forgets everything: all 40 intact blocks come back from the disk,
        # bit-exact (lookup_load checks every block), while the disk is still full.
        await off.reset()
        for p, prompt in enumerate(prompts):
            assert await lookup_load(off, kv, f"l{p}", prompt, range(16, 20)) == 4 * 4, p
            await settle(off)
        stats = tier_stats(off)
        assert stats.blocks_promoted == 40
        assert not stats.writable
        assert small_fs.free() < slot
        check(off)
