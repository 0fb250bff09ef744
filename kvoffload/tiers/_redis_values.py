"""What the Redis tiers share: keys, values (header + payload in one) and read replies.

A block is one value: the 96-byte header followed by the payload, written with a single
``SET`` so a reader sees the whole old value or the whole new one, never half a block.
Keys are ``<key_prefix><namespace digest, 16 hex>:<block hash, 64 hex>``. A ``GET`` reply
that is neither a value nor nil (an error: a key of another type answers ``WRONGTYPE``) is
a miss for that key alone, and the key is deleted and counted (`sort_replies()`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvoffload._logging import get_logger
from kvoffload.tiers.base import BlockRead, BlockWrite
from kvoffload.tiers.format import HEADER_SIZE, checksum

__all__ = ["make_key_prefix", "pack_values", "sort_replies", "unpack_values"]

_log = get_logger("tiers.redis")


def make_key_prefix(prefix: str, namespace: bytes) -> bytes:
    """The bytes every key of ``namespace`` starts with."""
    return f"{prefix}{namespace.hex()[:16]}:".encode()


def pack_values(blocks: Sequence[BlockWrite]) -> list[bytes]:
    """One value per block: its header, then its payload (one copy, no zeroing).

    CPU work (the header's checksum): call it in a worker thread.
    """
    return [b"".join((block.sealed_header(), block.payload)) for block in blocks]


def sort_replies(
    tier: str, keys: Sequence[bytes], replies: Sequence[Any]
) -> tuple[list[bytes | None], list[int]]:
    """The rule of both Redis tiers for ``GET`` replies: a value (bytes) or nil (``None``)
    is what it is; anything else (an error reply, such as ``WRONGTYPE`` for a key of
    another type) is a miss for that key alone, logged as ``redis_bad_reply``.

    Returns:
        One value or ``None`` per key, and the positions of the bad replies: the caller
        deletes those keys and counts them (``bad_replies``), so the next lookup finds
        nothing there instead of the same error again.
    """
    values: list[bytes | None] = []
    bad: list[int] = []
    for position, (key, reply) in enumerate(zip(keys, replies, strict=True)):
        if reply is None or isinstance(reply, bytes):
            values.append(reply)
            continue
        values.append(None)
        bad.append(position)
        _log.warning(
            "redis_bad_reply",
            tier=tier,
            key=key.decode(errors="replace"),
            error=f"{type(reply).__name__}: {reply}",
        )
    return values, bad


def unpack_values(
    values: Sequence[bytes | None], into: Sequence[memoryview]
) -> list[BlockRead | None]:
    """Copy each value's payload into its buffer; ``None`` stays a miss.

    A value shorter or longer than a block is delivered as it is (the caller's check
    rejects it). The checksum of a whole copied payload comes with the read, taken while
    the bytes are in this core's cache. CPU work: call it in a worker thread.
    """
    out: list[BlockRead | None] = []
    for value, buffer in zip(values, into, strict=True):
        if value is None:
            out.append(None)
            continue
        view = memoryview(value)
        payload = view[HEADER_SIZE:]
        n = min(len(payload), len(buffer))
        buffer[:n] = payload[:n]
        summed = checksum(buffer[:n]) if n == len(payload) else None
        out.append(BlockRead(bytes(view[:HEADER_SIZE]), len(payload), summed))
    return out
