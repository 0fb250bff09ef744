"""The data path shared by the copy engines: `BlockMover`.

Engine side: one tensor per layer, ``blocks_first`` ``[N, 2, bs, h, d]`` or ``kv_first``
``[2, N, bs, h, d]``. Host side: `HostKVBuffer`, one contiguous
byte range per CPU block laid out ``[layers, 2, bs, h, d]``. Both are seen through the
same canonical per-layer view ``[blocks, 2, bs*h*d]``.

Both paths move a plan's blocks in **host order** (`host_order()`: the pairs sorted by CPU
block id), because the host side is the one whose blocks are contiguous: walked in order,
it is read or written as one stream, and consecutive CPU ids are one host range.

* **staged** (any device, the CUDA path): a store gathers the blocks of each layer into a
  staging buffer shaped like host blocks (``index_select``, one launch per layer), then
  copies the staging buffer to the host in one copy per run of consecutive CPU block ids.
  A load does the reverse (run copies in, one ``index_copy_`` per layer). ``n`` blocks
  cost ``layers + runs`` launches per chunk, each host copy at least one whole block;
  host order makes the runs as long as the CPU ids allow.
* **segments** (CPU only): one copy per (block, layer, K/V part), straight from source
  to destination, block after block in host order, pieces that are adjacent on both
  sides merged into one (one-layer pages of consecutive blocks, for instance). The
  pieces are one int64 table (`BlockMover.segment_table()`), computed with tensor
  arithmetic, not per piece. A small copy runs one ``memmove`` per piece; a large one
  (`copy_table()` with ``stream=True``) runs the whole table in one call of the optional
  native ``kvoffload._streamcopy`` with streaming (non-temporal) stores, or, shared by
  threads (`SharedCopy`), each thread's chunks, claimed in turn until none is left.
  Measured on a 2-core host (docs/benchmarks.md), what limits a large scattered copy is
  not the scatter or the per-piece dispatch (64 KiB pieces that are contiguous on both
  sides copy no faster than scattered ones, ~0.57 of one ``memmove`` of the same 512 MiB)
  but the kind of store: glibc's ``memmove`` streams only above a size (192 MiB there),
  so a whole copy does and a piece never does, and ordinary stores read each destination
  line before writing it; then the width of the streaming stores (32 bytes where the CPU
  has AVX2), and, on a busy machine, fixed shares that wait for the slowest thread. The
  staged path touches every byte twice (~0.4).
"""

from __future__ import annotations

import bisect
import ctypes
import importlib
import itertools
import threading
import types
from collections import deque
from collections.abc import Sequence
from typing import final

import torch

from kvoffload.errors import InvalidInputError, LayoutMismatchError
from kvoffload.layout import KVLayout
from kvoffload.storage.host_buffer import HostKVBuffer
from kvoffload.transfer.plan import TransferPlan

_streamcopy: types.ModuleType | None
try:  # a native leaf that imports nothing (by name: it has no .py for the layer check)
    _streamcopy = importlib.import_module("kvoffload._streamcopy")
except ImportError:  # built without a C compiler: one memmove per piece
    _streamcopy = None

__all__ = [
    "NATIVE",
    "STREAMING",
    "BlockMover",
    "Segment",
    "SharedCopy",
    "copy_segments",
    "copy_table",
    "cpu_runs",
    "host_order",
    "split_segments",
    "split_table",
    "validate_plan",
]


def _shares(native: object | None) -> bool:
    """Whether ``native`` can run a `SharedCopy` (a build older than it cannot)."""
    return native is not None and hasattr(native, "copy_claim")


NATIVE: bool = _shares(_streamcopy)
"""Whether the optional native copy ``kvoffload._streamcopy`` is built, recently enough to
share a copy between threads (`SharedCopy`); where it is not, they take fixed shares."""

STREAMING: bool = _streamcopy is not None and bool(_streamcopy.STREAMING)
"""Whether `copy_table()` can write with streaming (non-temporal) stores here: the
optional native copy ``kvoffload._streamcopy`` is built and the CPU is x86-64."""

Segment = tuple[int, int, int]
"""``(dst_ptr, src_ptr, nbytes)``: one host-memory copy of the segments path."""

_KINDS = ("store", "load")


