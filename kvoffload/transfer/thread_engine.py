"""Copies between CPU "device" tensors and the host buffer in worker threads.

`ThreadCopyEngine` has the semantics of `CudaCopyEngine`
without a GPU: one worker thread per direction plays the part of one CUDA stream (copies
in one direction run in submission order), and a ``concurrent.futures.Future`` plays the
part of the completion event. The copy itself releases the GIL, so the event loop keeps
running while bytes move.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Literal, final

import anyio.to_thread
import torch

from kvoffload._logging import get_logger
from kvoffload.errors import InputTypeError, LayoutMismatchError
from kvoffload.layout import KVLayout
from kvoffload.storage.host_buffer import HostKVBuffer
from kvoffload.transfer.engine import _EngineBase, _InFlight, check_open
from kvoffload.transfer.gather import (
    NATIVE,
    STREAMING,
    BlockMover,
    SharedCopy,
    copy_table,
    host_order,
    split_table,
)
from kvoffload.transfer.plan import TransferPlan
from kvoffload.transfer.task import TransferTask

__all__ = ["CopyHook", "ThreadCopyEngine"]

_log = get_logger("transfer.thread")

_PARALLEL_MIN_BYTES = 4 << 20
"""Copies smaller than this run on the worker alone (splitting costs more than it gains)."""

_STREAM_MIN_BYTES = 16 << 20
"""Copies of at least this many bytes write with streaming stores where `STREAMING` (the
destination would not stay in the cache anyway; smaller loads leave it warm for compute)."""

_CHUNK_BYTES = 1 << 20
"""Bytes a thread claims at a time in a shared copy (`SharedCopy`): small enough that a
thread which loses its core mid-chunk holds the copy up little, large enough that a claim
costs nothing against it (16 µs of copying at 64 GB/s)."""

CopyHook = Callable[[TransferPlan], None]
"""Runs in the worker thread right before a copy; raising fails that copy (fault injection,
slowed copies in tests)."""


@final
class _FutureCompletion:
    """Completion handle over a worker future; also knows when the copy ended."""

    __slots__ = ("_future",)

    def __init__(self, future: Future[float]) -> None:
        self._future = future

    def query(self) -> bool:
        return self._future.done()

    def error(self) -> BaseException | None:
        return self._future.exception(timeout=0)

    def notify_on_done(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (on the worker thread, or now if done) when the copy ends."""
        self._future.add_done_callback(lambda _future: callback())

    def finished_at(self) -> float | None:
        if not self._future.done() or self._future.exception(timeout=0) is not None:
            return None
        return self._future.result(timeout=0)


