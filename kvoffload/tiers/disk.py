"""`DiskTier`: blocks in one preallocated file on a local disk, addressed by slot.

The file starts with a 4 KiB superblock (format, slot size, slot count, block size,
namespace), followed by slots of one 4 KiB header page and one block payload rounded up
to 4 KiB. A block is written with a single ``pwritev`` of its header page and payload and
read with a single ``preadv``, straight from and into the CPU pool's memory, in worker
threads. ``O_DIRECT`` is used when the file system accepts it and the buffer is aligned;
otherwise the I/O goes through the page cache (reported in `statistics()`).

The index (hash → slot, in LRU order) lives in memory. With ``persist=True`` the file
is kept on close and the index is rebuilt at start-up from the slot headers: a slot whose
header is torn, foreign (another namespace or block size) or duplicated is discarded. A
slot whose payload was torn by a crash keeps a valid-looking header, but its checksum
fails at the first read, which drops it.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import struct
import threading
import zlib
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import final

import anyio
import anyio.lowlevel
import anyio.to_thread

from kvoffload._logging import get_logger
from kvoffload.errors import ConfigError, IntegrityError, TierError
from kvoffload.hashing import BlockHash
from kvoffload.tiers.base import BlockRead, BlockWrite
from kvoffload.tiers.format import HEADER_SIZE, checksum, parse_header

__all__ = ["DiskTier"]

_log = get_logger("tiers.disk")

_PAGE = 4096
_ZERO_HEADER = bytes(HEADER_SIZE)
_SUPER = struct.Struct("<8sIQQQ32s")
_SUPER_MAGIC = b"KVODISK1"
_SUPER_VERSION = 1


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


_pages = threading.local()


def _header_pages(kind: str, count: int) -> memoryview:
    """This thread's ``count`` page-aligned header pages for ``kind`` ``"w"`` or ``"r"``.

    Kept per worker thread and reused: fresh pages for every call cost page faults and
    zeroing on each I/O. Write pages only ever get a header's first bytes written (the
    rest stays zero); read pages have their header bytes zeroed before each read.
    """
    have: memoryview | None = getattr(_pages, kind, None)
    if have is None or len(have) < count * _PAGE:
        size = max(count, 16) * _PAGE
        setattr(_pages, kind, memoryview(mmap.mmap(-1, size)))
        have = getattr(_pages, kind)
    assert have is not None
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
        if block_nbytes < 1:
            raise ConfigError(f"disk tier {name!r}: block_nbytes={block_nbytes} must be >= 1")
        self._path = Path(path)
        self._block_nbytes = block_nbytes
        self._payload_span = _round_up(block_nbytes, _PAGE)
        self._slot_size = _PAGE + self._payload_span
        self._num_slots = (int(capacity_bytes) - _PAGE) // self._slot_size
        if self._num_slots < 1:
            raise ConfigError(
                f"disk tier {name!r}: capacity_bytes={int(capacity_bytes)} holds no slot of "
                f"{self._slot_size} bytes (a {_PAGE}-byte header page plus the block)"
            )
        self._namespace = namespace
        self._persist = persist
        self._want_direct = direct_io == "auto"
        self._preallocate = preallocate
        self._full = False
        self._name = name
        self._limiter = anyio.CapacityLimiter(io_threads)
        self._fd = -1
        self._dfd = -1
        self._identity: tuple[int, int] | None = None
        self._index: OrderedDict[BlockHash, int] = OrderedDict()
        self._free: list[int] = []
        self._readers: dict[int, int] = {}
        self._doomed: set[int] = set()
        self._writing: set[BlockHash] = set()
        self._direct_ios = 0
        self._buffered_ios = 0
        self._discarded_at_open = 0
        self._recreated = 0
        self._enospc = 0
        self._closed = False
        # Payloads not a whole number of pages leave a gap before the next slot's header;
        # a run of slots skips it with a zero pad (writes) or a scratch buffer (reads).
        gap = self._payload_span - block_nbytes
        self._pad = memoryview(bytes(gap)) if gap else None
        self._scratch = memoryview(bytearray(gap)) if gap else None
        iov_max = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024
        self._run_max = max(1, min(iov_max, 1024) // 3)

    def __repr__(self) -> str:
        return (
            f"DiskTier(name={self._name!r}, path={str(self._path)!r}, "
            f"slots={len(self._index)}/{self._num_slots})"
        )

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
        return self._num_slots

    @property
    def direct_io(self) -> bool:
        """Whether ``O_DIRECT`` is in use for aligned buffers."""
        return self._dfd >= 0

    # -- lifecycle ---------------------------------------------------------------------------

    async def open(self) -> None:
        """Create or reopen the file (in a worker thread); rebuild the index if persistent.

        Raises:
            TierError: the file cannot be created or preallocated (the errno is named).
        """
        await anyio.to_thread.run_sync(self._open_sync, limiter=self._limiter)

    def _superblock(self) -> bytes:
        body = _SUPER.pack(
            _SUPER_MAGIC,
            _SUPER_VERSION,
            self._slot_size,
            self._num_slots,
            self._block_nbytes,
            self._namespace,
        )
        body += struct.pack("<I", zlib.crc32(body))
        return body.ljust(_PAGE, b"\0")

    def _open_sync(self) -> None:
        self._close_fds()
        size = _PAGE + self._num_slots * self._slot_size
        reuse = False
        try:
            fd = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise TierError(
                f"disk tier {self._name!r}: cannot open {self._path}: "
                f"{errno.errorcode.get(exc.errno or 0, exc.errno)} {exc.strerror}"
            ) from exc
        try:
            if self._persist and os.fstat(fd).st_size == size:
                reuse = os.pread(fd, _PAGE, 0) == self._superblock()
            if not reuse:
                os.ftruncate(fd, 0)
                if self._preallocate and hasattr(os, "posix_fallocate"):
                    os.posix_fallocate(fd, 0, size)
                else:  # sparse: space is taken as slots are written
                    os.ftruncate(fd, size)
                os.pwrite(fd, self._superblock(), 0)
        except OSError as exc:
            os.close(fd)
            raise TierError(
                f"disk tier {self._name!r}: cannot preallocate {size} bytes in {self._path}: "
                f"{errno.errorcode.get(exc.errno or 0, exc.errno)} {exc.strerror}"
            ) from exc
        st = os.fstat(fd)
        self._fd = fd
        self._identity = (st.st_dev, st.st_ino)
        self._index.clear()
        self._readers.clear()
        self._doomed.clear()
        self._free = []
        if reuse:
            self._rebuild()
        else:
            self._free = list(range(self._num_slots - 1, -1, -1))
        if self._want_direct:
            try:
                self._dfd = os.open(self._path, os.O_RDWR | os.O_CLOEXEC | os.O_DIRECT)
            except (OSError, AttributeError) as exc:
                _log.warning(
                    "disk_tier_buffered_io", tier=self._name, path=str(self._path), error=str(exc)
                )
        _log.info(
            "disk_tier_opened",
            tier=self._name,
            path=str(self._path),
            slots=self._num_slots,
            reused=len(self._index),
            discarded=self._discarded_at_open,
            direct_io=self._dfd >= 0,
        )

    def _rebuild(self) -> None:
        free: list[int] = []
        for slot in range(self._num_slots):
            raw = os.pread(self._fd, HEADER_SIZE, self._offset(slot))
            try:
                header = parse_header(raw)
            except IntegrityError:
                if raw.strip(b"\0"):
                    self._discarded_at_open += 1
                free.append(slot)
                continue
            if (
                header.namespace != self._namespace
                or header.payload_length != self._block_nbytes
                or header.block_hash in self._index
            ):
                self._discarded_at_open += 1
                free.append(slot)
                continue
            self._index[header.block_hash] = slot
        self._free = free[::-1]

    def _close_fds(self) -> None:
        for fd in (self._fd, self._dfd):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._fd = self._dfd = -1

    async def close(self) -> None:
        """Close the file; remove it unless ``persist``. Idempotent."""
        if self._closed:
            return
        self._closed = True
        identity = self._identity
        self._close_fds()
        if not self._persist and identity is not None:
            with contextlib.suppress(OSError):
                st = os.stat(self._path)
                if (st.st_dev, st.st_ino) == identity:
                    os.unlink(self._path)
        self._index.clear()

    def _check_space(self) -> None:
        """After a write ran out of space: raise `TierError` until a slot fits again."""
        if not self._full:
            return
        try:
            st = os.statvfs(self._path.parent)
        except OSError as exc:
            raise TierError(f"disk tier {self._name!r}: statvfs failed: {exc}") from exc
        free = st.f_bavail * st.f_frsize
        if free < self._slot_size:
            raise TierError(
                f"disk tier {self._name!r}: ENOSPC: {free} bytes free on the file system "
                f"of {self._path}, a slot needs {self._slot_size}"
            )
        self._full = False
        _log.info("disk_tier_space_again", tier=self._name, free_bytes=free)

    def _check_file(self) -> None:
        """Raise `TierError` when the file was deleted or replaced under us."""
        try:
            st = os.stat(self._path)
        except OSError as exc:
            raise TierError(f"disk tier {self._name!r}: {self._path} is gone: {exc}") from exc
        if (st.st_dev, st.st_ino) != self._identity:
            raise TierError(f"disk tier {self._name!r}: {self._path} was replaced")

    async def ping(self) -> None:
        """Check the file is still ours (recreate it, empty, when it was removed) and,
        after a write ran out of space, that a slot's worth of space is free again.

        Raises:
            TierError: the file is gone and cannot be created again, or the file system
                is still full (``ENOSPC`` in the message).
        """
        if self._closed:
            raise TierError(f"disk tier {self._name!r} is closed")
        try:
            await anyio.to_thread.run_sync(self._check_file, limiter=self._limiter)
        except TierError:
            if any(self._readers.values()) or self._writing:
                raise
            was_persist, self._persist = self._persist, False
            try:
                await anyio.to_thread.run_sync(self._open_sync, limiter=self._limiter)
            finally:
                self._persist = was_persist
            self._recreated += 1
            _log.warning("disk_tier_recreated", tier=self._name, path=str(self._path))
        await anyio.to_thread.run_sync(self._check_space, limiter=self._limiter)

    # -- slots -------------------------------------------------------------------------------

    def _offset(self, slot: int) -> int:
        return _PAGE + slot * self._slot_size

    def _take_slot(self) -> int | None:
        if self._free:
            return self._free.pop()
        readers = self._readers
        for block_hash, slot in self._index.items():
            if not readers.get(slot):
                del self._index[block_hash]
                return slot
        return None

    def _release_slot(self, slot: int) -> None:
        if self._readers.get(slot):
            self._doomed.add(slot)
        else:
            self._free.append(slot)

    def _direct_ok(self, payload: memoryview) -> bool:
        if self._dfd < 0 or len(payload) % _PAGE:
            return False
        address = _address(payload)
        return address is not None and address % _PAGE == 0

    # -- the protocol ------------------------------------------------------------------------

    async def exists(self, block_hashes: Sequence[BlockHash]) -> int:
        """Length of the leading run of ``block_hashes`` the file holds."""
        await anyio.lowlevel.checkpoint()
        index = self._index
        n = 0
        for block_hash in block_hashes:
            if block_hash not in index:
                break
            n += 1
        return n

    async def put(self, blocks: Sequence[BlockWrite]) -> int:
        """Write blocks into free or least recently used slots.

        One ``pwritev`` writes each run of consecutive slots (header pages and payloads
        as separate buffers, no copy).

        Blocks already present are only touched in the LRU order. When every slot is being
        read, a block is dropped (not counted as stored).

        Returns:
            Blocks now held, of those given.

        Raises:
            TierError: the file was removed or replaced, or a write failed (the errno
                is named and logged; no block of this call is indexed, their slots are
                freed).
        """
        if self._fd < 0:
            raise TierError(f"disk tier {self._name!r} is not open")
        held = 0
        jobs: list[tuple[BlockWrite, int]] = []
        for block in blocks:
            if len(block.payload) != self._block_nbytes:
                raise ValueError(
                    f"disk tier {self._name!r}: payload of {len(block.payload)} bytes, a block "
                    f"has {self._block_nbytes}"
                )
            if block.block_hash in self._index:
                self._index.move_to_end(block.block_hash)
                held += 1
                continue
            if block.block_hash in self._writing:
                continue
            slot = self._take_slot()
            if slot is None:
                continue
            self._writing.add(block.block_hash)
            jobs.append((block, slot))
        if not jobs:
            return held
        jobs.sort(key=lambda job: job[1])  # consecutive slots go in one pwritev
        written = 0
        try:
            # Handed over in a box the call empties: an idle worker thread keeps its last
            # call's arguments, and must not keep the caller's buffers exported.
            written = await anyio.to_thread.run_sync(
                self._write_sync, [list(jobs)], limiter=self._limiter
            )
        finally:
            for i, (block, slot) in enumerate(jobs):
                self._writing.discard(block.block_hash)
                if i < written and not self._closed:
                    self._index[block.block_hash] = slot
                else:
                    self._release_slot(slot)
        return held + written

    def _runs(self, slots: Sequence[int]) -> list[tuple[int, int]]:
        """Split job positions into runs ``[lo, hi)`` of consecutive slots (one I/O each)."""
        runs: list[tuple[int, int]] = []
        lo = 0
        for k in range(1, len(slots) + 1):
            if k == len(slots) or slots[k] != slots[k - 1] + 1 or k - lo >= self._run_max:
                runs.append((lo, k))
                lo = k
        return runs

    def _write_sync(self, box: list[list[tuple[BlockWrite, int]]]) -> int:
        """Write the boxed jobs (sorted by slot): one ``pwritev`` per run of consecutive
        slots.

        Returns how many jobs, from the first, were written in full.
        """
        jobs = box.pop()
        self._check_file()
        pages = _header_pages("w", len(jobs))
        pad = self._pad
        written = 0
        for lo, hi in self._runs([slot for _, slot in jobs]):
            buffers: list[memoryview] = []
            payloads = []
            for k in range(lo, hi):
                block = jobs[k][0]
                header = block.sealed_header()  # the checksum, in this thread
                # Headers have one fixed size, so the rest of each page stays zero.
                pages[k * _PAGE : k * _PAGE + len(header)] = header
                buffers.append(pages[k * _PAGE : (k + 1) * _PAGE])
                buffers.append(block.payload)
                payloads.append(block.payload)
                if pad is not None and k + 1 < hi:
                    buffers.append(pad)
            slot = jobs[lo][1]
            want = sum(len(b) for b in buffers)
            try:
                n = self._io(True, buffers, payloads, self._offset(slot))
                while 0 < n < want:
                    # A short write: write the rest, as a careful writer does; on a full
                    # file system that call fails with the errno (ENOSPC) that says why.
                    # (Through the page cache: the rest need not be aligned for O_DIRECT.)
                    more = os.pwritev(self._fd, _skip(buffers, n), self._offset(slot) + n)
                    self._buffered_ios += 1
                    if more <= 0:
                        break
                    n += more
            except OSError as exc:
                self._note_error(exc)
                raise TierError(
                    f"disk tier {self._name!r}: write of slots {slot}..{slot + hi - lo - 1} "
                    f"failed: {errno.errorcode.get(exc.errno or 0, exc.errno)} "
                    f"{exc.strerror}"
                ) from exc
            finally:
                buffers.clear()
            if n != want:
                # On a sparse file a write cut short means the file system filled up.
                self._enospc += 1
                self._full = True
                _log.warning(
                    "disk_tier_short_write",
                    tier=self._name,
                    path=str(self._path),
                    written=n,
                    wanted=want,
                )
                raise TierError(
                    f"disk tier {self._name!r}: short write of slots "
                    f"{slot}..{slot + hi - lo - 1}: {n} of {want} bytes"
                )
            written = hi
        return written

    def _note_error(self, exc: OSError) -> None:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            self._enospc += 1
            self._full = True
        _log.warning(
            "disk_tier_io_error",
            tier=self._name,
            path=str(self._path),
            errno=errno.errorcode.get(exc.errno or 0, str(exc.errno)),
            error=exc.strerror,
        )

    def _io(
        self,
        write: bool,
        buffers: list[memoryview],
        payloads: list[memoryview],
        offset: int,
    ) -> int:
        call = os.pwritev if write else os.preadv
        if self._dfd >= 0 and all(self._direct_ok(p) for p in payloads):
            try:
                n = call(self._dfd, buffers, offset)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                # The file system refused this O_DIRECT I/O: page cache from now on.
                _log.warning("disk_tier_direct_io_refused", tier=self._name, error=str(exc))
                with contextlib.suppress(OSError):
                    os.close(self._dfd)
                self._dfd = -1
            else:
                self._direct_ios += 1
                return n
        self._buffered_ios += 1
        return call(self._fd, buffers, offset)

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
        if self._fd < 0:
            raise TierError(f"disk tier {self._name!r} is not open")
        jobs: list[tuple[int, int]] = []
        for i, block_hash in enumerate(block_hashes):
            slot = self._index.get(block_hash)
            if slot is None:
                continue
            if len(into[i]) < self._block_nbytes:
                raise ValueError(f"buffer {i} holds {len(into[i])} bytes, a block has more")
            self._index.move_to_end(block_hash)
            self._readers[slot] = self._readers.get(slot, 0) + 1
            jobs.append((i, slot))
        out: list[BlockRead | None] = [None] * len(block_hashes)
        if not jobs:
            return out
        jobs.sort(key=lambda job: job[1])  # consecutive slots come in one preadv
        try:
            reads = await anyio.to_thread.run_sync(
                self._read_sync, [(jobs, into)], limiter=self._limiter
            )
        finally:
            for _, slot in jobs:
                left = self._readers[slot] - 1
                if left:
                    self._readers[slot] = left
                else:
                    del self._readers[slot]
                    if slot in self._doomed:
                        self._doomed.discard(slot)
                        self._free.append(slot)
        for (i, _), read in zip(jobs, reads, strict=True):
            out[i] = read
        return out

    def _read_sync(
        self, box: list[tuple[list[tuple[int, int]], Sequence[memoryview]]]
    ) -> list[BlockRead]:
        """Read the boxed jobs (sorted by slot) into their buffers: one ``preadv`` per run
        of consecutive slots."""
        jobs, into = box.pop()
        pages = _header_pages("r", len(jobs))
        scratch = self._scratch
        nbytes = self._block_nbytes
        reads = []
        for lo, hi in self._runs([slot for _, slot in jobs]):
            buffers: list[memoryview] = []
            payloads = []
            for k in range(lo, hi):
                payload = into[jobs[k][0]][:nbytes]
                pages[k * _PAGE : k * _PAGE + HEADER_SIZE] = _ZERO_HEADER
                buffers.append(pages[k * _PAGE : (k + 1) * _PAGE])
                buffers.append(payload)
                payloads.append(payload)
                if scratch is not None and k + 1 < hi:
                    buffers.append(scratch)
            slot = jobs[lo][1]
            try:
                n = self._io(False, buffers, payloads, self._offset(slot))
            except OSError as exc:
                self._note_error(exc)
                raise TierError(
                    f"disk tier {self._name!r}: read of slots {slot}..{slot + hi - lo - 1} "
                    f"failed: {errno.errorcode.get(exc.errno or 0, exc.errno)} "
                    f"{exc.strerror}"
                ) from exc
            finally:
                buffers.clear()
            for k in range(lo, hi):
                # A short read leaves the rest of the header zero (it fails its crc).
                at = (k - lo) * self._slot_size + _PAGE
                got = min(nbytes, max(0, n - at))
                # The checksum of what just landed, while it is in this core's cache;
                # the manager compares it with the header before publishing.
                payload_checksum = checksum(payloads[k - lo]) if got == nbytes else None
                header = bytes(pages[k * _PAGE : k * _PAGE + HEADER_SIZE])
                reads.append(BlockRead(header, got, payload_checksum))
        return reads

    async def delete(self, block_hashes: Sequence[BlockHash]) -> None:
        """Forget blocks; their slots are reused once no read holds them."""
        await anyio.lowlevel.checkpoint()
        for block_hash in block_hashes:
            slot = self._index.pop(block_hash, None)
            if slot is not None:
                self._release_slot(slot)

    def statistics(self) -> Mapping[str, int | float | str | bool]:
        """Slots, I/O mode and counts of this file."""
        return {
            "path": str(self._path),
            "slots": self._num_slots,
            "slots_used": len(self._index),
            "slot_bytes": self._slot_size,
            "direct_io": self._dfd >= 0,
            "direct_ios": self._direct_ios,
            "buffered_ios": self._buffered_ios,
            "discarded_at_open": self._discarded_at_open,
            "recreated": self._recreated,
            "enospc_errors": self._enospc,
            "preallocated": self._preallocate,
        }
