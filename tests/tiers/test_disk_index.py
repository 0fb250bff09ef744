"""The disk tier's slot index: a refused call claims nothing, pins are released once."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from kvoffload.hashing import BlockHash
from kvoffload.tiers.base import BlockWrite
from kvoffload.tiers.disk import DiskTier
from kvoffload.tiers.disk_index import SlotIndex
from kvoffload.tiers.format import encode_header

pytestmark = pytest.mark.anyio

NS = hashlib.sha256(b"index").digest()
NBYTES = 4096


def h(i: int) -> BlockHash:
    return BlockHash(hashlib.sha256(f"index{i}".encode()).digest())


def write(i: int, nbytes: int = NBYTES) -> BlockWrite:
    data = bytes([i % 256]) * nbytes
    return BlockWrite(h(i), encode_header(NS, h(i), data), memoryview(bytearray(data)))


async def test_a_put_refused_for_a_bad_payload_claims_no_slot(tmp_path: Path) -> None:
    t = DiskTier(
        tmp_path / "kv.bin", DiskTier.file_bytes(2, NBYTES), block_nbytes=NBYTES, namespace=NS
    )
    await t.open()
    with pytest.raises(ValueError, match="payload of 100 bytes"):
        await t.put([write(0), write(1), write(2, nbytes=100)])
    # Nothing of the refused call is left half-claimed: both blocks and both slots are
    # there for the next call.
    assert await t.put([write(0), write(1)]) == 2
    assert await t.exists([h(0), h(1)]) == 2
    await t.close()


def test_claim_settle_and_pins() -> None:
    index = SlotIndex(3)
    index.reset()
    held, jobs = index.claim([write(0), write(1)], NBYTES, "d")
    assert (held, [slot for _, slot in jobs]) == (0, [0, 1])
    assert index.busy()
    index.settle(jobs, 1)  # the second write failed: its slot is free again
    assert not index.busy()
    assert (len(index), index.free) == (1, [2, 1])
    buf = memoryview(bytearray(NBYTES))
    pins = index.pin([h(1), h(0)], [buf, buf], NBYTES)
    assert pins == [(1, 0)]
    index.drop([h(0)])  # dropped while read: freed only when the read ends
    assert 0 not in index.free
    index.unpin(pins)
    assert index.free[-1] == 0
    assert not index.busy()
