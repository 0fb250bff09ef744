"""The on-tier block format: a fixed header followed by the payload, and its verification.

Every block a tier holds starts with the same 96-byte header, whatever the tier::

    offset  size  field
    0       4     magic b"KVOB"
    4       2     format version (1)
    6       2     checksum kind (1: xxh3-64 of the payload)
    8       32    namespace digest (the `HashNamespace` root)
    40      32    block hash
    72      8     payload length in bytes
    80      8     payload checksum
    88      4     reserved (0)
    92      4     crc32 of bytes 0..91 (a torn or foreign header fails it)

All integers are little-endian. The header is built by the tier manager, stored by the
tier next to the payload, handed back by the tier on a read and verified here; no tier
decides on its own whether a block is good. `verify_block()` is the only door from a
tier to the CPU pool.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from typing import final

import xxhash

from kvoffload.errors import IntegrityError
from kvoffload.hashing import BlockHash

__all__ = [
    "HEADER_SIZE",
    "BlockHeader",
    "checksum",
    "encode_header",
    "parse_header",
    "verify_block",
]

_MAGIC = b"KVOB"
_VERSION = 1
_CHECKSUM_XXH3 = 1
_BODY = struct.Struct("<4sHH32s32sQQI")
_CRC = struct.Struct("<I")
HEADER_SIZE = _BODY.size + _CRC.size
"""Bytes of a block header (96)."""


def checksum(payload: memoryview | bytes) -> int:
    """The 64-bit payload checksum stored in a header (xxh3-64)."""
    return xxhash.xxh3_64_intdigest(payload)


@final
@dataclass(frozen=True, slots=True)
class BlockHeader:
    """A parsed block header.

    Attributes:
        namespace: the 32-byte namespace digest the block was written under.
        block_hash: the block's hash.
        payload_length: payload bytes.
        checksum: xxh3-64 of the payload.
    """

    namespace: bytes
    block_hash: BlockHash
    payload_length: int
    checksum: int


def encode_header(namespace: bytes, block_hash: BlockHash, payload: memoryview | bytes) -> bytes:
    """Build the header for ``payload`` stored under ``block_hash`` in ``namespace``.

    Args:
        namespace: the 32-byte namespace digest.
        block_hash: the 32-byte block hash.
        payload: the block's bytes (checksummed here).

    Raises:
        ValueError: the namespace or hash is not 32 bytes.
    """
    if len(namespace) != 32 or len(block_hash) != 32:
        raise ValueError(
            f"namespace and block hash must be 32 bytes (got {len(namespace)} and "
            f"{len(block_hash)})"
        )
    body = _BODY.pack(
        _MAGIC,
        _VERSION,
        _CHECKSUM_XXH3,
        namespace,
        block_hash,
        len(payload),
        checksum(payload),
        0,
    )
    return body + _CRC.pack(zlib.crc32(body))


def parse_header(raw: bytes | memoryview) -> BlockHeader:
    """Parse and self-check a header (magic, version, checksum kind, header crc).

    Raises:
        IntegrityError: ``reason="header"``: too short, wrong magic or version, or a crc
            mismatch (a torn or foreign header).
    """
    if len(raw) < HEADER_SIZE:
        raise IntegrityError("header", f"{len(raw)} bytes, a header has {HEADER_SIZE}")
    body = bytes(raw[: _BODY.size])
    (crc,) = _CRC.unpack_from(raw, _BODY.size)
    if zlib.crc32(body) != crc:
        raise IntegrityError("header", "header crc mismatch (torn or foreign data)")
    magic, version, kind, namespace, block_hash, length, csum, _ = _BODY.unpack(body)
    if magic != _MAGIC or version != _VERSION or kind != _CHECKSUM_XXH3:
        raise IntegrityError(
            "header", f"magic {magic!r} version {version} checksum kind {kind} not understood"
        )
    return BlockHeader(namespace, BlockHash(block_hash), length, csum)


def verify_block(
    raw_header: bytes | memoryview | None,
    *,
    namespace: bytes,
    block_hash: BlockHash,
    expected_length: int,
    received_length: int,
    payload: memoryview,
    payload_checksum: int | None = None,
) -> None:
    """Check a block read from a tier before it may be published.

    Args:
        raw_header: the header the tier returned with the block.
        namespace: the reader's namespace digest.
        block_hash: the hash the reader asked for.
        expected_length: the reader's block size in bytes.
        received_length: payload bytes the tier actually delivered.
        payload: the delivered payload (``expected_length`` bytes of the CPU block).
        payload_checksum: `checksum()` of ``payload`` when already computed (by the
            thread that read it, the buffer untouched since); computed here otherwise.

    Raises:
        IntegrityError: its ``reason`` names the first check that failed: ``"header"``,
            ``"namespace"``, ``"hash"``, ``"length"`` or ``"checksum"``.
    """
    if raw_header is None:
        raise IntegrityError("header", "the tier returned no header")
    header = parse_header(raw_header)
    if header.namespace != namespace:
        raise IntegrityError(
            "namespace",
            f"written under namespace {header.namespace.hex()[:16]}…, "
            f"read under {namespace.hex()[:16]}…",
        )
    if header.block_hash != block_hash:
        raise IntegrityError(
            "hash",
            f"holds block {header.block_hash.hex()[:16]}…, asked for {block_hash.hex()[:16]}…",
        )
    if header.payload_length != expected_length or received_length != expected_length:
        raise IntegrityError(
            "length",
            f"header says {header.payload_length} bytes, {received_length} arrived, "
            f"a block has {expected_length}",
        )
    actual = checksum(payload[:expected_length]) if payload_checksum is None else payload_checksum
    if actual != header.checksum:
        raise IntegrityError(
            "checksum", f"payload checksum {actual:#018x} != header's {header.checksum:#018x}"
        )
