"""The `SecondaryTier` protocol every tier below the CPU pool implements.

A tier stores opaque blocks: a header built by the tier manager (see `format`) and a
payload of exactly one CPU block. It never decides whether a block is good; the manager
verifies every block it reads before publishing it. All methods are async and must not
block the event loop (file I/O runs in worker threads). They raise `TierError` (or an
``OSError`` / client error, which the manager treats the same) when the tier is
unreachable; a missing block is a miss, never an error.

A tier may also offer ``reads_ok() -> bool`` (not part of the protocol): asked after a
failed ``put`` or retry, ``True`` says only writes fail (a full disk), and the manager keeps
reading from the tier instead of marking it unhealthy.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from kvoffload.hashing import BlockHash

__all__ = ["BlockRead", "BlockWrite", "SecondaryTier"]


@dataclass(slots=True)
class BlockWrite:
    """One block to put into a tier (built once per block on the event loop, so a plain
    slotted record: three times cheaper to make than a frozen one; treat it as read-only).

    Attributes:
        block_hash: its key.
        header: the encoded header (stored before the payload), or ``b""`` when ``seal``
            builds it.
        payload: the CPU block's bytes; the caller keeps them unchanged (a reference on
            the CPU block) until ``put`` returns.
        seal: builds the header from the payload (a checksum over every byte); a tier
            calls it through `sealed_header()` in the worker thread that writes the
            block, so the checksum costs no extra hand-off between threads.
    """

    block_hash: BlockHash
    header: bytes
    payload: memoryview
    seal: Callable[[], bytes] | None = None

    def sealed_header(self) -> bytes:
        """The header: ``header`` when given, else what ``seal()`` builds (CPU work: call
        it off the event loop)."""
        if self.header or self.seal is None:
            return self.header
        return self.seal()


@dataclass(slots=True)
class BlockRead:
    """What a tier delivered for one block (read-only by convention, like `BlockWrite`).

    Attributes:
        header: the stored header bytes (unverified).
        payload_length: payload bytes written into the caller's buffer.
        payload_checksum: `format.checksum()` of those bytes, computed by the tier in the
            worker thread that read them, right after the read, or ``None``. It is not a
            verdict: the reader still compares it with the header in `verify_block()`.
    """

    header: bytes
    payload_length: int
    payload_checksum: int | None = None


@runtime_checkable
class SecondaryTier(Protocol):
    """A store of blocks below the CPU pool (a local file, a Redis server ...)."""

    @property
    def name(self) -> str:
        """The tier's name in statistics and logs."""
        ...

    async def open(self) -> None:
        """Connect or create the backing store; called once before anything else.

        Raises:
            TierError: the store cannot be reached or created.
        """
        ...

    async def ping(self) -> None:
        """Check that the tier works (and recover it where it can, e.g. a deleted file).

        Raises:
            TierError: it does not.
        """
        ...

    async def exists(self, block_hashes: Sequence[BlockHash]) -> int:
        """How many of ``block_hashes``, from the first, the tier holds (a leading run)."""
        ...

    async def put(self, blocks: Sequence[BlockWrite]) -> int:
        """Store blocks; a reader never sees half of one.

        Returns:
            How many were stored (a tier may drop blocks it has no room for).
        """
        ...

    async def get(
        self, block_hashes: Sequence[BlockHash], into: Sequence[memoryview]
    ) -> list[BlockRead | None]:
        """Read blocks into the caller's buffers (one CPU block each).

        Returns:
            Per block, what arrived, or ``None`` for a miss. A cancelled call may have
            written any part of the buffers: the caller must not publish them.
        """
        ...

    async def delete(self, block_hashes: Sequence[BlockHash]) -> None:
        """Remove blocks (those absent are ignored)."""
        ...

    async def close(self) -> None:
        """Release connections and files (a non-persistent file is removed). Idempotent."""
        ...

    def statistics(self) -> Mapping[str, int | float | str | bool]:
        """Tier-specific figures (capacity, slots used, I/O mode ...)."""
        ...
