"""`DiskIo`: a disk tier's vectored reads and writes of runs of slots, in worker threads.

A run of consecutive slots of one extent moves in one ``pwritev`` / ``preadv``, straight
from and into the CPU pool's memory. A persistent file also gets the extent's header page:
in the same call when the run starts the extent (page and payloads are adjacent), else in a
second call after the payloads, so a crash between the two leaves old headers over new
payloads, which fail their checksum. ``O_DIRECT`` is used when it is on and the buffers
suit it, with the page cache as the fallback; a short write is finished as a careful writer
does, and one that stays short (a full file system) is an error that indexes nothing.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import threading
from collections.abc import Sequence
from typing import final

from kvoffload._logging import get_logger
from kvoffload.errors import TierError
from kvoffload.tiers.base import BlockRead, BlockWrite
from kvoffload.tiers.disk_file import DiskFile, errno_name
from kvoffload.tiers.disk_layout import ENTRY, GROUP, PAGE, HeaderImage
from kvoffload.tiers.format import HEADER_SIZE, checksum

__all__ = ["DiskIo"]

_log = get_logger("tiers.disk")

_LOCKS = 64  # striped locks that order the writes of header pages

_pages = threading.local()


def _header_page() -> memoryview:
    """This thread's page-aligned buffer for writing one header page.

    Kept per worker thread and reused: a fresh page for every write costs a page fault
    and zeroing on each I/O.
    """
    have: memoryview | None = getattr(_pages, "page", None)
    if have is None:
        have = memoryview(mmap.mmap(-1, PAGE))
        _pages.page = have
    return have


def _skip(buffers: list[memoryview], n: int) -> list[memoryview]:
    """``buffers`` without their first ``n`` bytes."""
    rest = []
    for buf in buffers:
        if n >= len(buf):
            n -= len(buf)
            continue
        rest.append(buf[n:])
        n = 0
    return rest


def _address(buf: memoryview) -> int | None:
    """The address of a writable buffer, or ``None`` when it cannot be taken."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(buf))
    except (TypeError, ValueError):
        return None


def _direct_ok(payload: memoryview) -> bool:
    """Whether ``payload``'s address suits ``O_DIRECT``."""
    address = _address(payload)
    return address is not None and address % PAGE == 0


