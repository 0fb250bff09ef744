"""Copies between CUDA KV tensors and pinned host memory on dedicated streams.

`CudaCopyEngine` owns two low-priority CUDA streams, one per direction.

* A **store** (GPU → CPU) is ordered after the compute that wrote its blocks: it waits on
  the event passed as ``after``, or else on an event recorded on the caller's current
  stream at submit time. It never copies without such a producer dependency.
* A **load** (CPU → GPU) is ordered after the compute stream's earlier work as well (that
  work may still read the destination blocks, or zero them), and records the event that
  compute must wait on: ``task.wait_on(stream)``.

Completion is an event recorded on the copy stream after the copy; the poller queries it.
Streams, events, the current stream and the stream context come from a small
`StreamBackend`, so the control flow is tested on CPU with fakes.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol, final

import torch

from kvoffload._logging import get_logger
from kvoffload.errors import InputTypeError
from kvoffload.layout import KVLayout
from kvoffload.storage.host_buffer import HostKVBuffer
from kvoffload.transfer.engine import _EngineBase, _InFlight, check_open
from kvoffload.transfer.gather import BlockMover, host_order
from kvoffload.transfer.plan import TransferPlan
from kvoffload.transfer.task import TransferTask

__all__ = ["CudaCopyEngine", "EventLike", "StreamBackend", "StreamLike", "TorchCudaBackend"]

_log = get_logger("transfer.cuda")
_DEFAULT_STAGING_BYTES = 256 << 20


class EventLike(Protocol):
    """What the engine uses of ``torch.cuda.Event``."""

    def record(self, stream: Any = None) -> None:
        """Record the event on ``stream``."""
        ...

    def query(self) -> bool:
        """Whether the work before the record has finished; never blocks."""
        ...


class StreamLike(Protocol):
    """What the engine uses of ``torch.cuda.Stream``."""

    def wait_event(self, event: Any) -> None:
        """Make later work on this stream wait for ``event`` (host does not block)."""
        ...


class StreamBackend(Protocol):
    """Creates streams and events and names the current stream (CUDA, or test fakes)."""

    def new_stream(self, *, priority: int) -> StreamLike:
        """A new stream with ``priority``."""
        ...

    def lowest_priority(self) -> int:
        """The priority value that means "least urgent"."""
        ...

    def new_event(self) -> EventLike:
        """A new event (no timing)."""
        ...

    def current_stream(self) -> StreamLike:
        """The caller's current (compute) stream."""
        ...

    def use_stream(self, stream: StreamLike) -> AbstractContextManager[object]:
        """Context in which kernels and copies are issued on ``stream``."""
        ...


def _cuda() -> Any:
    """``torch.cuda``, untyped: its Stream/Event constructors carry no annotations."""
    return torch.cuda


@final
class TorchCudaBackend:
    """`StreamBackend` over ``torch.cuda`` for one device."""

    __slots__ = ("_device",)

    def __init__(self, device: torch.device) -> None:
        self._device = device

    def new_stream(self, *, priority: int) -> StreamLike:
        """A ``torch.cuda.Stream`` on the device."""
        return _cuda().Stream(device=self._device, priority=priority)  # type: ignore[no-any-return]

    def lowest_priority(self) -> int:
        """Numerically largest value of the device's priority range (least urgent)."""
        low, high = _cuda().Stream.priority_range()
        return max(int(low), int(high))

    def new_event(self) -> EventLike:
        """A ``torch.cuda.Event`` without timing."""
        return _cuda().Event()  # type: ignore[no-any-return]

    def current_stream(self) -> StreamLike:
        """``torch.cuda.current_stream(device)``."""
        return torch.cuda.current_stream(self._device)

    def use_stream(self, stream: StreamLike) -> AbstractContextManager[object]:
        """``torch.cuda.stream(stream)``."""
        return torch.cuda.stream(stream)  # type: ignore[arg-type]


@final
class _EventCompletion:
    """Completion handle over a CUDA event; a CUDA error surfaces from ``query()``."""

    __slots__ = ("_event",)

    def __init__(self, event: EventLike) -> None:
        self._event = event

    def query(self) -> bool:
        return bool(self._event.query())

    def error(self) -> BaseException | None:
        return None


