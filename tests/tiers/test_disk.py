"""DiskTier against real files: slots, LRU, persistence, torn and foreign slots, faults."""

from __future__ import annotations

import hashlib
import mmap
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest
from tier_helpers import patch_file

from kvoffload.errors import ConfigError, IntegrityError, TierError
from kvoffload.hashing import BlockHash
from kvoffload.tiers.base import BlockWrite
from kvoffload.tiers.disk import DiskTier
from kvoffload.tiers.format import encode_header, verify_block

pytestmark = pytest.mark.anyio

NS = hashlib.sha256(b"namespace").digest()
NBYTES = 8192
SLOT = 4096 + NBYTES


def h(i: int) -> BlockHash:
    return BlockHash(hashlib.sha256(f"block{i}".encode()).digest())


def payload(i: int) -> bytes:
    return hashlib.sha256(f"payload{i}".encode()).digest() * (NBYTES // 32)


def write(i: int) -> BlockWrite:
    data = payload(i)
    return BlockWrite(h(i), encode_header(NS, h(i), data), memoryview(bytearray(data)))


def tier(path: Path, slots: int = 4, **kw: object) -> DiskTier:
    size = DiskTier.file_bytes(slots, NBYTES)
    return DiskTier(path, size, block_nbytes=NBYTES, namespace=NS, **kw)  # type: ignore[arg-type]


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
    assert bytes(buf) == payload(i)
    return True


async def test_put_get_exists_delete(tmp_path: Path) -> None:
    t = tier(tmp_path / "kv.bin")
    await t.open()
    assert await t.put([write(0), write(1)]) == 2
    assert await t.exists([h(0), h(1), h(2), h(0)]) == 2
    assert await read_ok(t, 0)
    assert await read_ok(t, 1)
    assert not await read_ok(t, 2)
    await t.delete([h(0), h(7)])
    assert await t.exists([h(0)]) == 0
    assert t.statistics()["slots_used"] == 1
    await t.close()
    assert not (tmp_path / "kv.bin").exists()


async def test_lru_eviction_keeps_capacity(tmp_path: Path) -> None:
    t = tier(tmp_path / "kv.bin", slots=3)
    await t.open()
    await t.put([write(0), write(1), write(2)])
    assert await read_ok(t, 0)  # 0 becomes the most recently used
    await t.put([write(3)])  # evicts 1, the least recently used
    assert await t.exists([h(1)]) == 0
    for i in (0, 2, 3):
        assert await read_ok(t, i)
    assert t.statistics()["slots_used"] == 3
    await t.close()


@pytest.fixture
async def direct_tier(tmp_path: Path) -> AsyncIterator[tuple[DiskTier, memoryview]]:
    """An open tier whose file system takes ``O_DIRECT``, and three blocks of page-aligned
    memory (the test drops its slices of it before it returns)."""
    t = tier(tmp_path / "kv.bin")
    await t.open()
    if not t.direct_io:
        await t.close()
        pytest.skip("this file system refuses O_DIRECT")
    mem = mmap.mmap(-1, NBYTES * 3)
    view = memoryview(mem)
    try:
        yield t, view
    finally:
        view.release()
        mem.close()
        await t.close()


async def test_direct_io_with_aligned_buffers(direct_tier: tuple[DiskTier, memoryview]) -> None:
    t, view = direct_tier
    view[:NBYTES] = payload(5)
    await t.put([BlockWrite(h(5), encode_header(NS, h(5), payload(5)), view[:NBYTES])])
    (read,) = await t.get([h(5)], [view[NBYTES : 2 * NBYTES]])
    assert read is not None
    assert bytes(view[NBYTES : 2 * NBYTES]) == payload(5)
    assert t.statistics()["direct_ios"] == 2


def read_at(path: Path, offset: int, size: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(size)


def io_calls(t: DiskTier) -> int:
    stats = t.statistics()
    return int(stats["direct_ios"]) + int(stats["buffered_ios"])


async def test_consecutive_slots_move_in_one_call_each_way(tmp_path: Path) -> None:
    t = tier(tmp_path / "kv.bin", slots=8)
    await t.open()
    mem = mmap.mmap(-1, NBYTES * 12)
    view = memoryview(mem)
    src: list[memoryview] = []
    dst: list[memoryview] = []
    writes: list[BlockWrite] = []
    try:
        src = [view[i * NBYTES : (i + 1) * NBYTES] for i in range(6)]
        for i in range(6):
            src[i][:] = payload(i)
        # Given out of order: the tier sorts by slot and still writes one run.
        order = [3, 0, 5, 1, 4, 2]
        writes = [BlockWrite(h(i), encode_header(NS, h(i), payload(i)), src[i]) for i in order]
        assert await t.put(writes) == 6
        assert io_calls(t) == 1
        dst = [view[(6 + i) * NBYTES : (7 + i) * NBYTES] for i in range(6)]
        reads = await t.get([h(i) for i in order], [dst[i] for i in order])
        assert io_calls(t) == 2
        for i, read in zip(order, reads, strict=True):
            assert read is not None
            verify_block(
                read.header,
                namespace=NS,
                block_hash=h(i),
                expected_length=NBYTES,
                received_length=read.payload_length,
                payload=dst[i],
            )
            assert bytes(dst[i]) == payload(i)
        # A hole in the slots splits the run: slots 0-1 and 3-4 after freeing slot 2.
        await t.delete([h(2)])
        before = io_calls(t)
        await t.get([h(0), h(1), h(3), h(4)], dst[:4])
        assert io_calls(t) - before == 2
    finally:
        del src, dst, writes
        view.release()
        mem.close()
        await t.close()


@pytest.mark.parametrize("nbytes", [4096, 5000, 8192])
def test_file_bytes_holds_exactly_that_many_slots(tmp_path: Path, nbytes: int) -> None:
    span = -(-nbytes // 4096) * 4096
    for slots in [*range(1, 70), 1000]:
        size = DiskTier.file_bytes(slots, nbytes)
        assert DiskTier(tmp_path / "x", size, block_nbytes=nbytes, namespace=NS).num_slots == slots
        more = DiskTier(tmp_path / "x", size + span - 1, block_nbytes=nbytes, namespace=NS)
        assert more.num_slots == slots
        if slots > 1:
            less = DiskTier(tmp_path / "x", size - 1, block_nbytes=nbytes, namespace=NS)
            assert less.num_slots == slots - 1
    # One 4 KiB header page per 32 slots, plus the superblock.
    assert DiskTier.file_bytes(64, 8192) == 4096 + 2 * 4096 + 64 * 8192
    with pytest.raises(ValueError, match="num_slots=0"):
        DiskTier.file_bytes(0, 8192)


async def test_runs_across_extents_persist_and_read_back(tmp_path: Path) -> None:
    # 70 slots are three extents (32 + 32 + 6); concurrent puts of odd-sized batches give
    # runs that start mid-extent, end mid-extent and are split at extent boundaries.
    path = tmp_path / "kv.bin"
    t = tier(path, slots=70, persist=True)
    await t.open()
    sizes = [5, 7, 16, 3, 11, 9, 13, 6]
    batches, at = [], 0
    for size in sizes:
        batches.append(range(at, at + size))
        at += size
    async with anyio.create_task_group() as tg:
        for batch in batches:
            tg.start_soon(t.put, [write(i) for i in batch])
    assert t.statistics()["slots_used"] == at == 70
    await t.close()
    again = tier(path, slots=70, persist=True)
    await again.open()
    assert again.statistics()["discarded_at_open"] == 0
    assert await again.exists([h(i) for i in range(70)]) == 70
    for i in range(70):
        assert await read_ok(again, i)
    await again.close()


async def test_without_persist_no_header_page_is_written(tmp_path: Path) -> None:
    path = tmp_path / "kv.bin"
    t = tier(path, slots=40)
    await t.open()
    await t.put([write(i) for i in range(40)])
    for extent_page in (4096, 4096 + 4096 + 32 * NBYTES):
        assert read_at(path, extent_page, 4096) == bytes(4096)
    # Reads are checked against the headers the tier wrote (kept in memory).
    for i in range(40):
        assert await read_ok(t, i)
    patch_file(path, t._offset(7) + 100, lambda old: bytes([old[0] ^ 0xFF]))
    with pytest.raises(IntegrityError) as info:
        await read_ok(t, 7)
    assert info.value.reason == "checksum"
    await t.close()


async def test_a_failed_header_page_write_never_serves_the_new_payload(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "kv.bin"
    t = tier(path, slots=4, persist=True)
    await t.open()
    await t.put([write(0), write(1)])  # slots 0-1: the run starts the extent, one call
    real_io = t._io.io
    header_page = t._header_offset(0)

    def io(write_: bool, buffers: list[memoryview], payloads: list[memoryview], at: int) -> int:
        if write_ and at == header_page and len(buffers) == 1:
            raise OSError(5, "Input/output error")  # the page alone, after the payload
        return real_io(write_, buffers, payloads, at)

    monkeypatch.setattr(t._io, "io", io)
    await t.delete([h(1)])
    with pytest.raises(TierError, match="EIO"):
        await t.put([write(2)])  # slot 1 again: payload written, header page not
    assert await t.exists([h(2)]) == 0
    assert await read_ok(t, 0)
    await t.close()
    # On disk, slot 1 still names block 1 over block 2's bytes: never served.
    again = tier(path, slots=4, persist=True)
    await again.open()
    assert await again.exists([h(2)]) == 0
    if await again.exists([h(1)]):
        with pytest.raises(IntegrityError) as info:
            await read_ok(again, 1)
        assert info.value.reason == "checksum"
    assert await read_ok(again, 0)
    await again.close()


async def test_a_file_of_the_old_format_is_formatted_again(tmp_path: Path) -> None:
    path = tmp_path / "kv.bin"
    t = tier(path, persist=True)
    await t.open()
    await t.put([write(0)])
    await t.close()
    patch_file(path, 8, lambda old: (1).to_bytes(4, "little"), size=4)  # format version 1
    again = tier(path, persist=True)
    await again.open()
    assert await again.exists([h(0)]) == 0
    assert again.statistics()["slots_used"] == 0
    await again.close()


async def test_unaligned_memory_goes_through_the_page_cache_per_call(
    direct_tier: tuple[DiskTier, memoryview],
) -> None:
    t, view = direct_tier
    odd = view[1 : 1 + NBYTES]  # one byte past a page boundary
    odd[:] = payload(1)
    await t.put([BlockWrite(h(1), encode_header(NS, h(1), payload(1)), odd)])
    assert t.statistics()["buffered_ios"] == 1
    assert t.direct_io  # refused for this buffer only
    aligned = view[2 * NBYTES : 3 * NBYTES]
    aligned[:] = payload(2)
    await t.put([BlockWrite(h(2), encode_header(NS, h(2), payload(2)), aligned)])
    assert t.statistics()["direct_ios"] == 1
    assert await read_ok(t, 1)
    assert await read_ok(t, 2)
    del odd, aligned


@pytest.mark.parametrize("direct_io", ["auto", "never"])
async def test_blocks_not_a_whole_page_round_trip_in_runs(tmp_path: Path, direct_io: str) -> None:
    nbytes = 5000  # the slot pads the payload to 8 KiB: a run skips the gap
    t = DiskTier(
        tmp_path / "kv.bin",
        DiskTier.file_bytes(4, nbytes),
        block_nbytes=nbytes,
        namespace=NS,
        direct_io=direct_io,
    )
    await t.open()
    data = [payload(i)[:nbytes] for i in range(4)]
    writes = [
        BlockWrite(h(i), encode_header(NS, h(i), data[i]), memoryview(bytearray(data[i])))
        for i in range(4)
    ]
    assert await t.put(writes) == 4
    assert io_calls(t) == 1
    bufs = [memoryview(bytearray(nbytes)) for _ in range(4)]
    reads = await t.get([h(i) for i in range(4)], bufs)
    assert io_calls(t) == 2
    for i, read in enumerate(reads):
        assert read is not None
        verify_block(
            read.header,
            namespace=NS,
            block_hash=h(i),
            expected_length=nbytes,
            received_length=read.payload_length,
            payload=bufs[i],
        )
        assert bytes(bufs[i]) == data[i]
    await t.close()


async def test_a_short_run_read_fails_only_the_cut_blocks(tmp_path: Path) -> None:
    path = tmp_path / "kv.bin"
    t = tier(path)
    await t.open()
    await t.put([write(0), write(1), write(2)])
    os.truncate(path, t._offset(1) + 100)  # block 1's payload cut, block 2 gone
    bufs = [memoryview(bytearray(NBYTES)) for _ in range(3)]
    reads = await t.get([h(0), h(1), h(2)], bufs)
    assert io_calls(t) == 2
    assert [r.payload_length if r else None for r in reads] == [NBYTES, 100, 0]
    assert bytes(bufs[0]) == payload(0)
    for i in (1, 2):
        read = reads[i]
        assert read is not None
        with pytest.raises(IntegrityError):
            verify_block(
                read.header,
                namespace=NS,
                block_hash=h(i),
                expected_length=NBYTES,
                received_length=read.payload_length,
                payload=bufs[i],
            )
    await t.close()


async def test_capacity_below_one_slot_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="holds no slot"):
        DiskTier(tmp_path / "x", 8192, block_nbytes=NBYTES, namespace=NS)


async def test_persist_rebuilds_the_index(tmp_path: Path) -> None:
    path = tmp_path / "kv.bin"
    t = tier(path, persist=True)
    await t.open()
    await t.put([write(0), write(1)])
    await t.close()
    assert path.exists()
    again = tier(path, persist=True)
    await again.open()
    assert await again.exists([h(0), h(1)]) == 2
    assert await read_ok(again, 1)
    await again.close()
    # Another namespace (or block size) finds no block of it: the file is reformatted.
    other = DiskTier(
        path,
        DiskTier.file_bytes(4, NBYTES),
        block_nbytes=NBYTES,
        namespace=b"\1" * 32,
        persist=True,
    )
    await other.open()
    assert await other.exists([h(0)]) == 0
    await other.close()


async def test_torn_header_is_discarded_at_open(tmp_path: Path) -> None:
    path = tmp_path / "kv.bin"
    t = tier(path, persist=True)
    await t.open()
    await t.put([write(0), write(1)])
    await t.close()
    # A crash in the middle of slot 0's header page.
    patch_file(path, t._header_offset(0) + 20, lambda old: b"\xff" * 30, size=30)
    again = tier(path, persist=True)
    await again.open()
    assert again.statistics()["discarded_at_open"] == 1
    assert await again.exists([h(0)]) == 0
    assert await again.exists([h(1)]) == 1
    await again.close()


async def test_torn_payload_fails_its_check_on_read(tmp_path: Path) -> None:
    path = tmp_path / "kv.bin"
    t = tier(path, persist=True)
    await t.open()
    await t.put([write(0)])
    await t.close()
    # The payload half written: the header looks fine.
    patch_file(path, t._offset(0) + NBYTES // 2, lambda old: b"\0" * len(old), NBYTES // 2)
    again = tier(path, persist=True)
    await again.open()
    assert await again.exists([h(0)]) == 1
    with pytest.raises(IntegrityError) as info:
        await read_ok(again, 0)
    assert info.value.reason == "checksum"
    await again.close()


async def test_truncated_file_reads_short(tmp_path: Path) -> None:
    path = tmp_path / "kv.bin"
    t = tier(path)
    await t.open()
    await t.put([write(0)])
    os.truncate(path, t._offset(0) + 100)
    with pytest.raises(IntegrityError) as info:
        await read_ok(t, 0)
    assert info.value.reason == "length"
    await t.close()


async def test_deleted_file_fails_writes_until_recreated(tmp_path: Path) -> None:
    path = tmp_path / "kv.bin"
    t = tier(path)
    await t.open()
    await t.put([write(0)])
    path.unlink()
    with pytest.raises(TierError, match="gone"):
        await t.put([write(1)])
    path.mkdir()  # something else sits at the path now: it cannot be recreated
    with pytest.raises(TierError, match="cannot open"):
        await t.ping()
    path.rmdir()
    await t.ping()  # recreated, empty
    assert t.statistics()["recreated"] == 1
    assert await t.exists([h(0)]) == 0
    assert await t.put([write(1)]) == 1
    assert await read_ok(t, 1)
    await t.close()
    assert not path.exists()


async def test_slot_being_read_is_not_reused(tmp_path: Path) -> None:
    t = tier(tmp_path / "kv.bin", slots=1)
    await t.open()
    await t.put([write(0)])
    t._readers[t._index[h(0)]] = 1  # a read of block 0 in flight
    assert await t.put([write(1)]) == 0
    t._readers.clear()
    assert await t.put([write(1)]) == 1
    await t.close()


async def test_process_killed_mid_write_never_serves_a_torn_block(tmp_path: Path) -> None:
    path = tmp_path / "kv.bin"
    nbytes = 4 << 20  # large blocks: a kill often lands inside a write
    writer = Path(__file__).with_name("disk_writer.py")
    env = {**os.environ, "PYTHONPATH": str(writer.parent)}
    proc = await anyio.open_process(
        [sys.executable, str(writer), str(path), "4", str(nbytes)], env=env
    )
    try:
        assert proc.stdout is not None
        with anyio.fail_after(60):
            await proc.stdout.receive()  # "ready"
        await anyio.sleep(0.5)
    finally:
        proc.send_signal(signal.SIGKILL)
        await proc.wait()
    ns = hashlib.sha256(b"kill-test").digest()
    t = DiskTier(
        path, DiskTier.file_bytes(4, nbytes), block_nbytes=nbytes, namespace=ns, persist=True
    )
    await t.open()
    served = rejected = 0
    buf = memoryview(bytearray(nbytes))
    for block_hash in list(t._index):
        (read,) = await t.get([block_hash], [buf])
        assert read is not None
        try:
            verify_block(
                read.header,
                namespace=ns,
                block_hash=block_hash,
                expected_length=nbytes,
                received_length=read.payload_length,
                payload=buf,
            )
        except IntegrityError:
            rejected += 1
            continue
        served += 1
        i = next(i for i in range(1_000_000) if writer_hash(i) == block_hash)
        assert bytes(buf) == writer_payload(i, nbytes)
    assert served + rejected + int(t.statistics()["discarded_at_open"]) >= 1
    await t.close()


def writer_hash(i: int) -> BlockHash:
    return BlockHash(hashlib.sha256(f"block{i}".encode()).digest())


def writer_payload(i: int, nbytes: int) -> bytes:
    return hashlib.sha256(f"payload{i}".encode()).digest() * (nbytes // 32)
