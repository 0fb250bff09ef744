"""`DiskFile`: the one file a disk tier owns, and whether it is still the tier's own.

It opens or creates the file, takes its exclusive lock (one tier per file, in this process
or another), decides whether an existing file is reused, adopted or initialised, and never
truncates a file it did not create that is not a disk tier file. It remembers the file's
identity (device and inode), so a file removed or replaced under a running tier is noticed,
and whether a write ran out of space, so the tier stays read-only until a slot fits again.
Its methods block: the tier calls them in worker threads.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path
from typing import final

from kvoffload._logging import get_logger
from kvoffload.errors import TierError
from kvoffload.tiers.disk_layout import PAGE, SUPER_MAGIC, DiskLayout

__all__ = ["DiskFile", "errno_name"]

_log = get_logger("tiers.disk")


def errno_name(exc: OSError) -> str:
    """``"ENOSPC"`` and the like for ``exc`` (its number when it has no name)."""
    return str(errno.errorcode.get(exc.errno or 0, exc.errno))


@final
class DiskFile:
    """The file of one disk tier: its descriptors, identity, ownership and space.

    Args:
        path: the file (its directory must exist).
        layout: the file's geometry.
        name: the tier's name, for errors and logs.
        persist: a persisted file of this geometry and namespace is reused at `open()`.
        direct_io: open a second descriptor with ``O_DIRECT`` where the file system allows.
        preallocate: reserve the whole file when it is initialised (else it is sparse).
    """

    __slots__ = (
        "_name",
        "_persist",
        "_preallocate",
        "_want_direct",
        "dfd",
        "enospc",
        "fd",
        "file_ok",
        "full",
        "identity",
        "layout",
        "owned",
        "path",
    )

    def __init__(
        self,
        path: Path,
        layout: DiskLayout,
        *,
        name: str,
        persist: bool,
        direct_io: bool,
        preallocate: bool,
    ) -> None:
        self.path = path
        self.layout = layout
        self._name = name
        self._persist = persist
        self._want_direct = direct_io
        self._preallocate = preallocate
        self.fd = -1
        self.dfd = -1  # the O_DIRECT descriptor, -1 when O_DIRECT is off
        self.identity: tuple[int, int] | None = None
        self.owned = False  # the file is one this tier created or initialised
        self.file_ok = True  # the last check found the file still ours
        self.full = False  # a write ran out of space and no slot was seen to fit since
        self.enospc = 0

    def open(self, recover: bool = False) -> bool:
        """Open the file, lock it, and reuse, adopt or initialise it; whether it is reused.

        A file this call creates, an empty one, or (at a first open) one that starts with
        a disk tier's superblock is initialised (truncated and preallocated); a persisted
        file of this geometry and namespace is reused. When ``recover`` (the path was
        removed or replaced under a running tier), only a file this call creates is
        initialised: one of this geometry and namespace is adopted as it is, anything else
        is refused, untouched.

        Raises:
            TierError: the file cannot be opened, locked or preallocated, or must not be
                touched (the path, errno or reason is named).
        """
        self.close()
        # With no file open its inode number can be reused: nothing at the path is ours.
        self.identity = None
        self.owned = False
        size = self.layout.file_size
        fd, created = self._open_fd()
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
                os.pwrite(fd, self.layout.superblock(), 0)
        except TierError:
            os.close(fd)
            raise
        except OSError as exc:
            os.close(fd)
            raise TierError(
                f"disk tier {self._name!r}: cannot preallocate {size} bytes in {self.path}: "
                f"{errno_name(exc)} {exc.strerror}"
            ) from exc
        st = os.fstat(fd)
        self.fd = fd
        self.identity = (st.st_dev, st.st_ino)
        # Removed at close (without persist) only when this tier initialised it.
        self.owned = not reuse
        if self._want_direct:
            try:
                self.dfd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC | os.O_DIRECT)
            except (OSError, AttributeError) as exc:
                _log.warning(
                    "disk_tier_buffered_io", tier=self._name, path=str(self.path), error=str(exc)
                )
        return reuse

    def _open_fd(self) -> tuple[int, bool]:
        """Open (or create) the file: ``(fd, whether this call created it)``."""
        flags = os.O_RDWR | os.O_CLOEXEC
        try:
            try:
                return os.open(self.path, flags | os.O_CREAT | os.O_EXCL, 0o600), True
            except FileExistsError:
                return os.open(self.path, flags), False
        except OSError as exc:
            raise TierError(
                f"disk tier {self._name!r}: cannot open {self.path}: "
                f"{errno_name(exc)} {exc.strerror}"
            ) from exc

    def _lock(self, fd: int) -> None:
        """Take the file's exclusive lock, or raise `TierError`: one tier per file."""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise TierError(
                    f"disk tier {self._name!r}: {self.path} is in use by another disk tier "
                    "(in this process or another one holds its lock); give each tier its own "
                    "file"
                ) from exc
            raise TierError(
                f"disk tier {self._name!r}: cannot lock {self.path}: "
                f"{errno_name(exc)} {exc.strerror}"
            ) from exc

    def _inspect(self, fd: int, recover: bool) -> bool:
        """Whether an existing file is reused (a persisted file of this geometry and
        namespace); ``False``: initialise it. Raises `TierError` for a file that must
        not be touched."""
        st = os.fstat(fd)
        head = os.pread(fd, PAGE, 0)
        size = self.layout.file_size
        ours = st.st_size == size and head == self.layout.superblock()
        if recover:
            if ours:
                return True
            why = (
                "it is not a disk tier file"
                if not head.startswith(SUPER_MAGIC)
                else f"{st.st_size} bytes, this tier's file has {size}"
                if st.st_size != size
                else "its superblock is of another format, namespace or geometry"
            )
            raise TierError(
                f"disk tier {self._name!r}: {self.path} was replaced by a file this tier "
                f"cannot adopt ({why}); it is left untouched"
            )
        if self._persist and ours:
            return True
        if st.st_size and not head.startswith(SUPER_MAGIC):
            raise TierError(
                f"disk tier {self._name!r}: {self.path} holds {st.st_size} bytes that are not "
                "a disk tier file; refusing to overwrite it (remove it or choose another path)"
            )
        return False

    def header_pages(self) -> Iterator[bytes]:
        """Read the header pages, extent by extent."""
        layout = self.layout
        for extent in range(layout.num_extents):
            yield os.pread(self.fd, PAGE, layout.header_page_offset(extent))

    def close(self) -> None:
        """Close the descriptors (the lock goes with them)."""
        for fd in (self.fd, self.dfd):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.fd = self.dfd = -1

    def remove(self, identity: tuple[int, int] | None) -> None:
        """Unlink the path if it is still the file of ``identity`` (this tier's, closed)."""
        if identity is None:
            return
        with contextlib.suppress(OSError):
            st = os.stat(self.path)
            if (st.st_dev, st.st_ino) == identity:
                os.unlink(self.path)

    def drop_direct(self) -> None:
        """Turn ``O_DIRECT`` off for good (the file system refused aligned I/O)."""
        with contextlib.suppress(OSError):
            os.close(self.dfd)
        self.dfd = -1

    def check(self) -> None:
        """Raise `TierError` when the file was deleted or replaced under the tier."""
        self.file_ok = False
        try:
            st = os.stat(self.path)
        except OSError as exc:
            raise TierError(f"disk tier {self._name!r}: {self.path} is gone: {exc}") from exc
        if self.identity is None or (st.st_dev, st.st_ino) != self.identity:
            raise TierError(f"disk tier {self._name!r}: {self.path} was replaced")
        self.file_ok = True

    def check_space(self) -> None:
        """After a write ran out of space: raise `TierError` until a slot fits again."""
        if not self.full:
            return
        try:
            st = os.statvfs(self.path.parent)
        except OSError as exc:
            raise TierError(f"disk tier {self._name!r}: statvfs failed: {exc}") from exc
        free = st.f_bavail * st.f_frsize
        need = self.layout.slot_size
        if free < need:
            raise TierError(
                f"disk tier {self._name!r}: ENOSPC: {free} bytes free on the file system "
                f"of {self.path}, a slot needs {need}"
            )
        self.full = False
        _log.info("disk_tier_space_again", tier=self._name, free_bytes=free)

    def reads_ok(self) -> bool:
        """Whether only writes fail: the file system is full, the file still ours."""
        return self.full and self.file_ok and self.fd >= 0

    def note_error(self, exc: OSError) -> None:
        """Count and log a failed I/O (``ENOSPC`` or ``EDQUOT``: the file system is full)."""
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            self.note_full()
        _log.warning(
            "disk_tier_io_error",
            tier=self._name,
            path=str(self.path),
            errno=errno_name(exc),
            error=exc.strerror,
        )

    def note_full(self) -> None:
        """A write ran out of space."""
        self.enospc += 1
        self.full = True