@final
class ThreadCopyEngine(_EngineBase):
    """A `CopyEngine` for CPU tensors, copying in worker threads.

    Args:
        layout: the KV layout.
        gpu_kv: the engine's per-layer KV tensors (CPU tensors).
        host: the host buffer.
        strategy: ``"segments"`` (default; direct copies per block and layer in host
            order, fastest on CPU; from 16 MiB on native batches with streaming stores
            where `STREAMING`) or ``"staged"`` (the CUDA engine's gather/scatter
            through a staging buffer).
        staging_blocks: staging capacity in blocks for ``"staged"``.
        copy_hook: run in the worker before each copy; an exception fails the copy.
        poll_interval_s: how often `aclose()` checks for in-flight copies.
        copy_threads: threads that share one ``"segments"`` copy of at least
            ``_PARALLEL_MIN_BYTES`` (default: torch's intra-op thread count, at most 8);
            one core rarely saturates memory bandwidth. With the native copy each thread
            claims chunks of ``_CHUNK_BYTES`` in host order until none is left, so a
            thread that gets no core copies less; without it each copies one consecutive
            host range of equal bytes.

    Raises:
        LayoutMismatchError: tensors or host buffer disagree with ``layout``, or the KV
            tensors are not on the CPU.
        ValueError: ``staging_blocks`` or ``copy_threads`` is not positive.
    """

    __slots__ = (
        "_copy_hook",
        "_copy_threads",
        "_helpers",
        "_staging",
        "_staging_blocks",
        "_strategy",
        "_workers",
    )

    def __init__(
        self,
        layout: KVLayout,
        gpu_kv: Sequence[torch.Tensor],
        host: HostKVBuffer,
        *,
        strategy: Literal["segments", "staged"] = "segments",
        staging_blocks: int = 64,
        copy_hook: CopyHook | None = None,
        poll_interval_s: float = 0.0005,
        copy_threads: int | None = None,
    ) -> None:
        if staging_blocks < 1:
            raise ValueError(f"staging_blocks must be >= 1, got {staging_blocks}")
        if copy_threads is None:
            copy_threads = min(8, max(1, torch.get_num_threads()))
        if copy_threads < 1:
            raise ValueError(f"copy_threads must be >= 1, got {copy_threads}")
        if gpu_kv and gpu_kv[0].device.type != "cpu":
            raise LayoutMismatchError(
                f"ThreadCopyEngine needs CPU tensors, got {gpu_kv[0].device}; "
                "use CudaCopyEngine for CUDA tensors"
            )
        self._mover = BlockMover(layout, gpu_kv, host)
        self._strategy = strategy
        self._staging_blocks = staging_blocks
        self._staging: dict[str, torch.Tensor] = {}
        self._copy_hook = copy_hook
        self._workers = {
            kind: ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"kvoffload-{kind}")
            for kind in ("store", "load")
        }
        self._copy_threads = copy_threads
        # Helpers for the other parts of a split copy (the worker copies one part itself).
        self._helpers = (
            ThreadPoolExecutor(max_workers=copy_threads - 1, thread_name_prefix="kvoffload-copy")
            if copy_threads > 1
            else None
        )
        self._in_flight = _InFlight(poll_interval_s)
        self._closed = False

    def submit(self, plan: TransferPlan, *, after: object | None = None) -> TransferTask:
        """Queue the copy on its direction's worker; return the running task.

        Args:
            plan: store or load plan.
            after: ``None``, or a ``threading.Event`` / ``concurrent.futures.Future`` the
                worker waits for before copying (the producer of a store's data).

        Returns:
            The task; ``FAILED`` already if the worker could not take the copy.

        Raises:
            InvalidInputError: the plan is malformed.
            InputTypeError: ``after`` is of an unsupported type (nothing was started).
            ClosedError: the engine was closed.
        """
        check_open(self._closed, "ThreadCopyEngine")
        self._mover.validate(plan)
        if after is not None and not isinstance(after, threading.Event | Future):
            raise InputTypeError(
                f"after must be None, a threading.Event or a Future, got {type(after).__name__}"
            )
        nbytes = self._mover.nbytes(plan)
        try:
            future = self._workers[plan.kind].submit(self._copy, plan, after)
        except RuntimeError as exc:  # executor shut down under us
            return TransferTask._failed_launch(plan, nbytes, exc)
        handle = _FutureCompletion(future)
        self._in_flight.add(handle)
        task: TransferTask = TransferTask._create(
            plan,
            nbytes=nbytes,
            completion=handle,
            queue=self._workers[plan.kind],
            keepalive=(self._mover, future),
        )
        return task

    def _copy(self, plan: TransferPlan, after: threading.Event | Future[object] | None) -> float:
        """Worker thread: wait for the producer, run the hook, move the bytes."""
        if isinstance(after, threading.Event):
            after.wait()
        elif after is not None:
            after.result()
        if self._copy_hook is not None:
            self._copy_hook(plan)
        mover = self._mover
        if self._strategy == "segments":
            self._copy_segments(plan)
        else:
            staging = self._staging.get(plan.kind)
            if staging is None:
                staging = self._staging[plan.kind] = mover.new_staging(self._staging_blocks)
            cap = self._staging_blocks
            move = mover.store_staged if plan.kind == "store" else mover.load_staged
            all_gpu, all_cpu = host_order(plan)
            for i in range(0, plan.num_blocks, cap):
                gpu_ids = all_gpu[i : i + cap]
                index = torch.tensor(gpu_ids, dtype=torch.int64)
                move(gpu_ids, all_cpu[i : i + cap], index, staging)
        return time.perf_counter()

    def _copy_segments(self, plan: TransferPlan) -> None:
        """Copy on this worker, written with streaming stores (`copy_table()`) from
        ``_STREAM_MIN_BYTES`` on. A copy of at least ``_PARALLEL_MIN_BYTES`` is shared
        with the helpers: with the native copy, every thread claims chunks of
        ``_CHUNK_BYTES`` in host order until none is left (`SharedCopy`), the worker
        among them, so a helper that starts late or loses its core copies less instead
        of holding the copy up; without it, the table is cut by bytes into consecutive
        host ranges (`split_table()`), one per thread, the worker copying the first."""
        mover = self._mover
        table = mover.segment_table(plan)
        helpers = self._helpers
        nbytes = mover.nbytes(plan)
        stream = STREAMING and nbytes >= _STREAM_MIN_BYTES
        if helpers is None or nbytes < _PARALLEL_MIN_BYTES:
            copy_table(table, stream=stream)
            return
        if NATIVE:
            shared = SharedCopy(table, chunk_bytes=_CHUNK_BYTES, stream=stream)
            for _ in range(self._copy_threads - 1):
                # Not waited for: one that starts after the last chunk was claimed returns
                # at once (it holds ``shared``, so the table outlives it).
                helpers.submit(shared.run)
            shared.run()
            shared.wait()
            return
        shares = split_table(table, self._copy_threads)
        futures = [helpers.submit(copy_table, share, stream=stream) for share in shares[1:]]
        try:
            if shares:
                copy_table(shares[0], stream=stream)
        finally:
            for future in futures:
                future.result()  # waits for every share; re-raises a helper's failure

    async def aclose(self) -> None:
        """Wait (shielded) for in-flight copies, then stop the workers. Idempotent.

        Cancellation cannot interrupt the wait; it is re-raised once the copies ended.
        """
        self._closed = True
        await self._in_flight.wait_all()
        workers = list(self._workers.values())
        if not workers:
            return
        self._workers = {}
        self._staging.clear()

        helpers, self._helpers = self._helpers, None

        def stop() -> None:
            for worker in workers:
                worker.shutdown(wait=True)
            if helpers is not None:
                helpers.shutdown(wait=True)

        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(stop)
        _log.debug("copy_engine_closed", engine="thread")
