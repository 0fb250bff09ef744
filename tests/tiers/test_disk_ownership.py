"""Which file a DiskTier may touch: its lock (one tier per file, across processes too), and
what it does when its path is replaced under it (adopt a persisted file of its own
geometry and namespace, refuse anything else, untouched)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvoffload.errors import TierError
from kvoffload.hashing import BlockHash
from kvoffload.tiers.base import BlockWrite
from kvoffload.tiers.disk import DiskTier
from kvoffload.tiers.format import encode_header, verify_block

pytestmark = pytest.mark.anyio

NS = hashlib.sha256(b"ownership").digest()
NBYTES = 8192
WRITER = Path(__file__).with_name("disk_writer.py")
ROOT = Path(__file__).resolve().parents[2]


def h(i: int) -> BlockHash:
    return BlockHash(hashlib.sha256(f"own{i}".encode()).digest())


def payload(i: int) -> bytes:
    return hashlib.sha256(f"owned{i}".encode()).digest() * (NBYTES // 32)


def write(i: int) -> BlockWrite:
    data = payload(i)
    return BlockWrite(h(i), encode_header(NS, h(i), data), memoryview(bytearray(data)))


def tier(path: Path, slots: int = 4, namespace: bytes = NS, **kw: object) -> DiskTier:
    size = DiskTier.file_bytes(slots, NBYTES)
    return DiskTier(path, size, block_nbytes=NBYTES, namespace=namespace, **kw)  # type: ignore[arg-type]


async def read_ok(t: DiskTier, i: int) -> bool:
    buf = memoryview(bytearray(NBYTES))
    (read,) = await t.get([h(i)], [buf])
    if read is None:
        return False
    verify_block(
        read.header,
        namespace=NS,
        block_hash=h(i),
        expected_length=NBYTES,
        received_length=read.payload_length,
        payload=buf,
    )
    return bytes(buf) == payload(i)


async def test_a_second_tier_on_one_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "kv.bin"
    first = tier(path)
    await first.open()
    await first.put([write(0)])
    second = tier(path)
    with pytest.raises(TierError, match=r"kv\.bin is in use by another disk tier"):
        await second.open()
    await second.close()  # closing the refused tier removes nothing
    assert path.exists()
    assert await read_ok(first, 0)  # the first tier's file was not truncated
    await first.close()
    third = tier(path)
    await third.open()  # the lock went with the first tier
    await third.close()


def start_writer(path: Path) -> subprocess.Popen[str]:
    """A process whose persistent disk tier writes ``path`` until killed, once it is open."""
    proc = subprocess.Popen(
        [sys.executable, str(WRITER), str(path), "8", str(NBYTES)],
        stdout=subprocess.PIPE,
        text=True,
        # This checkout's kvoffload, whatever the environment has installed.
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    return proc


async def test_a_tier_in_another_process_holds_the_file(tmp_path: Path) -> None:
    path = tmp_path / "kv.bin"
    proc = start_writer(path)
    try:
        size = path.stat().st_size
        mine = DiskTier(
            path,
            DiskTier.file_bytes(8, NBYTES),
            block_nbytes=NBYTES,
            namespace=hashlib.sha256(b"kill-test").digest(),
            persist=True,
        )
        with pytest.raises(TierError, match="in use by another disk tier"):
            await mine.open()
        await mine.close()
        assert path.stat().st_size == size
        assert proc.poll() is None  # the writer is still writing its file
    finally:
        proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


async def test_a_foreign_file_at_the_path_is_never_overwritten(tmp_path: Path) -> None:
    path = tmp_path / "kv.bin"
    foreign = os.urandom(20_000)
    path.write_bytes(foreign)
    t = tier(path)
    with pytest.raises(TierError, match=r"kv\.bin holds 20000 bytes that are not a disk tier"):
        await t.open()
    await t.close()
    assert path.read_bytes() == foreign


async def test_a_foreign_file_that_replaced_the_tiers_file_is_left_untouched(
    tmp_path: Path,
) -> None:
    path = tmp_path / "kv.bin"
    t = tier(path, persist=True)
    await t.open()
    await t.put([write(0)])
    foreign = os.urandom(20_000)
    other = tmp_path / "other"
    other.write_bytes(foreign)
    other.replace(path)
    for _ in range(2):  # each retry refuses again, naming the path and why
        with pytest.raises(TierError, match=r"kv\.bin was replaced .* not a disk tier file"):
            await t.ping()
    assert path.read_bytes() == foreign
    await t.close()
    assert path.read_bytes() == foreign


async def test_another_geometry_or_namespace_is_refused_on_recovery(tmp_path: Path) -> None:
    path = tmp_path / "kv.bin"
    t = tier(path)
    await t.open()
    for other, why in (
        (tier(tmp_path / "a.bin", slots=8, persist=True), "bytes, this tier's file has"),
        (tier(tmp_path / "b.bin", namespace=b"\1" * 32, persist=True), "another format"),
    ):
        await other.open()
        await other.put([write(1)])
        await other.close()
        before = other.path.read_bytes()
        other.path.replace(path)
        with pytest.raises(TierError, match=why):
            await t.ping()
        assert path.read_bytes() == before
    await t.close()
    assert path.exists()  # never ours: not removed at close


@pytest.mark.parametrize("persist", [True, False])
async def test_a_persisted_file_moved_into_place_is_adopted_and_served(
    tmp_path: Path, persist: bool
) -> None:
    warm_path = tmp_path / "warm.bin"
    warm = tier(warm_path, persist=True)
    await warm.open()
    await warm.put([write(i) for i in range(3)])
    await warm.close()
    path = tmp_path / "kv.bin"
    t = tier(path, persist=persist)
    await t.open()
    await t.put([write(9)])
    before = warm_path.read_bytes()
    warm_path.replace(path)
    await t.ping()  # adopted, not wiped
    stats = t.statistics()
    assert stats["adopted"] == 1
    assert stats["recreated"] == 0
    assert stats["slots_used"] == 3
    assert await t.exists([h(0), h(1), h(2)]) == 3
    for i in range(3):
        assert await read_ok(t, i)
    assert not await read_ok(t, 9)
    assert path.read_bytes() == before
    await t.close()
    assert path.exists()  # adopted, so kept at close even without persist
