"""KV cache groups through a tier: a block of one group is never served as another's.

Each group hashes in its own namespace (`KVCacheGroup.namespace()`), whose root is both
in every key and in the verified header, so the same tokens give different keys per group,
and a block read back under another group's namespace fails verification.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvoffload.errors import IntegrityError
from kvoffload.groups import KVCacheGroup
from kvoffload.hashing import BlockHash, BlockHasher
from kvoffload.tiers.base import BlockWrite
from kvoffload.tiers.disk import DiskTier
from kvoffload.tiers.format import encode_header, verify_block

pytestmark = pytest.mark.anyio

NBYTES = 4096
GROUPS = (
    KVCacheGroup(name="full", kind="full", block_size=4, num_layers=2, bytes_per_layer_block=2048),
    KVCacheGroup(
        name="swa",
        kind="sliding_window",
        window=9,
        block_size=4,
        num_layers=2,
        bytes_per_layer_block=2048,
    ),
)
TOKENS = list(range(12))


def keys(group: KVCacheGroup) -> tuple[bytes, list[BlockHash]]:
    root = group.namespace(model_id="m").root
    hasher = BlockHasher(root, group.block_size)
    hasher.extend(TOKENS)
    return root, list(hasher.block_hashes)


def payload(group: KVCacheGroup, i: int) -> bytes:
    return bytes([(GROUPS.index(group) * 50 + i) % 256]) * NBYTES


async def test_a_round_trip_serves_each_group_its_own_blocks_only(tmp_path: Path) -> None:
    full, swa = GROUPS
    full_root, full_keys = keys(full)
    swa_root, swa_keys = keys(swa)
    assert full_root != swa_root
    assert not set(full_keys) & set(swa_keys)  # same tokens, different keys
    tier = DiskTier(
        tmp_path / "kv.bin",
        DiskTier.file_bytes(8, NBYTES),
        block_nbytes=NBYTES,
        namespace=full_root,
    )
    await tier.open()
    writes = [
        BlockWrite(k, encode_header(full_root, k, payload(full, i)), memoryview(payload(full, i)))
        for i, k in enumerate(full_keys)
    ]
    assert await tier.put(writes) == 3
    # the sliding-window group asks for the same tokens: its keys miss
    assert await tier.exists(swa_keys) == 0
    bufs = [memoryview(bytearray(NBYTES)) for _ in swa_keys]
    assert await tier.get(swa_keys, bufs) == [None, None, None]
    # the full group reads its own blocks back, verified, bytes exact
    buf = memoryview(bytearray(NBYTES))
    (read,) = await tier.get([full_keys[1]], [buf])
    assert read is not None
    verify_block(
        read.header,
        namespace=full_root,
        block_hash=full_keys[1],
        expected_length=NBYTES,
        received_length=read.payload_length,
        payload=buf,
    )
    assert bytes(buf) == payload(full, 1)
    # a reader that verified it as the other group's block would refuse it
    with pytest.raises(IntegrityError, match="namespace"):
        verify_block(
            read.header,
            namespace=swa_root,
            block_hash=full_keys[1],
            expected_length=NBYTES,
            received_length=read.payload_length,
            payload=buf,
        )
    await tier.close()
