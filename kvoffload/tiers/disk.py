"""`DiskTier`: blocks in one preallocated file on a local disk, addressed by slot.

The file starts with a 4 KiB superblock (format, payload span, slot count, block size,
namespace), followed by *extents*: one 4 KiB header page holding the 128-byte headers of
32 slots, then those 32 slots' payloads, each rounded up to 4 KiB. A run of consecutive
slots is written with one ``pwritev`` of the payloads (and of the extent's header page
when the run starts the extent; otherwise the header page follows in a second write, after
the payloads) and read with one ``preadv``, straight from and into the CPU pool's memory,
in worker threads. Header bytes cost 1/32 of a page per block, not a page. ``O_DIRECT``
is used when the file system accepts it and the buffer is aligned; otherwise the I/O goes
through the page cache (reported in `statistics()`).

The index (hash → slot, in LRU order) and an image of every header page (128 bytes per
slot) live in memory; a read is checked against the header the tier wrote. With
``persist=True`` the file is kept on close and both are rebuilt at start-up from the header
pages: a slot whose header is torn, foreign (another namespace or block size) or
duplicated is discarded. A slot whose payload was torn by a crash (or whose header page
was written and payload was not) keeps a valid-looking header, but its checksum fails at
the first read, which drops it.

`DiskTier` is the face; the parts behind it are the geometry and the header image
(`disk_layout`), the file and its ownership (`disk_file`), the vectored I/O of runs of
slots (`disk_io`) and the slot index (`disk_index`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import final

import anyio
import anyio.lowlevel
import anyio.to_thread

from kvoffload._logging import get_logger
from kvoffload.errors import TierError
from kvoffload.hashing import BlockHash
from kvoffload.tiers._threads import IoThreads
from kvoffload.tiers.base import BlockRead, BlockWrite
from kvoffload.tiers.disk_file import DiskFile
from kvoffload.tiers.disk_index import SlotIndex
from kvoffload.tiers.disk_io import DiskIo
from kvoffload.tiers.disk_layout import ENTRY, DiskLayout, HeaderImage, file_bytes

__all__ = ["DiskTier"]

_log = get_logger("tiers.disk")


@final
class DiskTier:
    """A `SecondaryTier` backed by one preallocated local file.

    Args:
        path: the file; created (its directory must exist).
        capacity_bytes: file size; ``capacity_bytes // slot_size`` blocks fit.
        block_nbytes: size of one block's payload (the CPU pool's block size).
        namespace: the 32-byte namespace digest; slots of another namespace are foreign.
        persist: keep the file on close and rebuild the index from it at `open()`.
        direct_io: ``"auto"``: ``O_DIRECT`` where possible; ``"never"``: page cache only.
        preallocate: reserve the whole file at `open()` (``posix_fallocate``); ``False``
            leaves it sparse, so a full file system fails writes mid-run (``ENOSPC``):
            such a write indexes nothing, and `ping()` fails until a slot's worth of
            space is free again.
        name: the name in statistics and logs.
        io_threads: worker threads for this tier's I/O.

    Raises:
        ConfigError: the capacity holds no slot.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        capacity_bytes: int,
        *,
        block_nbytes: int,
        namespace: bytes,
        persist: bool = False,
        direct_io: str = "auto",
        preallocate: bool = True,
        name: str = "disk",
        io_threads: int = 4,
    ) -> None:
        self._layout = layout = DiskLayout(
            capacity_bytes, block_nbytes=block_nbytes, namespace=namespace, name=name
        )
        self._path = Path(path)
        self._name = name
        self._persist = persist
        self._preallocate = preallocate
        self._file = DiskFile(
            self._path,
            layout,
            name=name,
            persist=persist,
            direct_io=direct_io == "auto",
            preallocate=preallocate,
        )
        self._image = HeaderImage(layout)
        self._io = DiskIo(self._file, self._image, name=name, persist=persist)
        self._slots = SlotIndex(layout.num_slots)
        self._threads = IoThreads(io_threads, f"kvoffload-disk-{name}")
        self._limiter = self._threads.limiter
        # Named as tests and tools reach for them: the index, the readers, the offsets.
        self._index = self._slots.index
        self._readers = self._slots.readers
        self._offset = layout.offset
        self._header_offset = layout.header_offset
        self._discarded_at_open = 0
        self._recreated = 0
        self._adopted = 0
        self._closed = False

    def __repr__(self) -> str:
        return (
            f"DiskTier(name={self._name!r}, path={str(self._path)!r}, "
            f"slots={len(self._slots)}/{self._layout.num_slots})"
        )

    @staticmethod
    def file_bytes(num_slots: int, block_nbytes: int) -> int:
        """The ``capacity_bytes`` that holds exactly ``num_slots`` blocks of ``block_nbytes``.

        A block takes its size rounded up to 4 KiB, plus 128 bytes of a header page shared
        by 32 slots; the file starts with a 4 KiB superblock.

        Raises:
            ValueError: ``num_slots`` or ``block_nbytes`` is below 1.
        """
        return file_bytes(num_slots, block_nbytes)

    @property
    def name(self) -> str:
        """The tier's name."""
        return self._name

    @property
    def path(self) -> Path:
        """The file."""
        return self._path

    @property
    def num_slots(self) -> int:
        """Blocks the file holds."""
        return self._layout.num_slots

    @property
    def direct_io(self) -> bool:
        """Whether ``O_DIRECT`` is in use for aligned buffers."""
        return self._file.dfd >= 0

    @property
    def _identity(self) -> tuple[int, int] | None:
        """The open file's ``(device, inode)``."""
        return self._file.identity

    # -- lifecycle ---------------------------------------------------------------------------

    async def open(self) -> None:
        """Create or reopen the file (in a worker thread); rebuild the index if persistent.

        Raises:
            TierError: the file cannot be created or preallocated (the errno is named).
        """
        await anyio.to_thread.run_sync(self._open_sync, limiter=self._limiter)

    def _open_sync(self, recover: bool = False) -> None:
        """Open, lock and reuse, adopt or initialise the file (`DiskFile.open`), then
        rebuild the index from its header pages or start it empty."""
        file = self._file
        reuse = file.open(recover)
        self._image.clear()
        if reuse:
            entries, free, discarded = self._image.rebuild(self._layout, file.header_pages())
            self._discarded_at_open += discarded
            self._slots.reset(entries, free)
        else:
            self._slots.reset()
        _log.info(
            "disk_tier_opened",
            tier=self._name,
            path=str(self._path),
            slots=self._layout.num_slots,
            reused=len(self._slots),
            discarded=self._discarded_at_open,
            direct_io=file.dfd >= 0,
        )

    async def close(self) -> None:
        """Close the file; remove it unless ``persist``. Idempotent."""
        if self._closed:
            return
        self._closed = True
        file = self._file
        identity = file.identity
        self._threads.shutdown()
        file.close()
        if not self._persist and file.owned:
            file.remove(identity)
        self._slots.index.clear()

    async def ping(self) -> None:
        """Check the file is still ours and, after a write ran out of space, that a slot's
        worth of space is free again.

        A removed file is created again, empty. A file that replaced it is adopted when it
        is a persisted file of this geometry and namespace (its blocks are served) and
        refused otherwise, untouched: the tier never truncates a file it did not create.

        Raises:
            TierError: the file is gone and cannot be created again, it was replaced by
                a file the tier cannot adopt (the path and why are named), or the file
                system is still full (``ENOSPC`` in the message).
        """
        if self._closed:
            raise TierError(f"disk tier {self._name!r} is closed")
        try:
            await anyio.to_thread.run_sync(self._file.check, limiter=self._limiter)
        except TierError:
            if self._slots.busy():
                raise
            await anyio.to_thread.run_sync(self._recover_sync, limiter=self._limiter)
        await anyio.to_thread.run_sync(self._file.check_space, limiter=self._limiter)

    def _recover_sync(self) -> None:
        self._open_sync(recover=True)
        if self._file.owned:
            self._recreated += 1
            _log.warning("disk_tier_recreated", tier=self._name, path=str(self._path))
        else:
            self._adopted += 1
            _log.warning(
                "disk_tier_adopted", tier=self._name, path=str(self._path), blocks=len(self._slots)
            )

    def reads_ok(self) -> bool:
        """Whether the tier still serves reads although writes fail: the file system is
        full (``ENOSPC``), and the blocks written before stay readable."""
        return self._file.reads_ok()

    # -- the protocol ------------------------------------------------------------------------

    async def exists(self, block_hashes: Sequence[BlockHash]) -> int:
        """Length of the leading run of ``block_hashes`` the file holds."""
        await anyio.lowlevel.checkpoint()
        return self._slots.leading(block_hashes)

    async def put(self, blocks: Sequence[BlockWrite]) -> int:
        """Write blocks into free or least recently used slots.

        One ``pwritev`` writes each run of consecutive slots (header pages and payloads
        as separate buffers, no copy).

        Blocks already present are only touched in the LRU order. When every slot is being
        read, a block is dropped (not counted as stored).

        Returns:
            Blocks now held, of those given.

        Raises:
            ValueError: a payload is not one block long (nothing of this call is written).
            TierError: the file was removed or replaced, or a write failed (the errno
                is named and logged; no block of this call is indexed, their slots are
                freed).
        """
        if self._file.fd < 0:
            raise TierError(f"disk tier {self._name!r} is not open")
        held, jobs = self._slots.claim(blocks, self._layout.block_nbytes, self._name)
        if not jobs:
            return held
        written = 0
        try:
            # Handed over in a box the call empties: an idle worker thread keeps its last
            # call's arguments, and must not keep the caller's buffers exported.
            written = await self._threads.run(self._io.write, [list(jobs)])
        finally:
            self._slots.settle(jobs, 0 if self._closed else written)
        return held + written

    async def get(
        self, block_hashes: Sequence[BlockHash], into: Sequence[memoryview]
    ) -> list[BlockRead | None]:
        """Read blocks into ``into``; ``None`` for a miss.

        One ``preadv`` reads each run of consecutive slots straight into the buffers.

        Raises:
            TierError: a read failed.
        """
        if len(block_hashes) != len(into):
            raise ValueError(f"{len(block_hashes)} hashes but {len(into)} buffers")
        if self._file.fd < 0:
            raise TierError(f"disk tier {self._name!r} is not open")
        jobs = self._slots.pin(block_hashes, into, self._layout.block_nbytes)
        out: list[BlockRead | None] = [None] * len(block_hashes)
        if not jobs:
            return out
        try:
            reads = await self._threads.run(self._io.read, [(jobs, into)])
        finally:
            self._slots.unpin(jobs)
        for (i, _), read in zip(jobs, reads, strict=True):
            out[i] = read
        return out

    async def delete(self, block_hashes: Sequence[BlockHash]) -> None:
        """Forget blocks; their slots are reused once no read holds them."""
        await anyio.lowlevel.checkpoint()
        self._slots.drop(block_hashes)

    def statistics(self) -> Mapping[str, int | float | str | bool]:
        """Slots, I/O mode and counts of this file."""
        return {
            "path": str(self._path),
            "slots": self._layout.num_slots,
            "slots_used": len(self._slots),
            "slot_bytes": self._layout.payload_span + ENTRY,
            "direct_io": self._file.dfd >= 0,
            "direct_ios": self._io.direct_ios,
            "buffered_ios": self._io.buffered_ios,
            "discarded_at_open": self._discarded_at_open,
            "recreated": self._recreated,
            "adopted": self._adopted,
            "enospc_errors": self._file.enospc,
            "preallocated": self._preallocate,
        }