@final
class DiskIo:
    """Moves runs of slots between a tier's file and the caller's buffers.

    Args:
        file: the open file (its descriptors, its notes of errors and space).
        image: the header pages: staged by writes, the headers that reads return.
        name: the tier's name, for errors and logs.
        persist: write header pages to the file (without persistence they are never read
            back: reads are checked against the image, so only payloads are written).
    """

    def __init__(self, file: DiskFile, image: HeaderImage, *, name: str, persist: bool) -> None:
        layout = file.layout
        self._file = file
        self._layout = layout
        self._image = image
        self._name = name
        self._persist = persist
        self._page_locks = [threading.Lock() for _ in range(_LOCKS)]
        self._direct_sizes = layout.gap == 0  # O_DIRECT needs whole pages
        self._pad = memoryview(bytes(layout.gap)) if layout.gap else None
        self._scratch = memoryview(bytearray(layout.gap)) if layout.gap else None
        self.direct_ios = 0
        self.buffered_ios = 0

    def write(self, box: list[list[tuple[BlockWrite, int]]]) -> int:
        """Write the boxed jobs (sorted by slot): per run of consecutive slots of one
        extent, one ``pwritev`` of the payloads, and the extent's header page (in the same
        call when the run starts the extent, else right after the payloads).

        The box is emptied first: an idle worker thread keeps its last call's arguments,
        and must not keep the caller's buffers exported.

        Returns:
            How many jobs, from the first, were written in full.

        Raises:
            TierError: the file was removed or replaced, or a write failed or stayed short.
        """
        jobs = box.pop()
        self._file.check()
        layout, image, name = self._layout, self._image, self._name
        page = _header_page() if self._persist else None
        pad = self._pad
        written = 0
        for lo, hi in layout.runs([slot for _, slot in jobs]):
            first, last = jobs[lo][1], jobs[hi - 1][1]
            # The headers, with the payload checksums in them, in this thread.
            headers: list[bytes] = []
            payloads: list[memoryview] = []
            for block, slot in jobs[lo:hi]:
                header = block.sealed_header()
                if len(header) > ENTRY:
                    raise ValueError(
                        f"disk tier {name!r}: header of {len(header)} bytes for slot "
                        f"{slot}; a header takes at most {ENTRY}"
                    )
                headers.append(header)
                payloads.append(block.payload)
            if pad is None:
                buffers = payloads.copy()
            else:
                buffers = payloads[:1]
                for payload in payloads[1:]:
                    buffers += (pad, payload)
            if page is None:
                image.stage(first, headers)
                self._write_all(first, last, buffers, payloads, layout.offset(first))
            else:
                extent = first // GROUP
                lock = self._page_locks[extent % _LOCKS]
                at = layout.header_page_offset(extent)
                if first % GROUP == 0:
                    # The run starts its extent: header page and payloads are adjacent.
                    with lock:
                        image.stage(first, headers)
                        image.copy_page(extent, page)
                        self._write_all(first, last, [page, *buffers], payloads, at)
                else:
                    # Payloads first: a crash between the two writes leaves old headers
                    # over new payloads, which fail their checksum.
                    self._write_all(first, last, buffers, payloads, layout.offset(first))
                    with lock:  # page writes of one extent in order, each with all headers
                        image.stage(first, headers)
                        image.copy_page(extent, page)
                        self._write_all(first, last, [page], payloads, at)
            buffers.clear()
            written = hi
        return written

    def read(
        self, box: list[tuple[list[tuple[int, int]], Sequence[memoryview]]]
    ) -> list[BlockRead]:
        """Read the boxed jobs (sorted by slot) into their buffers: one ``preadv`` per run
        of consecutive slots of one extent. Each read comes with the header the tier
        wrote for its slot (from the image of the header pages).

        Raises:
            TierError: a read failed.
        """
        jobs, into = box.pop()
        layout = self._layout
        scratch = self._scratch
        nbytes = layout.block_nbytes
        span = layout.payload_span
        images = self._image.data
        reads: list[BlockRead] = []
        for lo, hi in layout.runs([slot for _, slot in jobs]):
            run = jobs[lo:hi]
            payloads = []
            for i, _ in run:
                buf = into[i]
                payloads.append(buf if len(buf) == nbytes else buf[:nbytes])
            if scratch is None:
                buffers = payloads.copy()
            else:
                buffers = payloads[:1]
                for payload in payloads[1:]:
                    buffers += (scratch, payload)
            first = run[0][1]
            try:
                n = self.io(False, buffers, payloads, layout.offset(first))
            except OSError as exc:
                self._file.note_error(exc)
                raise TierError(
                    f"disk tier {self._name!r}: read of slots {first}..{run[-1][1]} "
                    f"failed: {errno_name(exc)} {exc.strerror}"
                ) from exc
            finally:
                buffers.clear()
            got = n
            for (_, slot), payload in zip(run, payloads, strict=True):
                at = slot * ENTRY
                # The checksum of what just landed, while it is in this core's cache;
                # the manager compares it with the header before publishing.
                if got >= nbytes:
                    read = BlockRead(
                        bytes(images[at : at + HEADER_SIZE]), nbytes, checksum(payload)
                    )
                else:
                    read = BlockRead(bytes(images[at : at + HEADER_SIZE]), max(0, got))
                reads.append(read)
                got -= span
        return reads

    def _write_all(
        self,
        first: int,
        last: int,
        buffers: list[memoryview],
        payloads: list[memoryview],
        offset: int,
    ) -> None:
        """Write ``buffers`` at ``offset`` in full, or raise `TierError`."""
        want = sum(len(b) for b in buffers)
        file = self._file
        try:
            n = self.io(True, buffers, payloads, offset)
            while 0 < n < want:
                # A short write: write the rest, as a careful writer does; on a full file
                # system that call fails with the errno (ENOSPC) that says why. (Through
                # the page cache: the rest need not be aligned for O_DIRECT.)
                more = os.pwritev(file.fd, _skip(buffers, n), offset + n)
                self.buffered_ios += 1
                if more <= 0:
                    break
                n += more
        except OSError as exc:
            file.note_error(exc)
            raise TierError(
                f"disk tier {self._name!r}: write of slots {first}..{last} failed: "
                f"{errno_name(exc)} {exc.strerror}"
            ) from exc
        if n != want:
            # On a sparse file a write cut short means the file system filled up.
            file.note_full()
            _log.warning(
                "disk_tier_short_write",
                tier=self._name,
                path=str(file.path),
                written=n,
                wanted=want,
            )
            raise TierError(
                f"disk tier {self._name!r}: short write of slots {first}..{last}: {n} of "
                f"{want} bytes"
            )

    def io(
        self, write: bool, buffers: list[memoryview], payloads: list[memoryview], offset: int
    ) -> int:
        """One vectored I/O of ``buffers`` at ``offset``: ``O_DIRECT`` when it can be.

        ``O_DIRECT`` is tried first whenever it is on and the block size is a multiple of
        4 KiB; buffer addresses are only checked when the kernel refuses (``EINVAL``):
        unaligned memory then goes through the page cache for this call, and a file system
        that refuses aligned buffers turns ``O_DIRECT`` off for good.
        """
        call = os.pwritev if write else os.preadv
        file = self._file
        if file.dfd >= 0 and self._direct_sizes:
            try:
                n = call(file.dfd, buffers, offset)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                if all(_direct_ok(p) for p in payloads):
                    # The file system refused aligned O_DIRECT I/O: page cache from now on.
                    _log.warning("disk_tier_direct_io_refused", tier=self._name, error=str(exc))
                    file.drop_direct()
            else:
                self.direct_ios += 1
                return n
        self.buffered_ios += 1
        return call(file.fd, buffers, offset)
