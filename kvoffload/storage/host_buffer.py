"""The host memory behind the CPU blocks.

One anonymous memory mapping of exactly ``num_blocks * layout.bytes_per_block`` bytes
(page aligned, no power-of-two rounding), one contiguous byte range per block, laid out as
``[num_layers, 2, block_size, num_kv_heads, head_size]`` in the layout's dtype. When pinned,
it is registered with CUDA in chunks of at most ``pin_chunk_bytes`` (never one giant
registration), and unregistered on `HostKVBuffer.close()`.
"""

from __future__ import annotations

import mmap
import os
from typing import Literal, Protocol, final

import anyio.to_thread
import torch

from kvoffload._logging import get_logger
from kvoffload.errors import ClosedError, ForkedProcessError, HostMemoryError, InvalidInputError
from kvoffload.layout import KVLayout

__all__ = [
    "CudaHostRegistrar",
    "HostKVBuffer",
    "HostRegistrar",
    "available_host_memory",
    "pin_chunk_ranges",
]

_log = get_logger("storage")
_warned_pageable = False
_MAX_CHUNK = 256 << 30


class HostRegistrar(Protocol):
    """Pins and unpins host memory ranges (``cudaHostRegister`` in production)."""

    def register(self, ptr: int, nbytes: int) -> None:
        """Pin ``[ptr, ptr + nbytes)``; raise on failure."""

    def unregister(self, ptr: int) -> None:
        """Unpin the range registered at ``ptr``."""


