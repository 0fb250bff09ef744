"""CudaCopyEngine's control flow on CPU: fake streams and events, real data ops on CPU."""

from __future__ import annotations

import contextlib
import gc
import random
import weakref
from collections.abc import Iterator

import anyio
import pytest
import torch
from transfer_helpers import bits, gpu_block, load_plan, make_layout, random_kv, store_plan

from kvoffload.errors import ClosedError, TransferError
from kvoffload.transfer import (
    BlockMover,
    CompletionPoller,
    CudaCopyEngine,
    TransferStatus,
    TransferTask,
)
from kvoffload.transfer.gather import cpu_runs

pytestmark = pytest.mark.anyio


class SynchronizeCalledError(Exception):
    pass


class FakeEvent:
    def __init__(self, backend: FakeBackend, name: str) -> None:
        self.backend = backend
        self.name = name
        self.fired = backend.auto_fire
        self.error: Exception | None = None

    def record(self, stream: FakeStream | None = None) -> None:
        assert stream is not None
        self.backend.log.append(("record", self.name, stream.name))

    def query(self) -> bool:
        if self.error is not None:
            raise self.error
        return self.fired

    def synchronize(self) -> None:
        raise SynchronizeCalledError(self.name)


class FakeStream:
    def __init__(self, backend: FakeBackend, name: str, priority: int) -> None:
        self.backend = backend
        self.name = name
        self.priority = priority

    def wait_event(self, event: FakeEvent) -> None:
        self.backend.log.append(("wait", self.name, event.name))

    def synchronize(self) -> None:
        raise SynchronizeCalledError(self.name)


class FakeBackend:
    def __init__(self) -> None:
        self.log: list[tuple[str, str, str]] = []
        self.events: list[weakref.ref[FakeEvent]] = []
        self.streams: list[FakeStream] = []
        self.compute = FakeStream(self, "compute", 0)
        self.active = self.compute
        self.auto_fire = False
        self.fail_new_event = False

    def new_stream(self, *, priority: int) -> FakeStream:
        stream = FakeStream(self, f"copy{len(self.streams)}", priority)
        self.streams.append(stream)
        return stream

    def lowest_priority(self) -> int:
        return 0

    def new_event(self) -> FakeEvent:
        if self.fail_new_event:
            raise RuntimeError("CUDA error: out of memory")
        event = FakeEvent(self, f"e{len(self.events)}")
        self.events.append(weakref.ref(event))
        return event

    def current_stream(self) -> FakeStream:
        return self.active

    @contextlib.contextmanager
    def use_stream(self, stream: FakeStream) -> Iterator[None]:
        self.log.append(("enter", stream.name, ""))
        previous, self.active = self.active, stream
        try:
            yield
        finally:
            self.active = previous
            self.log.append(("exit", stream.name, ""))

    def event(self, name: str) -> FakeEvent:
        for ref in self.events:
            e = ref()
            if e is not None and e.name == name:
                return e
        raise LookupError(name)

    def fire_all(self) -> None:
        for ref in self.events:
            e = ref()
            if e is not None:
                e.fired = True


def make_engine(host_factory, *, kind: str = "blocks_first", staging_bytes: int = 1 << 20):
    layout = make_layout(kind=kind)
    kv = random_kv(layout, 16)
    host = host_factory(layout, 16)
    backend = FakeBackend()
    engine = CudaCopyEngine(layout, kv, host, backend=backend, staging_bytes=staging_bytes)
    return layout, kv, host, backend, engine


def test_two_low_priority_copy_streams(host_factory) -> None:
    _, _, _, backend, engine = make_engine(host_factory)
    assert [s.priority for s in backend.streams] == [0, 0]
    assert engine.stream("store") is not engine.stream("load")


def test_store_without_after_records_a_producer_event_on_compute_fm01(host_factory) -> None:
    _, _, _, backend, engine = make_engine(host_factory)
    engine.submit(store_plan([1], [2]))
    store = engine.stream("store")
    assert backend.log == [
        ("record", "e0", "compute"),  # producer: the compute that wrote the block
        ("wait", store.name, "e0"),  # copy stream waits for it before copying
        ("enter", store.name, ""),
        ("exit", store.name, ""),
        ("record", "e1", store.name),  # completion, after the copy
    ]


def test_store_with_after_waits_on_the_given_event(host_factory) -> None:
    _, _, _, backend, engine = make_engine(host_factory)
    produced = backend.new_event()
    engine.submit(store_plan([1], [2]), after=produced)
    store = engine.stream("store")
    assert backend.log[0] == ("wait", store.name, produced.name)
    assert not any(e[0] == "record" and e[2] == "compute" for e in backend.log)


def test_load_waits_for_queued_compute_and_compute_waits_for_it_fm02_fm03(host_factory) -> None:
    _, _, _, backend, engine = make_engine(host_factory)
    backend.log.append(("kernel", "compute", "reader of block 3 / memset of block 3"))
    task = engine.submit(load_plan([3], [0]))
    load = engine.stream("load")
    assert backend.log[:6] == [
        ("kernel", "compute", "reader of block 3 / memset of block 3"),
        ("record", "e0", "compute"),  # after the queued reader and zeroing
        ("wait", load.name, "e0"),  # the load's writes wait for them
        ("enter", load.name, ""),
        ("exit", load.name, ""),
        ("record", "e1", load.name),
    ]
    task.wait_on(backend.compute)
    assert backend.log[-1] == ("wait", "compute", "e1")


