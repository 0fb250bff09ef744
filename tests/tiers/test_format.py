"""The block header: every corruption is caught and named."""

from __future__ import annotations

import hashlib

import pytest

from kvoffload.errors import IntegrityError, TierError
from kvoffload.hashing import BlockHash
from kvoffload.tiers.format import HEADER_SIZE, encode_header, parse_header, verify_block

NS = hashlib.sha256(b"ns").digest()
H = BlockHash(hashlib.sha256(b"block").digest())
PAYLOAD = bytes(range(256)) * 16


def verify(header: bytes | None, payload: bytes, **kw: object) -> None:
    args: dict[str, object] = {
        "namespace": NS,
        "block_hash": H,
        "expected_length": len(PAYLOAD),
        "received_length": len(payload),
        "payload": memoryview(payload),
    }
    args.update(kw)
    verify_block(header, **args)  # type: ignore[arg-type]


def test_round_trip() -> None:
    header = encode_header(NS, H, PAYLOAD)
    assert len(header) == HEADER_SIZE == 96
    parsed = parse_header(header)
    assert (parsed.namespace, parsed.block_hash, parsed.payload_length) == (NS, H, len(PAYLOAD))
    verify(header, PAYLOAD)


@pytest.mark.parametrize(
    ("mutate", "reason"),
    [
        (lambda h, p: (h, p[:10] + bytes([p[10] ^ 1]) + p[11:]), "checksum"),
        (lambda h, p: (h, p[:-1] + bytes([p[-1] ^ 0x80])), "checksum"),
        (lambda h, p: (h[:50] + bytes([h[50] ^ 1]) + h[51:], p), "header"),
        (lambda h, p: (h[:40], p), "header"),
        (lambda h, p: (b"X" + h[1:], p), "header"),
        (lambda h, p: (None, p), "header"),
        (lambda h, p: (encode_header(hashlib.sha256(b"other").digest(), H, p), p), "namespace"),
        (
            lambda h, p: (encode_header(NS, BlockHash(hashlib.sha256(b"x").digest()), p), p),
            "hash",
        ),
        (lambda h, p: (encode_header(NS, H, p[:-4]), p[:-4]), "length"),
    ],
)
def test_each_corruption_is_named(mutate: object, reason: str) -> None:
    header, payload = mutate(encode_header(NS, H, PAYLOAD), PAYLOAD)  # type: ignore[operator]
    buf = bytearray(len(PAYLOAD))
    buf[: len(payload)] = payload
    with pytest.raises(IntegrityError) as info:
        verify(header, bytes(buf), received_length=len(payload))
    assert info.value.reason == reason
    assert isinstance(info.value, TierError)


def test_short_delivery_is_a_length_failure() -> None:
    header = encode_header(NS, H, PAYLOAD)
    with pytest.raises(IntegrityError, match="length"):
        verify(header, PAYLOAD, received_length=len(PAYLOAD) - 1)


def test_bad_sizes_rejected() -> None:
    with pytest.raises(ValueError, match="32 bytes"):
        encode_header(b"short", H, PAYLOAD)