@final
class CudaCopyEngine(_EngineBase):
    """A `CopyEngine` on two low-priority CUDA streams.

    A copy of ``n`` blocks gathers (store) or scatters (load) each layer with one index
    kernel through a device staging buffer and moves host data with one copy per run of
    consecutive CPU block ids, in chunks of ``staging_bytes``: ``layers + runs`` launches
    per chunk instead of ``n * layers`` small copies. Blocks go in host order
    (`host_order()`, as on the CPU path), so a plan whose CPU ids are consecutive in any
    order costs one host copy per chunk.

    Args:
        layout: the KV layout.
        gpu_kv: the engine's per-layer KV tensors.
        host: the host buffer (pinned: copies to pageable memory block the host).
        backend: stream/event factory; defaults to `TorchCudaBackend`.
        staging_bytes: device staging memory per direction (at least one block).
        poll_interval_s: how often `aclose()` checks for in-flight copies.

    Raises:
        LayoutMismatchError: tensors or host buffer disagree with ``layout``.
    """

    __slots__ = (
        "_backend",
        "_pinned",
        "_staging",
        "_staging_blocks",
        "_streams",
    )

    def __init__(
        self,
        layout: KVLayout,
        gpu_kv: Sequence[torch.Tensor],
        host: HostKVBuffer,
        *,
        backend: StreamBackend | None = None,
        staging_bytes: int = _DEFAULT_STAGING_BYTES,
        poll_interval_s: float = 0.0005,
    ) -> None:
        self._mover = BlockMover(layout, gpu_kv, host)
        if backend is None:
            backend = TorchCudaBackend(self._mover.device)
        self._backend = backend
        self._pinned = host.is_pinned
        if not self._pinned:
            _log.warning("copy_engine_host_unpinned", nbytes=host.nbytes)
        priority = backend.lowest_priority()
        self._streams: dict[str, StreamLike] = {
            "store": backend.new_stream(priority=priority),
            "load": backend.new_stream(priority=priority),
        }
        self._staging_blocks = max(1, staging_bytes // layout.bytes_per_block)
        self._staging = {
            kind: self._mover.new_staging(self._staging_blocks) for kind in ("store", "load")
        }
        self._in_flight = _InFlight(poll_interval_s)
        self._closed = False

    def stream(self, kind: str) -> StreamLike:
        """The copy stream of ``"store"`` or ``"load"``."""
        return self._streams[kind]

    def submit(self, plan: TransferPlan, *, after: object | None = None) -> TransferTask:
        """Enqueue the copy on its direction's stream; return the running task.

        Args:
            plan: store or load plan.
            after: an event the copy waits on (the producer of a store's blocks, or the
                last reader of a load's destination); ``None`` records one on the current
                stream now.

        Returns:
            The task; ``FAILED`` already (with the CUDA error chained) if launching failed.

        Raises:
            InvalidInputError: the plan is malformed.
            InputTypeError: ``after`` is not an event (nothing was started).
            ClosedError: the engine was closed.
        """
        check_open(self._closed, "CudaCopyEngine")
        self._mover.validate(plan)
        if after is not None and not callable(getattr(after, "query", None)):
            raise InputTypeError(f"after must be None or a CUDA event, got {type(after).__name__}")
        nbytes = self._mover.nbytes(plan)
        backend = self._backend
        stream = self._streams[plan.kind]
        keep: list[object] = [self._mover, stream]
        try:
            producer: Any = after
            if producer is None:
                producer = backend.new_event()
                producer.record(backend.current_stream())
            stream.wait_event(producer)
            keep.append(producer)
            with backend.use_stream(stream):
                self._launch(plan, keep)
            done = backend.new_event()
            done.record(stream)
        except Exception as exc:
            _log.warning(
                "transfer_launch_failed", plan_id=plan.plan_id, kind=plan.kind, error=repr(exc)
            )
            return TransferTask._failed_launch(plan, nbytes, exc)
        keep.append(done)
        handle = _EventCompletion(done)
        self._in_flight.add(handle)

        def wait_on(consumer: object) -> None:
            consumer.wait_event(done)  # type: ignore[attr-defined]

        task: TransferTask = TransferTask._create(
            plan,
            nbytes=nbytes,
            completion=handle,
            queue=stream,
            keepalive=tuple(keep),
            wait_on=wait_on,
        )
        return task

    def _launch(self, plan: TransferPlan, keep: list[object]) -> None:
        """Issue the chunks on the current (copy) stream; keep every tensor they use."""
        mover = self._mover
        device = mover.device
        cap = self._staging_blocks
        staging = self._staging[plan.kind]
        keep.append(staging)
        move = mover.store_staged if plan.kind == "store" else mover.load_staged
        on_cuda = device.type == "cuda"
        all_gpu, all_cpu = host_order(plan)
        for i in range(0, plan.num_blocks, cap):
            gpu_ids = all_gpu[i : i + cap]
            host_index = torch.tensor(gpu_ids, dtype=torch.int64)
            if on_cuda:
                host_index = host_index.pin_memory()
            index = host_index.to(device, non_blocking=True)
            keep.append(host_index)
            keep.append(index)
            move(gpu_ids, all_cpu[i : i + cap], index, staging, non_blocking=True)

    async def aclose(self) -> None:
        """Wait (shielded) until every copy's event fired, then drop streams and staging.

        Idempotent. Never synchronizes on the loop: the wait polls ``event.query()``.
        Cancellation cannot interrupt the wait.
        """
        self._closed = True
        await self._in_flight.wait_all()
        self._staging.clear()
        _log.debug("copy_engine_closed", engine="cuda")
