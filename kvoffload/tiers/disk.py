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
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import mmap
import operator
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
from kvoffload.tiers._threads import IoThreads
from kvoffload.tiers.base import BlockRead, BlockWrite
from kvoffload.tiers.format import HEADER_SIZE, checksum, parse_header

__all__ = ["DiskTier"]

_log = get_logger("tiers.disk")

_PAGE = 4096
_SUPER = struct.Struct("<8sIQQQ32s")
_SUPER_MAGIC = b"KVODISK1"
_SUPER_VERSION = 2  # 1: one header page per slot; 2: one header page per 32 slots
_ENTRY = 128  # bytes of a header page per slot (a header is HEADER_SIZE of them)
_GROUP = _PAGE // _ENTRY  # slots per extent
_LOCKS = 64  # striped locks that order the writes of header pages


assert HEADER_SIZE <= _ENTRY


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def _file_bytes(num_slots: int, span: int) -> int:
    """Size of a file of ``num_slots`` slots whose payloads take ``span`` bytes each."""
    full, extra = divmod(num_slots, _GROUP)
    return _PAGE + full * (_PAGE + _GROUP * span) + (_PAGE + extra * span if extra else 0)


def _slots_in(capacity_bytes: int, span: int) -> int:
    """How many slots of ``span`` payload bytes a file of ``capacity_bytes`` holds."""
    avail = capacity_bytes - _PAGE
    extent = _PAGE + _GROUP * span
    if avail < _PAGE + span:
        return 0
    full, rest = divmod(avail, extent)
    extra = min(_GROUP - 1, (rest - _PAGE) // span) if rest >= _PAGE + span else 0
    return full * _GROUP + extra


_pages = threading.local()


def _header_page() -> memoryview:
    """This thread's page-aligned buffer for writing one header page.

    Kept per worker thread and reused: a fresh page for every write costs a page fault
    and zeroing on each I/O.
    """
    have: memoryview | None = getattr(_pages, "page", None)
    if have is None:
        have = memoryview(mmap.mmap(-1, _PAGE))
        _pages.page = have
    return have


_slot_of = operator.itemgetter(1)


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
        self._extent_size = _PAGE + _GROUP * self._payload_span
        # What one more slot can take from the file system: its payload and, at worst,
        # the header page of a new extent.
        self._slot_size = _PAGE + self._payload_span
        self._num_slots = _slots_in(int(capacity_bytes), self._payload_span)
        if self._num_slots < 1:
            raise ConfigError(
                f"disk tier {name!r}: capacity_bytes={int(capacity_bytes)} holds no slot: "
                f"the smallest file is {_file_bytes(1, self._payload_span)} bytes (a "
                f"{_PAGE}-byte superblock, a header page and the block rounded up to {_PAGE})"
            )
        self._file_size = _file_bytes(self._num_slots, self._payload_span)
        # The image of every header page, as on disk once the writes under way are done.
        self._headers = bytearray(-(-self._num_slots // _GROUP) * _PAGE)
        self._page_locks = [threading.Lock() for _ in range(_LOCKS)]
        self._namespace = namespace
        self._persist = persist
        self._want_direct = direct_io == "auto"
        self._preallocate = preallocate
        self._full = False
        self._name = name
        self._threads = IoThreads(io_threads, f"kvoffload-disk-{name}")
        self._limiter = self._threads.limiter
        self._fd = -1
        self._dfd = -1
        self._identity: tuple[int, int] | None = None
        self._owned = False  # the file is one this tier created or initialised
        self._file_ok = True  # the last check found the file still ours
        self._index: OrderedDict[BlockHash, int] = OrderedDict()
        self._free: list[int] = []  # a stack: the last freed goes first
        self._readers: dict[int, int] = {}
        self._doomed: set[int] = set()
        self._writing: set[BlockHash] = set()
        self._direct_ios = 0
        self._buffered_ios = 0
        self._discarded_at_open = 0
        self._recreated = 0
        self._adopted = 0
        self._enospc = 0
        self._closed = False
        # Payloads not a whole number of pages leave a gap before the next slot's header;
        # a run of slots skips it with a zero pad (writes) or a scratch buffer (reads).
        gap = self._payload_span - block_nbytes
        self._direct_sizes = gap == 0  # O_DIRECT needs whole pages
        self._pad = memoryview(bytes(gap)) if gap else None
        self._scratch = memoryview(bytearray(gap)) if gap else None
        iov_max = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024
        self._run_max = max(1, min(iov_max, 1024) // 3)

    def __repr__(self) -> str:
        return (
            f"DiskTier(name={self._name!r}, path={str(self._path)!r}, "
            f"slots={len(self._index)}/{self._num_slots})"
        )

    @staticmethod
    def file_bytes(num_slots: int, block_nbytes: int) -> int:
        """The ``capacity_bytes`` that holds exactly ``num_slots`` blocks of ``block_nbytes``.

        A block takes its size rounded up to 4 KiB, plus 128 bytes of a header page shared
        by 32 slots; the file starts with a 4 KiB superblock.

        Raises:
            ValueError: ``num_slots`` or ``block_nbytes`` is below 1.
        """
        if num_slots < 1 or block_nbytes < 1:
            raise ValueError(f"num_slots={num_slots} and block_nbytes={block_nbytes} must be >= 1")
        return _file_bytes(num_slots, _round_up(block_nbytes, _PAGE))

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
            self._payload_span,
            self._num_slots,
            self._block_nbytes,
            self._namespace,
        )
        body += struct.pack("<I", zlib.crc32(body))
        return body.ljust(_PAGE, b"\0")

    def _open_sync(self, recover: bool = False) -> None:
        """Open the file, lock it, and reuse, adopt or initialise it.

        A file this call creates, an empty one, or (at a first open) one that starts with
        a disk tier's superblock is initialised (truncated and preallocated); a persisted
        file of this geometry and namespace is reused. When ``recover`` (the path was
        removed or replaced under a running tier), only a file this call creates is
        initialised: one of this geometry and namespace is adopted as it is, anything else
        is refused, untouched.
        """
        self._close_fds()
        # With no file open its inode number can be reused: nothing at the path is ours.
        self._identity = None
        self._owned = False
        size = self._file_size
        fd, created = self._open_fd(recover)
        try:
            self._lock(fd)
            reuse = False
            if not created:
                reuse = self._inspect(fd, recover)
            if not reuse:
                os.ftruncate(fd, 0)
                if self._preallocate and hasattr(os, "posix_fallocate"):
                    os.posix_fallocate(fd, 0, size)
                else:  # sparse: space is taken as slots are written
                    os.ftruncate(fd, size)
                os.pwrite(fd, self._superblock(), 0)
        except TierError:
            os.close(fd)
            raise
        except OSError as exc:
            os.close(fd)
            raise TierError(
                f"disk tier {self._name!r}: cannot preallocate {size} bytes in {self._path}: "
                f"{errno.errorcode.get(exc.errno or 0, exc.errno)} {exc.strerror}"
            ) from exc
        st = os.fstat(fd)
        self._fd = fd
        self._identity = (st.st_dev, st.st_ino)
        # Removed at close (without persist) only when this tier initialised it.
        self._owned = not reuse
        self._index.clear()
        self._readers.clear()
        self._doomed.clear()
        self._free = []
        self._headers[:] = bytes(len(self._headers))
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

    def _open_fd(self, recover: bool) -> tuple[int, bool]:
        """Open (or create) the file: ``(fd, whether this call created it)``."""
        flags = os.O_RDWR | os.O_CLOEXEC
        try:
            try:
                return os.open(self._path, flags | os.O_CREAT | os.O_EXCL, 0o600), True
            except FileExistsError:
                return os.open(self._path, flags), False
        except OSError as exc:
            raise TierError(
                f"disk tier {self._name!r}: cannot open {self._path}: "
                f"{errno.errorcode.get(exc.errno or 0, exc.errno)} {exc.strerror}"
            ) from exc

    def _lock(self, fd: int) -> None:
        """Take the file's exclusive lock, or raise `TierError`: one tier per file."""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise TierError(
                    f"disk tier {self._name!r}: {self._path} is in use by another disk tier "
                    "(in this process or another one holds its lock); give each tier its own "
                    "file"
                ) from exc
            raise TierError(
                f"disk tier {self._name!r}: cannot lock {self._path}: "
                f"{errno.errorcode.get(exc.errno or 0, exc.errno)} {exc.strerror}"
            ) from exc

    def _inspect(self, fd: int, recover: bool) -> bool:
        """Whether an existing file is reused (a persisted file of this geometry and
        namespace); ``False``: initialise it. Raises `TierError` for a file that must
        not be touched."""
        st = os.fstat(fd)
        head = os.pread(fd, _PAGE, 0)
        ours = st.st_size == self._file_size and head == self._superblock()
        if recover:
            if ours:
                return True
            why = (
                "it is not a disk tier file"
                if not head.startswith(_SUPER_MAGIC)
                else f"{st.st_size} bytes, this tier's file has {self._file_size}"
                if st.st_size != self._file_size
                else "its superblock is of another format, namespace or geometry"
            )
            raise TierError(
                f"disk tier {self._name!r}: {self._path} was replaced by a file this tier "
                f"cannot adopt ({why}); it is left untouched"
            )
        if self._persist and ours:
            return True
        if st.st_size and not head.startswith(_SUPER_MAGIC):
            raise TierError(
                f"disk tier {self._name!r}: {self._path} holds {st.st_size} bytes that are not "
                "a disk tier file; refusing to overwrite it (remove it or choose another path)"
            )
        return False

    def _rebuild(self) -> None:
        free: list[int] = []
        images = self._headers
        for extent in range(len(images) // _PAGE):
            page = os.pread(self._fd, _PAGE, self._header_page_offset(extent))
            images[extent * _PAGE : extent * _PAGE + len(page)] = page
            for slot in range(extent * _GROUP, min(self._num_slots, (extent + 1) * _GROUP)):
                at = slot * _ENTRY
                raw = bytes(images[at : at + HEADER_SIZE])
                try:
                    header = parse_header(raw)
                except IntegrityError:
                    if images[at : at + _ENTRY].strip(b"\0"):
                        self._discarded_at_open += 1
                    images[at : at + _ENTRY] = bytes(_ENTRY)
                    free.append(slot)
                    continue
                if (
                    header.namespace != self._namespace
                    or header.payload_length != self._block_nbytes
                    or header.block_hash in self._index
                ):
                    self._discarded_at_open += 1
                    images[at : at + _ENTRY] = bytes(_ENTRY)
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
        self._threads.shutdown()
        self._close_fds()
        if not self._persist and self._owned and identity is not None:
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
        self._file_ok = False
        try:
            st = os.stat(self._path)
        except OSError as exc:
            raise TierError(f"disk tier {self._name!r}: {self._path} is gone: {exc}") from exc
        if self._identity is None or (st.st_dev, st.st_ino) != self._identity:
            raise TierError(f"disk tier {self._name!r}: {self._path} was replaced")
        self._file_ok = True

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
            await anyio.to_thread.run_sync(self._check_file, limiter=self._limiter)
        except TierError:
            if any(self._readers.values()) or self._writing:
                raise
            await anyio.to_thread.run_sync(self._recover_sync, limiter=self._limiter)
        await anyio.to_thread.run_sync(self._check_space, limiter=self._limiter)

    def _recover_sync(self) -> None:
        self._open_sync(recover=True)
        if self._owned:
            self._recreated += 1
            _log.warning("disk_tier_recreated", tier=self._name, path=str(self._path))
        else:
            self._adopted += 1
            _log.warning(
                "disk_tier_adopted", tier=self._name, path=str(self._path), blocks=len(self._index)
            )

    def reads_ok(self) -> bool:
        """Whether the tier still serves reads although writes fail: the file system is
        full (``ENOSPC``), and the blocks written before stay readable."""
        return self._full and self._file_ok and self._fd >= 0

    # -- slots -------------------------------------------------------------------------------

    def _header_page_offset(self, extent: int) -> int:
        return _PAGE + extent * self._extent_size

    def _header_offset(self, slot: int) -> int:
        """Where ``slot``'s header starts in the file."""
        return self._header_page_offset(slot // _GROUP) + (slot % _GROUP) * _ENTRY

    def _offset(self, slot: int) -> int:
        """Where ``slot``'s payload starts in the file."""
        extent, k = divmod(slot, _GROUP)
        return self._header_page_offset(extent) + _PAGE + k * self._payload_span

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
        """Whether ``payload``'s address suits ``O_DIRECT`` (sizes: `_direct_sizes`)."""
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
        index, writing, free, nbytes = self._index, self._writing, self._free, self._block_nbytes
        for block in blocks:
            block_hash = block.block_hash
            if len(block.payload) != nbytes:
                raise ValueError(
                    f"disk tier {self._name!r}: payload of {len(block.payload)} bytes, a block "
                    f"has {nbytes}"
                )
            if block_hash in index:
                index.move_to_end(block_hash)
                held += 1
                continue
            if block_hash in writing:
                continue
            slot = free.pop() if free else self._take_slot()
            if slot is None:
                continue
            writing.add(block_hash)
            jobs.append((block, slot))
        if not jobs:
            return held
        jobs.sort(key=_slot_of)  # consecutive slots go in one pwritev
        written = 0
        try:
            # Handed over in a box the call empties: an idle worker thread keeps its last
            # call's arguments, and must not keep the caller's buffers exported.
            written = await self._threads.run(self._write_sync, [list(jobs)])
        finally:
            writing.difference_update([block.block_hash for block, _ in jobs])
            if self._closed:
                written = 0
            index.update((block.block_hash, slot) for block, slot in jobs[:written])
            for _, slot in jobs[written:]:
                self._release_slot(slot)
        return held + written

    def _runs(self, slots: Sequence[int]) -> list[tuple[int, int]]:
        """Split job positions into runs ``[lo, hi)`` of consecutive slots (one I/O each)."""
        runs: list[tuple[int, int]] = []
        lo = 0
        for k in range(1, len(slots) + 1):
            if (
                k == len(slots)
                or slots[k] != slots[k - 1] + 1
                or slots[k] % _GROUP == 0  # the next extent's header page sits between
                or k - lo >= self._run_max
            ):
                runs.append((lo, k))
                lo = k
        return runs

    def _write_sync(self, box: list[list[tuple[BlockWrite, int]]]) -> int:
        """Write the boxed jobs (sorted by slot): per run of consecutive slots of one
        extent, one ``pwritev`` of the payloads, and the extent's header page (in the same
        call when the run starts the extent, else right after the payloads).

        Returns how many jobs, from the first, were written in full.
        """
        jobs = box.pop()
        self._check_file()
        page = _header_page() if self._persist else None
        pad = self._pad
        written = 0
        for lo, hi in self._runs([slot for _, slot in jobs]):
            first, last = jobs[lo][1], jobs[hi - 1][1]
            # The headers, with the payload checksums in them, in this thread.
            headers = [jobs[k][0].sealed_header() for k in range(lo, hi)]
            for k, header in zip(range(lo, hi), headers, strict=True):
                if len(header) > _ENTRY:
                    raise ValueError(
                        f"disk tier {self._name!r}: header of {len(header)} bytes for slot "
                        f"{jobs[k][1]}; a header takes at most {_ENTRY}"
                    )
            payloads = [jobs[k][0].payload for k in range(lo, hi)]
            buffers: list[memoryview] = []
            for payload in payloads:
                if buffers and pad is not None:
                    buffers.append(pad)
                buffers.append(payload)
            extent = first // _GROUP
            if not self._persist:
                # Without persistence the headers on disk are never read: reads are
                # checked against the image, so only the payloads are written.
                self._stage_headers(first, headers)
                self._write_run(first, last, buffers, payloads, self._offset(first))
                buffers.clear()
                written = hi
                continue
            assert page is not None
            lock = self._page_locks[extent % _LOCKS]
            at = self._header_page_offset(extent)
            if first % _GROUP == 0:
                # The run starts its extent: header page and payloads are adjacent.
                with lock:
                    self._stage_headers(first, headers)
                    self._copy_page(extent, page)
                    self._write_run(first, last, [page, *buffers], payloads, at)
            else:
                # Payloads first: a crash between the two writes leaves old headers over
                # new payloads, which fail their checksum.
                self._write_run(first, last, buffers, payloads, self._offset(first))
                with lock:  # page writes of one extent in order, each with all headers
                    self._stage_headers(first, headers)
                    self._copy_page(extent, page)
                    self._write_run(first, last, [page], payloads, at)
            buffers.clear()
            written = hi
        return written

    def _stage_headers(self, first: int, headers: Sequence[bytes]) -> None:
        """Put ``headers`` (of slots ``first``, ``first + 1``...) in the image."""
        images = self._headers
        at = first * _ENTRY
        for header in headers:
            if len(header) == HEADER_SIZE:
                images[at : at + HEADER_SIZE] = header
            else:
                images[at : at + _ENTRY] = header.ljust(_ENTRY, b"\0")
            at += _ENTRY

    def _copy_page(self, extent: int, page: memoryview) -> None:
        """Copy ``extent``'s header page from the image into ``page`` (under its lock)."""
        page[:] = self._headers[extent * _PAGE : (extent + 1) * _PAGE]

    def _write_run(
        self,
        first: int,
        last: int,
        buffers: list[memoryview],
        payloads: list[memoryview],
        offset: int,
    ) -> None:
        """Write ``buffers`` at ``offset`` in full, or raise `TierError`."""
        want = sum(len(b) for b in buffers)
        try:
            n = self._io(True, buffers, payloads, offset)
            while 0 < n < want:
                # A short write: write the rest, as a careful writer does; on a full file
                # system that call fails with the errno (ENOSPC) that says why. (Through
                # the page cache: the rest need not be aligned for O_DIRECT.)
                more = os.pwritev(self._fd, _skip(buffers, n), offset + n)
                self._buffered_ios += 1
                if more <= 0:
                    break
                n += more
        except OSError as exc:
            self._note_error(exc)
            raise TierError(
                f"disk tier {self._name!r}: write of slots {first}..{last} failed: "
                f"{errno.errorcode.get(exc.errno or 0, exc.errno)} {exc.strerror}"
            ) from exc
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
                f"disk tier {self._name!r}: short write of slots {first}..{last}: {n} of "
                f"{want} bytes"
            )

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
        self, write: bool, buffers: list[memoryview], payloads: list[memoryview], offset: int
    ) -> int:
        """One vectored I/O of ``buffers`` at ``offset``: ``O_DIRECT`` when it can be.

        ``O_DIRECT`` is tried first whenever it is on and the block size is a multiple of
        4 KiB; buffer addresses are only checked when the kernel refuses (``EINVAL``):
        unaligned memory then goes through the page cache for this call, and a file system
        that refuses aligned buffers turns ``O_DIRECT`` off for good.
        """
        call = os.pwritev if write else os.preadv
        if self._dfd >= 0 and self._direct_sizes:
            try:
                n = call(self._dfd, buffers, offset)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                if all(self._direct_ok(p) for p in payloads):
                    # The file system refused aligned O_DIRECT I/O: page cache from now on.
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
        jobs.sort(key=_slot_of)  # consecutive slots come in one preadv
        try:
            reads = await self._threads.run(self._read_sync, [(jobs, into)])
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
        of consecutive slots of one extent. Each read comes with the header the tier
        wrote for its slot (from the image of the header pages)."""
        jobs, into = box.pop()
        scratch = self._scratch
        nbytes = self._block_nbytes
        span = self._payload_span
        images = self._headers
        reads = []
        for lo, hi in self._runs([slot for _, slot in jobs]):
            buffers: list[memoryview] = []
            payloads = []
            for k in range(lo, hi):
                payload = into[jobs[k][0]][:nbytes]
                if buffers and scratch is not None:
                    buffers.append(scratch)
                buffers.append(payload)
                payloads.append(payload)
            first = jobs[lo][1]
            try:
                n = self._io(False, buffers, payloads, self._offset(first))
            except OSError as exc:
                self._note_error(exc)
                raise TierError(
                    f"disk tier {self._name!r}: read of slots {first}..{jobs[hi - 1][1]} "
                    f"failed: {errno.errorcode.get(exc.errno or 0, exc.errno)} "
                    f"{exc.strerror}"
                ) from exc
            finally:
                buffers.clear()
            for k in range(lo, hi):
                got = min(nbytes, max(0, n - (k - lo) * span))
                # The checksum of what just landed, while it is in this core's cache;
                # the manager compares it with the header before publishing.
                payload_checksum = checksum(payloads[k - lo]) if got == nbytes else None
                at = jobs[k][1] * _ENTRY
                reads.append(BlockRead(bytes(images[at : at + HEADER_SIZE]), got, payload_checksum))
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
            "slot_bytes": self._payload_span + _ENTRY,
            "direct_io": self._dfd >= 0,
            "direct_ios": self._direct_ios,
            "buffered_ios": self._buffered_ios,
            "discarded_at_open": self._discarded_at_open,
            "recreated": self._recreated,
            "adopted": self._adopted,
            "enospc_errors": self._enospc,
            "preallocated": self._preallocate,
        }