@final
class CudaHostRegistrar:
    """`HostRegistrar` over ``cudaHostRegister`` / ``cudaHostUnregister``."""

    def register(self, ptr: int, nbytes: int) -> None:
        """Pin a range with ``cudaHostRegister``; raise ``RuntimeError`` with the CUDA error."""
        err = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)  # type: ignore[no-untyped-call]
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister(ptr={ptr:#x}, nbytes={nbytes}) failed: {err}")

    def unregister(self, ptr: int) -> None:
        """Unpin a range with ``cudaHostUnregister``."""
        err = torch.cuda.cudart().cudaHostUnregister(ptr)  # type: ignore[no-untyped-call]
        if int(err) != 0:
            raise RuntimeError(f"cudaHostUnregister(ptr={ptr:#x}) failed: {err}")


def pin_chunk_ranges(
    nbytes: int, chunk_bytes: int, page_size: int = mmap.PAGESIZE
) -> list[tuple[int, int]]:
    """The ``(offset, size)`` registrations that pin ``nbytes`` bytes, in order.

    Each chunk is at most ``chunk_bytes`` rounded down to whole pages (at least one page),
    so every offset is page aligned; together the chunks cover ``[0, nbytes)`` exactly once.

    Raises:
        ValueError: ``nbytes`` is negative, ``page_size`` is below 1, or ``chunk_bytes``
            is outside ``[1, 256 GiB]``.
    """
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    if not 1 <= chunk_bytes <= _MAX_CHUNK:
        raise ValueError(f"pin_chunk_bytes must be in [1, {_MAX_CHUNK}], got {chunk_bytes}")
    chunk = max(page_size, chunk_bytes - chunk_bytes % page_size)
    return [(offset, min(chunk, nbytes - offset)) for offset in range(0, nbytes, chunk)]


def _read_int(path: str, *, field: str | None = None) -> int | None:
    try:
        with open(path, encoding="ascii") as fh:
            text = fh.read()
    except OSError:
        return None
    if field is not None:
        for line in text.splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024  # /proc/meminfo counts kB
        return None
    text = text.strip()
    return int(text) if text.isdigit() else None  # "max" means no limit


def available_host_memory() -> int | None:
    """Bytes this process can still take: the least of ``MemAvailable`` and the cgroup's
    limit minus its usage (v2, then v1); ``None`` where neither can be read."""
    candidates = [_read_int("/proc/meminfo", field="MemAvailable")]
    for limit_path, usage_path in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        (
            "/sys/fs/cgroup/memory/memory.limit_in_bytes",
            "/sys/fs/cgroup/memory/memory.usage_in_bytes",
        ),
    ):
        limit, usage = _read_int(limit_path), _read_int(usage_path)
        if limit is not None and usage is not None and limit < 1 << 60:
            candidates.append(max(0, limit - usage))
            break
    known = [c for c in candidates if c is not None]
    return min(known) if known else None


def _warn_pageable_once(reason: str) -> None:
    global _warned_pageable  # noqa: PLW0603 - one warning per process, by design
    if not _warned_pageable:
        _warned_pageable = True
        _log.warning("host_buffer_pageable", reason=reason)


@final
class HostKVBuffer:
    """Host memory for every CPU block, with typed per-block and per-layer views.

    Args:
        layout: geometry of one block.
        num_blocks: number of CPU blocks.
        pin_memory: ``"auto"`` pins when CUDA is available (or a registrar is given) and
            falls back to pageable memory with one warning; ``"always"`` raises
            `HostMemoryError` instead; ``"never"`` does not pin.
        pin_chunk_bytes: largest single registration (at most 256 GiB).
        registrar: pins the memory; defaults to CUDA's when CUDA is available.

    Raises:
        HostMemoryError: the mapping could not be made, or pinning failed with
            ``pin_memory="always"`` (chunks pinned before the failure are unpinned).
        ValueError: ``num_blocks`` or ``pin_chunk_bytes`` out of range.

    Allocating gigabytes takes time: from async code use `create()`, which runs
    this constructor in a worker thread.
    """

    __slots__ = (
        "_blocks",
        "_closed",
        "_layout",
        "_mmap",
        "_num_blocks",
        "_pid",
        "_raw",
        "_registered",
        "_registrar",
    )

    def __init__(
        self,
        layout: KVLayout,
        num_blocks: int,
        *,
        pin_memory: Literal["auto", "always", "never"] = "auto",
        pin_chunk_bytes: int = 1 << 30,
        registrar: HostRegistrar | None = None,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if not 1 <= pin_chunk_bytes <= _MAX_CHUNK:
            raise ValueError(f"pin_chunk_bytes must be in [1, {_MAX_CHUNK}], got {pin_chunk_bytes}")
        self._layout = layout
        self._num_blocks = num_blocks
        self._pid = os.getpid()
        self._closed = False
        self._registered: list[int] = []
        nbytes = num_blocks * layout.bytes_per_block
        available = available_host_memory()
        if available is not None and nbytes > available:
            raise HostMemoryError(
                f"a host buffer of {nbytes} bytes ({num_blocks} blocks of "
                f"{layout.bytes_per_block}) exceeds the {available} bytes this process can "
                "still use (MemAvailable and the cgroup limit); lower num_cpu_blocks or "
                "cpu_bytes, and count every rank that shares the host"
            )
        try:
            self._mmap: mmap.mmap | None = mmap.mmap(-1, nbytes)
        except (OSError, ValueError) as exc:
            raise HostMemoryError(f"could not map {nbytes} bytes of host memory: {exc}") from exc
        self._raw = torch.frombuffer(self._mmap, dtype=torch.uint8)
        self._blocks = self._raw.view(layout.torch_dtype).view(
            num_blocks, layout.num_layers, *layout.block_shape
        )
        if registrar is None and pin_memory != "never" and torch.cuda.is_available():
            registrar = CudaHostRegistrar()
        self._registrar = registrar
        if pin_memory == "never":
            return
        if registrar is None:
            if pin_memory == "always":
                self.close()
                raise HostMemoryError("pin_memory='always' but CUDA is not available")
            _log.debug("host_buffer_pageable", reason="cuda_unavailable")
            return
        # Page aligned chunks: a registration never shares a page with the next one.
        base = self._raw.data_ptr()
        for offset, size in pin_chunk_ranges(nbytes, pin_chunk_bytes):
            try:
                registrar.register(base + offset, size)
            except Exception as exc:
                pinned = len(self._registered)
                self._unregister_all()
                if pin_memory == "always":
                    self.close()
                    raise HostMemoryError(
                        f"pinning chunk {pinned} ({size} bytes at offset {offset}) of a "
                        f"{nbytes}-byte host buffer failed: {exc}; chunks 0..{pinned - 1} "
                        "were unpinned"
                    ) from exc
                _warn_pageable_once(f"pinning chunk {pinned} failed: {exc}")
                return
            self._registered.append(base + offset)

    @classmethod
    async def create(
        cls,
        layout: KVLayout,
        num_blocks: int,
        *,
        pin_memory: Literal["auto", "always", "never"] = "auto",
        pin_chunk_bytes: int = 1 << 30,
        registrar: HostRegistrar | None = None,
    ) -> HostKVBuffer:
        """Build a buffer in a worker thread, keeping the event loop free.

        Cancellation: the worker thread cannot be interrupted, so the call waits for it
        and returns the buffer; the cancellation takes effect at the caller's next
        checkpoint, and the caller, which owns the buffer, closes it (as `KVOffloader`
        does).
        """

        def build() -> HostKVBuffer:
            return cls(
                layout,
                num_blocks,
                pin_memory=pin_memory,
                pin_chunk_bytes=pin_chunk_bytes,
                registrar=registrar,
            )

        return await anyio.to_thread.run_sync(build)

    def _check(self) -> None:
        if self._closed:
            raise ClosedError("HostKVBuffer is closed")
        if os.getpid() != self._pid:
            raise ForkedProcessError(
                f"HostKVBuffer was created in process {self._pid} and used in forked "
                f"process {os.getpid()}; create a new one in the child"
            )

    @property
    def layout(self) -> KVLayout:
        """The block geometry."""
        return self._layout

    @property
    def num_blocks(self) -> int:
        """Number of CPU blocks."""
        return self._num_blocks

    @property
    def nbytes(self) -> int:
        """Total bytes."""
        return self._num_blocks * self._layout.bytes_per_block

    @property
    def is_pinned(self) -> bool:
        """Whether the whole buffer is registered (page-locked)."""
        return bool(self._registered)

    @property
    def num_pinned_chunks(self) -> int:
        """Number of registrations that pin the buffer."""
        return len(self._registered)

    @property
    def blocks(self) -> torch.Tensor:
        """Typed view ``[num_blocks, num_layers, 2, block_size, heads, head_size]``."""
        self._check()
        return self._blocks

    @property
    def raw(self) -> torch.Tensor:
        """Flat ``uint8`` view of the whole buffer."""
        self._check()
        return self._raw

    def block(self, block_id: int) -> torch.Tensor:
        """Typed view of one block, ``[num_layers, 2, block_size, heads, head_size]``."""
        self._check()
        return self._blocks[block_id]

    def block_bytes(self, block_id: int) -> torch.Tensor:
        """The contiguous ``uint8`` byte range of one block.

        Raises:
            InvalidInputError: ``block_id`` is outside ``[0, num_blocks)``.
        """
        self._check()
        if not 0 <= block_id < self._num_blocks:
            raise InvalidInputError(
                f"block_id {block_id} out of range [0, {self._num_blocks}) of the host buffer"
            )
        size = self._layout.bytes_per_block
        return self._raw[block_id * size : (block_id + 1) * size]

    def layer(self, layer: int) -> torch.Tensor:
        """Strided view of one layer across blocks, ``[num_blocks, 2, block_size, heads, head]``."""
        self._check()
        return self._blocks[:, layer]

    def _unregister_all(self) -> None:
        registrar = self._registrar
        while self._registered and registrar is not None:
            ptr = self._registered.pop()
            try:
                registrar.unregister(ptr)
            except Exception as exc:  # logged; unpinning the rest matters more
                _log.warning("host_unregister_failed", ptr=hex(ptr), error=repr(exc))

    def close(self) -> None:
        """Unpin and drop the memory. Idempotent. The caller must have drained every copy."""
        if self._closed:
            return
        self._closed = True
        self._unregister_all()
        empty = torch.empty(0, dtype=torch.uint8)
        self._raw = empty
        self._blocks = empty
        self._mmap = None  # unmapped when the last view is gone