def cpu_runs(ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """Split ``ids`` into maximal runs of consecutive values.

    Returns:
        ``(position, first_id, length)`` for each run, in order.
    """
    runs: list[tuple[int, int, int]] = []
    start = 0
    n = len(ids)
    while start < n:
        end = start + 1
        while end < n and ids[end] == ids[end - 1] + 1:
            end += 1
        runs.append((start, ids[start], end - start))
        start = end
    return runs


def host_order(plan: TransferPlan) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``plan``'s ``(gpu_block_ids, cpu_block_ids)``, the pairs sorted by CPU block id.

    Destinations are unique in a valid plan, so the order of its pairs is free: in CPU id
    order the host side is walked as one stream and consecutive ids form runs.
    """
    cpu = plan.cpu_block_ids
    if all(cpu[i] < cpu[i + 1] for i in range(len(cpu) - 1)):
        return tuple(plan.gpu_block_ids), tuple(cpu)
    pairs = sorted(zip(cpu, plan.gpu_block_ids, strict=True))
    return tuple(g for _, g in pairs), tuple(c for c, _ in pairs)


def copy_segments(segments: Sequence[Segment]) -> None:
    """Run host-memory copies, one ``ctypes.memmove`` each (it releases the GIL)."""
    deque(itertools.starmap(ctypes.memmove, segments), maxlen=0)


def copy_table(table: torch.Tensor, *, stream: bool = False) -> None:
    """Run the copies of a segment table (`BlockMover.segment_table()` rows).

    Sources and destinations must not overlap.

    Args:
        table: int64 ``[segments, 3]`` rows of ``(dst_ptr, src_ptr, nbytes)``.
        stream: write with streaming stores, which skip reading each destination line
            before writing it (one pass over memory less) and leave the destination out
            of the cache: for copies larger than the cache. Honoured where `STREAMING`
            is true (one native call for the whole table, the GIL released throughout);
            elsewhere, and by default, one ``ctypes.memmove`` per row.
    """
    if stream and STREAMING and _streamcopy is not None:
        rows = table.contiguous()
        _streamcopy.copy_at(rows.data_ptr(), rows.shape[0])
        return
    copy_segments(table.tolist())


@final
class SharedCopy:
    """One segment table copied by several threads that take chunks of it in turn.

    The table's bytes, in row order, are cut into chunks of ``chunk_bytes``; every thread
    that calls `run()` claims the next chunk from a shared counter, copies it, and claims
    again until none is left (one native call, the GIL released throughout). A thread that
    starts late or loses its core therefore copies less instead of holding the copy up, as
    equal shares fixed up front would. `wait()` returns once every chunk is written,
    whoever wrote it; a thread that calls `run()` after that copies nothing. Needs the
    native copy (`NATIVE`).

    Args:
        table: int64 ``[segments, 3]`` rows of ``(dst_ptr, src_ptr, nbytes)``, sources and
            destinations not overlapping.
        chunk_bytes: bytes per claim.
        stream: write with streaming stores where `STREAMING` (see `copy_table()`).

    Raises:
        RuntimeError: the native copy is not built.
        ValueError: ``chunk_bytes`` is not positive.
    """

    __slots__ = ("_chunk", "_done", "_native", "_state", "_stream", "_table")

    def __init__(self, table: torch.Tensor, *, chunk_bytes: int, stream: bool) -> None:
        if _streamcopy is None or not _shares(_streamcopy):
            raise RuntimeError("SharedCopy needs the native copy kvoffload._streamcopy")
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
        self._native: types.ModuleType = _streamcopy
        self._table = table.contiguous()
        self._chunk = chunk_bytes
        self._stream = stream and STREAMING
        self._state = torch.zeros(2, dtype=torch.int64)  # next chunk to claim, chunks done
        self._done = threading.Event()
        if not self._table.shape[0] or not bool(self._table[:, 2].any()):
            self._done.set()  # nothing to copy: no chunk will ever be the last

    def run(self) -> int:
        """Copy chunks until none is left to claim; return how many this call copied.

        Raises:
            ValueError: a row has a negative size (nothing was copied by this call).
        """
        rows = self._table
        copied, last = self._native.copy_claim(
            rows.data_ptr(), rows.shape[0], self._chunk, self._state.data_ptr(), self._stream
        )
        if last:
            self._done.set()
        return int(copied)

    def wait(self) -> None:
        """Block until every chunk is written (and visible to this thread)."""
        self._done.wait()


def split_table(table: torch.Tensor, parts: int) -> list[torch.Tensor]:
    """Cut a segment table into at most ``parts`` consecutive shares of (nearly) equal bytes.

    A segment that straddles a boundary between shares is cut there, so even a single
    large segment is shared. The shares together copy exactly what ``table`` copies.

    Raises:
        ValueError: ``parts`` is not positive.
    """
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    ends = table[:, 2].cumsum(0).tolist()
    total = ends[-1] if ends else 0
    shares: list[torch.Tensor] = []
    pos = 0  # the first row not wholly given out yet
    head: torch.Tensor | None = None  # what is left of ``table[pos]`` after a cut
    for k in range(1, parts + 1):
        target = total * k // parts
        pieces: list[torch.Tensor] = []
        end = bisect.bisect_right(ends, target, lo=pos)  # table[pos:end] end by target
        if end > pos:
            if head is None:
                pieces.append(table[pos:end])
            else:
                pieces += [head.unsqueeze(0), table[pos + 1 : end]]
            head, pos = None, end
        if pos < len(ends):
            row = table[pos] if head is None else head
            size = int(row[2])
            start = ends[pos] - size  # byte offset where the rest of table[pos] begins
            if target > start:
                cut = target - start
                pieces.append(torch.tensor([[int(row[0]), int(row[1]), cut]], dtype=torch.int64))
                head = torch.tensor(
                    [int(row[0]) + cut, int(row[1]) + cut, size - cut], dtype=torch.int64
                )
        if pieces:
            shares.append(torch.cat(pieces))
    return shares


def split_segments(segments: Sequence[Segment], parts: int) -> list[list[Segment]]:
    """`split_table()` for a list of segments.

    Raises:
        ValueError: ``parts`` is not positive.
    """
    table = torch.tensor(list(segments), dtype=torch.int64).view(-1, 3)
    return [[(d, s, n) for d, s, n in share.tolist()] for share in split_table(table, parts)]


@final
class BlockMover:
    """Moves whole blocks between an engine's per-layer KV tensors and a host buffer.

    Args:
        layout: geometry shared by ``gpu_kv`` and ``host``.
        gpu_kv: one tensor per layer, shaped as ``layout.kind`` says.
        host: the host buffer; its layout must match in everything but ``kind``.

    Raises:
        LayoutMismatchError: the tensors or the host buffer disagree with ``layout``.
    """

    __slots__ = (
        "_elems",
        "_gpu_views",
        "_host_blocks",
        "_host_raw",
        "_layer_bytes",
        "_layout",
        "_num_cpu",
        "_num_gpu",
        "_tensors",
    )

    def __init__(
        self, layout: KVLayout, gpu_kv: Sequence[torch.Tensor], host: HostKVBuffer
    ) -> None:
        self._num_gpu = layout.num_gpu_blocks(gpu_kv)
        hl = host.layout
        mine = (
            layout.num_layers,
            layout.num_kv_heads,
            layout.head_size,
            layout.dtype,
            layout.block_size,
        )
        theirs = (hl.num_layers, hl.num_kv_heads, hl.head_size, hl.dtype, hl.block_size)
        if mine != theirs:
            raise LayoutMismatchError(
                "host buffer layout (layers, heads, head_size, dtype, block_size)="
                f"{theirs} does not match the KV layout {mine}"
            )
        self._layout = layout
        self._num_cpu = host.num_blocks
        self._elems = layout.block_size * layout.num_kv_heads * layout.head_size
        self._layer_bytes = layout.bytes_per_layer_block
        self._tensors = tuple(gpu_kv)
        n = self._num_gpu
        if layout.kind == "blocks_first":
            self._gpu_views = tuple(t.view(n, 2, self._elems) for t in gpu_kv)
        else:
            self._gpu_views = tuple(t.view(2, n, self._elems).transpose(0, 1) for t in gpu_kv)
        # Holding these keeps the host mapping alive while any copy may touch it.
        self._host_raw = host.raw
        self._host_blocks = host.blocks.view(host.num_blocks, layout.num_layers, 2, self._elems)

    @property
    def layout(self) -> KVLayout:
        """The KV layout."""
        return self._layout

    @property
    def device(self) -> torch.device:
        """Device of the engine's KV tensors."""
        return self._tensors[0].device

    @property
    def num_gpu_blocks(self) -> int:
        """Blocks per layer tensor."""
        return self._num_gpu

    @property
    def num_cpu_blocks(self) -> int:
        """Blocks in the host buffer."""
        return self._num_cpu

    def nbytes(self, plan: TransferPlan) -> int:
        """Bytes ``plan`` moves."""
        return plan.num_blocks * self._layout.bytes_per_block

    def validate(self, plan: TransferPlan) -> None:
        """Check a plan against this mover.

        Raises:
            InvalidInputError: unknown kind, unequal lengths, an id out of range, or a destination
                block named twice; the message names the field and the offending value.
        """
        validate_plan(plan, self._num_gpu, self._num_cpu)

    def new_staging(self, num_blocks: int) -> torch.Tensor:
        """A staging buffer for ``num_blocks`` blocks on the KV device, host-block shaped."""
        lay = self._layout
        return torch.empty(
            (num_blocks, lay.num_layers, 2, self._elems), dtype=lay.torch_dtype, device=self.device
        )

    # -- staged path ---------------------------------------------------------------

    def store_staged(
        self,
        gpu_ids: Sequence[int],
        cpu_ids: Sequence[int],
        gpu_index: torch.Tensor,
        staging: torch.Tensor,
        *,
        non_blocking: bool = False,
    ) -> int:
        """Copy blocks ``gpu_ids`` to host blocks ``cpu_ids`` through ``staging``.

        Args:
            gpu_ids: source block ids (at most ``len(staging)``).
            cpu_ids: destination CPU block ids, same length.
            gpu_index: ``gpu_ids`` as an int64 tensor on the KV device.
            staging: from `new_staging()`, at least ``len(gpu_ids)`` blocks.
            non_blocking: issue the device-to-host copies asynchronously (CUDA, pinned).

        Returns:
            The number of copy/kernel launches issued.
        """
        k = len(gpu_ids)
        st = staging[:k]
        for layer, view in enumerate(self._gpu_views):
            torch.index_select(view, 0, gpu_index, out=st[:, layer])
        launches = len(self._gpu_views)
        for pos, first, length in cpu_runs(cpu_ids):
            self._host_blocks[first : first + length].copy_(
                st[pos : pos + length], non_blocking=non_blocking
            )
            launches += 1
        return launches

    def load_staged(
        self,
        gpu_ids: Sequence[int],
        cpu_ids: Sequence[int],
        gpu_index: torch.Tensor,
        staging: torch.Tensor,
        *,
        non_blocking: bool = False,
    ) -> int:
        """Copy host blocks ``cpu_ids`` into blocks ``gpu_ids`` through ``staging``.

        Args:
            gpu_ids: destination block ids (at most ``len(staging)``).
            cpu_ids: source CPU block ids, same length.
            gpu_index: ``gpu_ids`` as an int64 tensor on the KV device.
            staging: from `new_staging()`, at least ``len(gpu_ids)`` blocks.
            non_blocking: issue the host-to-device copies asynchronously (CUDA, pinned).

        Returns:
            The number of copy/kernel launches issued.
        """
        k = len(gpu_ids)
        st = staging[:k]
        launches = 0
        for pos, first, length in cpu_runs(cpu_ids):
            st[pos : pos + length].copy_(
                self._host_blocks[first : first + length], non_blocking=non_blocking
            )
            launches += 1
        for layer, view in enumerate(self._gpu_views):
            view.index_copy_(0, gpu_index, st[:, layer])
        return launches + len(self._gpu_views)

    # -- segments path (CPU) -------------------------------------------------------

    def segments(self, plan: TransferPlan) -> list[Segment]:
        """The host-memory copies that carry out ``plan``, as `Segment` tuples
        (`segment_table()`'s rows).

        Raises:
            LayoutMismatchError: the KV tensors are not CPU tensors.
        """
        return [(d, s, n) for d, s, n in self.segment_table(plan).tolist()]

    def segment_table(self, plan: TransferPlan) -> torch.Tensor:
        """The host-memory copies that carry out ``plan`` (KV tensors must be on CPU).

        In host order (`host_order()`): block after block by CPU id, and within a block
        layer after layer, one segment per layer for ``blocks_first`` and two (K and V)
        for ``kv_first``, so the host side is walked front to back. Neighbouring segments
        that are contiguous on both sides are merged into one. The addresses are computed
        with tensor arithmetic, not per segment in Python.

        Returns:
            An int64 tensor ``[segments, 3]`` of ``(dst_ptr, src_ptr, nbytes)`` rows
            (`copy_table()` runs it).

        Raises:
            LayoutMismatchError: the KV tensors are not CPU tensors.
        """
        if self.device.type != "cpu":
            raise LayoutMismatchError(f"the segments path needs CPU tensors, not {self.device}")
        i64 = torch.int64
        if not plan.num_blocks:
            return torch.empty((0, 3), dtype=i64)
        gpu_ids, cpu_ids = host_order(plan)
        layer_bytes = self._layer_bytes
        bases = [t.data_ptr() for t in self._tensors]
        host_base = self._host_blocks.data_ptr()
        if self._layout.kind == "blocks_first":
            size, gpu_stride = layer_bytes, layer_bytes
            gpu_off = bases
            host_off = [host_base + layer * layer_bytes for layer in range(len(bases))]
        else:  # K and V halves: adjacent in a host block, N blocks apart in a layer tensor
            size = gpu_stride = layer_bytes // 2
            far = self._num_gpu * size
            gpu_off = [b + half * far for b in bases for half in (0, 1)]
            host_off = [host_base + i * size for i in range(2 * len(bases))]
        host = torch.tensor(host_off, dtype=i64) + (
            torch.tensor(cpu_ids, dtype=i64) * self._layout.bytes_per_block
        ).unsqueeze(1)
        gpu = torch.tensor(gpu_off, dtype=i64) + (
            torch.tensor(gpu_ids, dtype=i64) * gpu_stride
        ).unsqueeze(1)
        dst, src = (host, gpu) if plan.kind == "store" else (gpu, host)
        dst, src = dst.flatten(), src.flatten()
        joined = (dst[1:] == dst[:-1] + size) & (src[1:] == src[:-1] + size)
        if bool(joined.any()):
            first = torch.ones(dst.numel(), dtype=torch.bool)
            first[1:] = ~joined
            starts = first.nonzero().flatten()
            sizes = torch.diff(starts, append=torch.tensor([dst.numel()])) * size
            dst, src = dst[starts], src[starts]
        else:
            sizes = torch.full_like(dst, size)
        return torch.stack((dst, src, sizes), dim=1)

    @staticmethod
    def copy_segments(segments: Sequence[Segment]) -> None:
        """Run host-memory copies (`copy_segments()`)."""
        copy_segments(segments)


def validate_plan(plan: TransferPlan, num_gpu_blocks: int, num_cpu_blocks: int | None) -> None:
    """Check ``plan``'s kind, lengths, id ranges and destination uniqueness.

    Args:
        plan: the plan.
        num_gpu_blocks: GPU ids must lie in ``[0, num_gpu_blocks)``.
        num_cpu_blocks: CPU ids must lie in ``[0, num_cpu_blocks)``; ``None`` skips the check.

    Raises:
        InvalidInputError: naming the field and the offending value.
    """
    if plan.kind not in _KINDS:
        raise InvalidInputError(
            f"plan {plan.plan_id}: unknown kind {plan.kind!r} (expected store/load)"
        )
    if len(plan.gpu_block_ids) != len(plan.cpu_block_ids):
        raise InvalidInputError(
            f"plan {plan.plan_id}: {len(plan.gpu_block_ids)} gpu_block_ids but "
            f"{len(plan.cpu_block_ids)} cpu_block_ids"
        )
    for i, g in enumerate(plan.gpu_block_ids):
        if not 0 <= g < num_gpu_blocks:
            raise InvalidInputError(
                f"plan {plan.plan_id}: gpu_block_ids[{i}]={g} out of range [0, {num_gpu_blocks})"
            )
    if num_cpu_blocks is not None:
        for i, c in enumerate(plan.cpu_block_ids):
            if not 0 <= c < num_cpu_blocks:
                raise InvalidInputError(
                    f"plan {plan.plan_id}: cpu_block_ids[{i}]={c} out of range "
                    f"[0, {num_cpu_blocks})"
                )
    dst_name, dst = (
        ("cpu_block_ids", plan.cpu_block_ids)
        if plan.kind == "store"
        else ("gpu_block_ids", plan.gpu_block_ids)
    )
    if len(set(dst)) != len(dst):
        seen: set[int] = set()
        for i, b in enumerate(dst):
            if b in seen:
                raise InvalidInputError(
                    f"plan {plan.plan_id}: {dst_name}[{i}]={b} names a destination block twice"
                )
            seen.add(b)
