"""Writes blocks into a persistent DiskTier in a loop until it is killed.

Usage: python disk_writer.py PATH SLOTS BLOCK_BYTES
Prints "ready" once the file exists; block i's payload is a function of i only.
"""

from __future__ import annotations

import hashlib
import sys

import anyio

from kvoffload.hashing import BlockHash
from kvoffload.tiers.base import BlockWrite
from kvoffload.tiers.disk import DiskTier
from kvoffload.tiers.format import encode_header

NS = hashlib.sha256(b"kill-test").digest()


def block_hash(i: int) -> BlockHash:
    return BlockHash(hashlib.sha256(f"block{i}".encode()).digest())


def payload(i: int, nbytes: int) -> bytes:
    return hashlib.sha256(f"payload{i}".encode()).digest() * (nbytes // 32)


async def main(path: str, slots: int, nbytes: int) -> None:
    tier = DiskTier(
        path, DiskTier.file_bytes(slots, nbytes), block_nbytes=nbytes, namespace=NS, persist=True
    )
    await tier.open()
    print("ready", flush=True)
    i = 0
    while True:  # overwrite slots in LRU order, forever
        data = payload(i, nbytes)
        h = block_hash(i)
        await tier.put([BlockWrite(h, encode_header(NS, h, data), memoryview(bytearray(data)))])
        i += 1


if __name__ == "__main__":
    anyio.run(main, sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
