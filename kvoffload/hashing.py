"""Process-independent, chained block hashing.

A block's hash covers its tokens and, through its parent, every token before it, so two
prompts share a block hash exactly when they share the whole prefix up to that block.
Hashes are sha256 over a fixed byte encoding: identical in every process, on every host,
whatever ``PYTHONHASHSEED`` is. The chain starts at a `HashNamespace` root that mixes
in the model, dtype, layout and a salt, so two configurations never share a key.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NewType

from kvoffload.errors import InputTypeError, InvalidInputError

if TYPE_CHECKING:
    from kvoffload.layout import KVLayout

__all__ = ["BlockHash", "HashNamespace", "hash_block_tokens", "hash_prompt"]

BlockHash = NewType("BlockHash", bytes)
"""A block's 32-byte sha256 key."""

_VERSION = b"kvoffload-block-hash-v1"
_BIG_ENDIAN = sys.byteorder == "big"


def _field(value: str | int) -> bytes:
    data = value.encode() if isinstance(value, str) else str(value).encode()
    return struct.pack("<Q", len(data)) + data


@dataclass(frozen=True, slots=True)
class HashNamespace:
    """What a cache key depends on besides tokens.

    Attributes:
        model_id: model name and revision.
        dtype: effective KV dtype (``"bfloat16"``, ...).
        layout: a description of the KV geometry (see `from_layout()`).
        salt: anything else that must isolate caches (a tenant, a LoRA id, ...).
    """

    model_id: str = ""
    dtype: str = ""
    layout: str = ""
    salt: str = ""

    @classmethod
    def from_layout(cls, layout: KVLayout, *, model_id: str = "", salt: str = "") -> HashNamespace:
        """A namespace for ``layout``: its dtype, geometry and block size are all mixed in."""
        geometry = (
            f"{layout.kind}:L{layout.num_layers}:H{layout.num_kv_heads}:"
            f"D{layout.head_size}:B{layout.block_size}"
        )
        return cls(model_id=model_id, dtype=layout.dtype, layout=geometry, salt=salt)

    @property
    def root(self) -> BlockHash:
        """The parent hash of a prompt's first block."""
        h = hashlib.sha256(_VERSION)
        for value in (self.model_id, self.dtype, self.layout, self.salt):
            h.update(_field(value))
        return BlockHash(h.digest())


def _encode_tokens(token_ids: Sequence[int]) -> bytes:
    try:
        arr = array("q", token_ids)
    except (OverflowError, TypeError) as exc:
        bad = next(
            (
                i
                for i, t in enumerate(token_ids)
                if not isinstance(t, int) or not -(1 << 63) <= t < 1 << 63
            ),
            None,
        )
        raise InputTypeError(
            f"token_ids[{bad}]={token_ids[bad] if bad is not None else '?'!r} is not a 64-bit int"
        ) from exc
    if _BIG_ENDIAN:  # pragma: no cover - hashes are little-endian everywhere
        arr.byteswap()
    return arr.tobytes()


def hash_block_tokens(parent: BlockHash, token_ids: Sequence[int], extra: bytes = b"") -> BlockHash:
    """Hash one block of tokens chained to its parent.

    Args:
        parent: the previous block's hash, or ``namespace.root`` for the first block.
        token_ids: the block's tokens.
        extra: anything else the block's KV depends on (multimodal hashes, LoRA id).

    Returns:
        The block's 32-byte key.
    """
    h = hashlib.sha256(parent)
    h.update(struct.pack("<QQ", len(token_ids), len(extra)))
    h.update(_encode_tokens(token_ids))
    h.update(extra)
    return BlockHash(h.digest())


def hash_prompt(
    token_ids: Sequence[int], block_size: int, namespace: HashNamespace
) -> list[BlockHash]:
    """Hash every full block of a prompt; a trailing partial block is not hashed.

    Args:
        token_ids: the prompt's tokens.
        block_size: tokens per block.
        namespace: the cache namespace the chain starts from.

    Raises:
        InvalidInputError: ``block_size`` is below 1.
        InputTypeError: a token is not a 64-bit int.
    """
    if block_size < 1:
        raise InvalidInputError(f"block_size must be >= 1, got {block_size}")
    parent = namespace.root
    hashes: list[BlockHash] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes
