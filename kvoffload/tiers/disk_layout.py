"""The disk tier's file geometry and the in-memory image of its header pages.

A file is a 4 KiB superblock (format, payload span, slot count, block size, namespace),
then *extents*: one 4 KiB header page holding the 128-byte entries of 32 slots, then those
32 slots' payloads, each rounded up to 4 KiB (its *span*). `DiskLayout` computes where
everything is; it does no I/O. `HeaderImage` holds every header page as the tier last wrote
it (or, at start-up, as read from the file), so that a read is checked against the header
the tier wrote without reading it back.
"""

from __future__ import annotations

import os
import struct
import zlib
from collections.abc import Iterable, Sequence
from typing import final

from kvoffload.errors import ConfigError, IntegrityError
from kvoffload.hashing import BlockHash
from kvoffload.tiers.format import HEADER_SIZE, parse_header

__all__ = ["ENTRY", "GROUP", "PAGE", "SUPER_MAGIC", "DiskLayout", "HeaderImage", "file_bytes"]

PAGE = 4096
"""The unit of alignment: superblock, header pages and payload spans are whole pages."""
ENTRY = 128
"""Bytes of a header page per slot (a header takes `HEADER_SIZE` of them)."""
GROUP = PAGE // ENTRY
"""Slots per extent (per header page)."""
SUPER_MAGIC = b"KVODISK1"
_SUPER_VERSION = 2  # 1: one header page per slot; 2: one header page per 32 slots
_SUPER = struct.Struct("<8sIQQQ32s")

if HEADER_SIZE > ENTRY:  # pragma: no cover - a property of the format
    raise ImportError(f"a block header ({HEADER_SIZE} bytes) must fit an entry ({ENTRY})")


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def _file_bytes(num_slots: int, span: int) -> int:
    """Size of a file of ``num_slots`` slots whose payloads take ``span`` bytes each."""
    full, extra = divmod(num_slots, GROUP)
    return PAGE + full * (PAGE + GROUP * span) + (PAGE + extra * span if extra else 0)


def _slots_in(capacity_bytes: int, span: int) -> int:
    """How many slots of ``span`` payload bytes a file of ``capacity_bytes`` holds."""
    avail = capacity_bytes - PAGE
    extent = PAGE + GROUP * span
    if avail < PAGE + span:
        return 0
    full, rest = divmod(avail, extent)
    extra = min(GROUP - 1, (rest - PAGE) // span) if rest >= PAGE + span else 0
    return full * GROUP + extra


def file_bytes(num_slots: int, block_nbytes: int) -> int:
    """The ``capacity_bytes`` that holds exactly ``num_slots`` blocks of ``block_nbytes``.

    Raises:
        ValueError: ``num_slots`` or ``block_nbytes`` is below 1.
    """
    if num_slots < 1 or block_nbytes < 1:
        raise ValueError(f"num_slots={num_slots} and block_nbytes={block_nbytes} must be >= 1")
    return _file_bytes(num_slots, _round_up(block_nbytes, PAGE))


@final
class DiskLayout:
    """Where the superblock, header pages and payloads of one tier's file are.

    Args:
        capacity_bytes: the largest file; as many whole slots as fit.
        block_nbytes: one block's payload.
        namespace: the 32-byte namespace digest written in the superblock.
        name: the tier's name, for errors.

    Raises:
        ConfigError: ``block_nbytes`` is below 1, or the capacity holds no slot.
    """

    __slots__ = (
        "block_nbytes",
        "extent_size",
        "file_size",
        "gap",
        "namespace",
        "num_slots",
        "payload_span",
        "run_max",
        "slot_size",
    )

    def __init__(self, capacity_bytes: int, *, block_nbytes: int, namespace: bytes, name: str):
        if block_nbytes < 1:
            raise ConfigError(f"disk tier {name!r}: block_nbytes={block_nbytes} must be >= 1")
        self.block_nbytes = block_nbytes
        self.namespace = namespace
        self.payload_span = span = _round_up(block_nbytes, PAGE)
        self.extent_size = PAGE + GROUP * span
        # What one more slot can take from the file system: its payload and, at worst,
        # the header page of a new extent.
        self.slot_size = PAGE + span
        self.num_slots = _slots_in(int(capacity_bytes), span)
        if self.num_slots < 1:
            raise ConfigError(
                f"disk tier {name!r}: capacity_bytes={int(capacity_bytes)} holds no slot: "
                f"the smallest file is {_file_bytes(1, span)} bytes (a "
                f"{PAGE}-byte superblock, a header page and the block rounded up to {PAGE})"
            )
        self.file_size = _file_bytes(self.num_slots, span)
        # Payloads not a whole number of pages leave a gap before the next slot; a run of
        # slots skips it with a zero pad (writes) or a scratch buffer (reads).
        self.gap = span - block_nbytes
        iov_max = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024
        self.run_max = max(1, min(iov_max, 1024) // 3)

    @property
    def num_extents(self) -> int:
        """Header pages in the file."""
        return -(-self.num_slots // GROUP)

    def superblock(self) -> bytes:
        """The file's first page, as this tier writes it (and expects to find it)."""
        body = _SUPER.pack(
            SUPER_MAGIC,
            _SUPER_VERSION,
            self.payload_span,
            self.num_slots,
            self.block_nbytes,
            self.namespace,
        )
        body += struct.pack("<I", zlib.crc32(body))
        return body.ljust(PAGE, b"\0")

    def header_page_offset(self, extent: int) -> int:
        """Where ``extent``'s header page starts in the file."""
        return PAGE + extent * self.extent_size

    def header_offset(self, slot: int) -> int:
        """Where ``slot``'s header starts in the file."""
        return self.header_page_offset(slot // GROUP) + (slot % GROUP) * ENTRY

    def offset(self, slot: int) -> int:
        """Where ``slot``'s payload starts in the file."""
        extent, k = divmod(slot, GROUP)
        return PAGE + extent * self.extent_size + PAGE + k * self.payload_span

    def runs(self, slots: Sequence[int]) -> list[tuple[int, int]]:
        """Split sorted ``slots`` into runs ``[lo, hi)`` of positions whose slots are
        consecutive within one extent, at most `run_max` long (one vectored I/O each)."""
        runs: list[tuple[int, int]] = []
        run_max = self.run_max
        n = len(slots)
        lo = 0
        for k in range(1, n + 1):
            if (
                k == n
                or slots[k] != slots[k - 1] + 1
                or slots[k] % GROUP == 0  # the next extent's header page sits between
                or k - lo >= run_max
            ):
                runs.append((lo, k))
                lo = k
        return runs


@final
class HeaderImage:
    """Every header page of one file, as on disk once the writes under way are done.

    Entry ``slot`` is bytes ``[slot * ENTRY, (slot + 1) * ENTRY)`` of `data`; page
    ``extent`` is bytes ``[extent * PAGE, (extent + 1) * PAGE)``. A writer stages a run's
    headers and copies the page out under the extent's lock (see `disk_io`); a reader takes
    a slot's header from here.
    """

    __slots__ = ("data",)

    def __init__(self, layout: DiskLayout) -> None:
        self.data = bytearray(layout.num_extents * PAGE)

    def clear(self) -> None:
        """Forget every header (a file initialised afresh)."""
        self.data[:] = bytes(len(self.data))

    def stage(self, first: int, headers: Sequence[bytes]) -> None:
        """Put ``headers`` (of slots ``first``, ``first + 1`` ...) in the image."""
        data = self.data
        at = first * ENTRY
        for header in headers:
            if len(header) == HEADER_SIZE:
                data[at : at + HEADER_SIZE] = header
            else:
                data[at : at + ENTRY] = header.ljust(ENTRY, b"\0")
            at += ENTRY

    def copy_page(self, extent: int, page: memoryview) -> None:
        """Copy ``extent``'s header page into ``page`` (its writer holds the extent's lock)."""
        page[:] = self.data[extent * PAGE : (extent + 1) * PAGE]

    def header(self, slot: int) -> bytes:
        """``slot``'s header as the tier wrote it."""
        at = slot * ENTRY
        return bytes(self.data[at : at + HEADER_SIZE])

    def rebuild(
        self, layout: DiskLayout, pages: Iterable[bytes]
    ) -> tuple[list[tuple[BlockHash, int]], list[int], int]:
        """Load the header pages read from a persisted file, extent by extent, and keep the
        slots whose header is whole, of this namespace and block size, and not a repeat.

        Returns:
            ``(entries, free, discarded)``: ``(hash, slot)`` of the blocks kept in slot
            order, the other slots in descending order (a stack that hands out the lowest
            first), and how many non-empty slots were dropped (their entries are zeroed).
        """
        data = self.data
        namespace, nbytes, num_slots = layout.namespace, layout.block_nbytes, layout.num_slots
        entries: list[tuple[BlockHash, int]] = []
        seen: set[BlockHash] = set()
        free: list[int] = []
        discarded = 0
        for extent, page in enumerate(pages):
            data[extent * PAGE : extent * PAGE + len(page)] = page
            for slot in range(extent * GROUP, min(num_slots, (extent + 1) * GROUP)):
                at = slot * ENTRY
                try:
                    header = parse_header(bytes(data[at : at + HEADER_SIZE]))
                except IntegrityError:
                    if data[at : at + ENTRY].strip(b"\0"):
                        discarded += 1
                    data[at : at + ENTRY] = bytes(ENTRY)
                    free.append(slot)
                    continue
                if (
                    header.namespace != namespace
                    or header.payload_length != nbytes
                    or header.block_hash in seen
                ):
                    discarded += 1
                    data[at : at + ENTRY] = bytes(ENTRY)
                    free.append(slot)
                    continue
                seen.add(header.block_hash)
                entries.append((header.block_hash, slot))
        free.reverse()
        return entries, free, discarded
