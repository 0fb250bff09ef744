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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NewType, final

from kvoffload.errors import InputTypeError, InvalidInputError

if TYPE_CHECKING:
    from kvoffload.layout import KVLayout

__all__ = [
    "BlockHash",
    "BlockHasher",
    "HashNamespace",
    "check_token_sequence",
    "hash_block_tokens",
    "hash_prompt",
]

BlockHash = NewType("BlockHash", bytes)
"""A block's 32-byte sha256 key."""

_VERSION = b"kvoffload-block-hash-v1"
_BIG_ENDIAN = sys.byteorder == "big"
_sha256 = hashlib.sha256


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


def check_token_sequence(token_ids: object, name: str, request_id: str | None = None) -> None:
    """Refuse what is not a sequence of token ids (``None``, an int, a string, a mapping,
    an iterator); the one check every entry point that takes a prompt calls.

    Raises:
        InputTypeError: naming ``name``, the value and the request (when given).
    """
    if (
        isinstance(token_ids, str | bytes | Mapping)
        or not hasattr(token_ids, "__len__")
        or not hasattr(token_ids, "__getitem__")
    ):
        who = "" if request_id is None else f"request {request_id!r}: "
        raise InputTypeError(
            f"{who}{name}={token_ids!r} must be a sequence of token ids (a list, a tuple, "
            f"an array, a tensor), got {type(token_ids).__name__}"
        )


def hash_prompt(
    token_ids: Sequence[int], block_size: int, namespace: HashNamespace
) -> list[BlockHash]:
    """Hash every full block of a prompt; a trailing partial block is not hashed.

    The same hashes as `BlockHasher` (and as `hash_block_tokens` chained block by block).

    Args:
        token_ids: the prompt's tokens.
        block_size: tokens per block.
        namespace: the cache namespace the chain starts from.

    Raises:
        InvalidInputError: ``block_size`` is below 1.
        InputTypeError: ``token_ids`` is not a sequence (``None``, a string, a mapping,
            an iterator), or a token of a full block is not a 64-bit int.
    """
    check_token_sequence(token_ids, "token_ids")
    hasher = BlockHasher(namespace.root, block_size)
    hasher.extend(token_ids[: len(token_ids) // block_size * block_size])
    return list(hasher.block_hashes)


@final
class BlockHasher:
    """The chained hashes of a token stream's full blocks, grown as tokens arrive.

    `extend()` appends tokens and hashes each block they fill, once, chained from the
    previous block's hash (``root`` for the first); the tokens of the partial last block
    are kept until it fills. Every block's hash equals `hash_block_tokens` of its tokens,
    its parent and ``extra``, so a stream fed in any chunks gives `hash_prompt`'s hashes.

    Args:
        root: the first block's parent, usually ``namespace.root``.
        block_size: tokens per block.
        extra: bytes mixed into every block's hash (a LoRA id, a salt: see
            `hash_block_tokens`).

    Raises:
        InvalidInputError: ``block_size`` is below 1.

    The hasher is not thread-safe.
    """

    __slots__ = ("_block_size", "_extra", "_hashes", "_header", "_parent", "_root", "_tail")

    def __init__(self, root: BlockHash, block_size: int, extra: bytes = b"") -> None:
        if block_size < 1:
            raise InvalidInputError(f"block_size must be >= 1, got {block_size}")
        self._root = root
        self._block_size = block_size
        self._extra = bytes(extra)
        self._header = struct.pack("<QQ", block_size, len(extra))  # every block's length fields
        self._parent = root
        self._hashes: list[BlockHash] = []
        self._tail: list[int] = []  # the tokens of the partial last block

    def __repr__(self) -> str:
        return (
            f"BlockHasher(block_size={self._block_size}, blocks={len(self._hashes)}, "
            f"tail={len(self._tail)})"
        )

    def extend(self, token_ids: Sequence[int]) -> None:
        """Append tokens and hash each block they fill.

        Raises:
            InputTypeError: a token is not a 64-bit int (the message gives its index in
                ``token_ids``); nothing is appended then. Also a ``TypeError`` and a
                ``ValueError``.
        """
        tail = self._tail
        n = len(token_ids)
        if len(tail) + n < self._block_size:  # no block fills (the common decode step)
            if n == 1:
                token = token_ids[0]
                if type(token) is not int or token >> 63 not in (0, -1):
                    _encode_tokens(token_ids)  # raises, or accepts an int-like token
            elif n:
                _encode_tokens(token_ids)
            tail.extend(token_ids)
            return
        self._fill(token_ids)

    def _fill(self, token_ids: Sequence[int]) -> None:
        bs = self._block_size
        tail = self._tail
        have = len(tail)
        take = (have + len(token_ids)) // bs * bs - have  # tokens of token_ids in full blocks
        rest = token_ids[take:]
        try:
            # Tokens are checked (and encoded) before anything changes.
            data = _encode_tokens([*tail, *token_ids[:take]] if have else token_ids[:take])
            if len(rest):  # not `if rest`: an array or tensor has no truth value
                _encode_tokens(rest)
        except InputTypeError:
            _encode_tokens(token_ids)  # the same error, indexed within token_ids
            raise
        parent, header, extra = self._parent, self._header, self._extra
        append = self._hashes.append
        step = 8 * bs
        view = memoryview(data)
        for start in range(0, len(data), step):
            h = _sha256(parent)
            h.update(header)
            h.update(view[start : start + step])
            if extra:
                h.update(extra)
            parent = BlockHash(h.digest())
            append(parent)
        self._parent = parent
        tail[:] = rest

    def update(self, token_ids: Sequence[int]) -> None:
        """Catch up with a stream that grew: ``token_ids`` starts with every token given so
        far; hash the blocks its new tokens fill (as `extend()` with those tokens).

        Raises:
            InputTypeError: a new token is not a 64-bit int; nothing is appended then.
        """
        self.extend(token_ids[self.num_tokens :])

    @property
    def block_hashes(self) -> Sequence[BlockHash]:
        """The hashes of the full blocks so far: one list that only grows (no copy is
        made; do not modify it)."""
        return self._hashes

    @property
    def num_tokens(self) -> int:
        """Tokens appended so far, in full blocks and in the tail."""
        return len(self._hashes) * self._block_size + len(self._tail)

    @property
    def root(self) -> BlockHash:
        """The first block's parent."""
        return self._root

    @property
    def block_size(self) -> int:
        """Tokens per block."""
        return self._block_size

    @property
    def extra(self) -> bytes:
        """The bytes mixed into every block's hash."""
        return self._extra