def test_launch_failure_returns_a_failed_task(host_factory) -> None:
    _, _, _, backend, engine = make_engine(host_factory)
    backend.fail_new_event = True
    task = engine.submit(store_plan([0], [0]))
    # Not done until delivered: its references are released first, as for every task.
    assert task.status is TransferStatus.PENDING
    assert not task.done()
    seen: list[TransferStatus] = []
    poller = CompletionPoller(lambda t: seen.append(t.status), poll_interval_s=0.0005)
    poller.track(task)
    assert poller.poll() == 1
    assert seen == [TransferStatus.FAILED]
    assert task.status is TransferStatus.FAILED
    err = task.exception()
    assert isinstance(err, TransferError)
    assert "out of memory" in str(err.__cause__)


async def test_cuda_error_at_query_fails_the_task(host_factory) -> None:
    _, _, _, backend, engine = make_engine(host_factory)
    seen: list[TransferStatus] = []
    poller = CompletionPoller(lambda t: seen.append(t.status), poll_interval_s=0.0005)
    task = engine.submit(store_plan([0], [0]))
    backend.event("e1").error = RuntimeError("CUDA error: an illegal memory access")
    async with anyio.create_task_group() as tg:
        await tg.start(poller.run)
        poller.track(task)
        with pytest.raises(TransferError) as info:
            with anyio.fail_after(5):
                await task
        tg.cancel_scope.cancel()
    assert "illegal memory access" in str(info.value.__cause__)
    assert seen == [TransferStatus.FAILED]


@pytest.mark.parametrize("kind", ["blocks_first", "kv_first"])
async def test_round_trip_through_the_staged_path_in_chunks(host_factory, kind) -> None:
    # staging of 3 blocks: a 10-block plan takes 4 chunks
    layout, kv, _host, backend, engine = make_engine(
        host_factory, kind=kind, staging_bytes=3 * make_layout().bytes_per_block
    )
    original = [t.clone() for t in kv]
    backend.auto_fire = True
    rng = random.Random(7)
    g = rng.sample(range(16), 10)
    c = [4, 5, 6, *rng.sample(range(7, 16), 7)]
    poller = CompletionPoller(lambda t: None, poll_interval_s=0.0005)
    async with anyio.create_task_group() as tg:
        await tg.start(poller.run)
        store = engine.submit(store_plan(g, c))
        poller.track(store)
        await store
        for t in kv:
            t.zero_()
        g2 = rng.sample(range(16), 10)
        load = engine.submit(load_plan(g2, c))
        poller.track(load)
        await load
        tg.cancel_scope.cancel()
    for layer in range(layout.num_layers):
        for a, b in zip(g, g2, strict=True):
            assert torch.equal(
                bits(gpu_block(layout, kv, layer, b)), bits(gpu_block(layout, original, layer, a))
            )
    await engine.aclose()


def test_staged_path_costs_layers_plus_runs_launches(host_factory) -> None:
    layout = make_layout(layers=4)
    kv = random_kv(layout, 64)
    host = host_factory(layout, 64)
    mover = BlockMover(layout, kv, host)
    staging = mover.new_staging(64)
    g = list(range(63, -1, -1))
    index = torch.tensor(g)
    assert mover.store_staged(g, list(range(64)), index, staging) == 4 + 1
    scattered = random.Random(1).sample(range(64), 64)
    runs = len(cpu_runs(scattered))
    assert mover.store_staged(g, scattered, index, staging) == 4 + runs
    assert mover.load_staged(g, list(range(64)), index, staging) == 1 + 4


def test_cpu_runs() -> None:
    assert cpu_runs([]) == []
    assert cpu_runs([3, 4, 5, 9, 1, 2]) == [(0, 3, 3), (3, 9, 1), (4, 1, 2)]


async def test_task_holds_its_events_until_completion_fm08(host_factory) -> None:
    _, _, _, backend, engine = make_engine(host_factory)
    task = engine.submit(store_plan([0], [0]))
    gc.collect()
    producer = backend.events[0]
    assert producer() is not None  # only the task references the producer event
    poller = CompletionPoller(lambda t: None, poll_interval_s=0.0005)
    async with anyio.create_task_group() as tg:
        await tg.start(poller.run)
        poller.track(task)
        backend.fire_all()
        with anyio.fail_after(5):
            await task
        tg.cancel_scope.cancel()
    gc.collect()
    assert producer() is None  # released once the copy completed


async def test_never_firing_event_times_out_and_completes_later_fm45(host_factory) -> None:
    _, _, _, backend, engine = make_engine(host_factory)
    released: list[TransferTask] = []
    poller = CompletionPoller(released.append, poll_interval_s=0.0005)
    task = engine.submit(load_plan([1], [1]))
    async with anyio.create_task_group() as tg:
        await tg.start(poller.run)
        poller.track(task)
        with pytest.raises(TimeoutError):
            with anyio.fail_after(0.05):
                await task
        assert released == []
        assert task.status is TransferStatus.RUNNING
        backend.fire_all()
        with anyio.fail_after(5):
            await task
        tg.cancel_scope.cancel()
    assert released == [task]


async def test_aclose_waits_for_events_without_synchronize_fm04_fm10(host_factory) -> None:
    _, _, _, backend, engine = make_engine(host_factory)
    engine.submit(store_plan([0], [0]))
    engine.submit(load_plan([1], [1]))
    order: list[str] = []

    async def fire_later() -> None:
        await anyio.sleep(0.05)
        order.append("fired")
        backend.fire_all()

    async with anyio.create_task_group() as tg:
        tg.start_soon(fire_later)
        with anyio.fail_after(5):
            await engine.aclose()
        order.append("closed")
    assert order == ["fired", "closed"]  # synchronize() would have raised
    assert engine.in_flight() == 0
    with pytest.raises(ClosedError):
        engine.submit(store_plan([0], [0]))
