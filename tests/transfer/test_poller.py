"""CompletionPoller and awaiting tasks: delivery once, awaiters, cancellation, faults."""

from __future__ import annotations

import asyncio
import threading

import anyio
import pytest
from transfer_helpers import load_plan, make_layout, random_kv, store_plan

from kvoffload.errors import InvariantError, KvOffloadError, TransferError
from kvoffload.storage.host_buffer import HostKVBuffer
from kvoffload.testing import (
    ControllableCopyEngine,
    CopyFaults,
    FaultyCopyEngine,
    TestCompletion,
)
from kvoffload.transfer import CompletionPoller, ThreadCopyEngine, TransferStatus, TransferTask

pytestmark = pytest.mark.anyio


class Recorder:
    """A completion callback that 'releases' blocks and records the order of events."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.released: list[int] = []
        self.delivered = anyio.Event()

    def __call__(self, task: TransferTask) -> None:
        self.events.append(f"complete:{task.plan.plan_id}:{task.status.value}")
        self.released.extend(task.cpu_block_ids)
        self.delivered.set()


async def test_many_awaiters_resume_after_the_single_callback() -> None:
    rec = Recorder()
    poller = CompletionPoller(rec, poll_interval_s=0.0005)
    engine = ControllableCopyEngine()
    task = engine.submit(store_plan([0, 1], [5, 6]))
    results = []

    all_resumed = anyio.Event()

    async def waiter(i: int) -> None:
        results.append(await task)
        rec.events.append(f"resumed:{i}")
        if len(results) == 10:
            all_resumed.set()

    async with anyio.create_task_group() as tg:
        await tg.start(poller.run)
        poller.track(task)
        for i in range(10):
            tg.start_soon(waiter, i)
        await anyio.sleep(0.01)
        assert results == []
        engine.complete(task)
        with anyio.fail_after(5):
            await all_resumed.wait()
        tg.cancel_scope.cancel()
    assert rec.events[0] == f"complete:{task.plan.plan_id}:done"
    assert sum(e.startswith("complete") for e in rec.events) == 1
    assert len({id(r) for r in results}) == 1
    assert rec.released == [5, 6]
    stats = poller.statistics()
    assert (stats.in_flight, stats.completed, stats.failed) == (0, 1, 0)


async def test_completion_without_any_awaiter_fm54() -> None:
    """An idle store completes and is delivered with no further API call."""
    layout = make_layout()
    host = HostKVBuffer(layout, 8, pin_memory="never")
    engine = ThreadCopyEngine(layout, random_kv(layout, 8), host)
    rec = Recorder()
    poller = CompletionPoller(rec, poll_interval_s=0.0005)
    async with anyio.create_task_group() as tg:
        await tg.start(poller.run)
        task = engine.submit(store_plan([1, 2], [3, 4]))
        poller.track(task)
        del task
        with anyio.fail_after(5):
            await rec.delivered.wait()
        tg.cancel_scope.cancel()
    assert rec.released == [3, 4]
    assert rec.events[0].endswith(":done")
    await engine.aclose()
    host.close()


async def test_cancelled_awaiter_cancels_only_the_wait_fm47() -> None:
    rec = Recorder()
    poller = CompletionPoller(rec, poll_interval_s=0.0005)
    engine = ControllableCopyEngine()
    task = engine.submit(load_plan([0], [1]))
    async with anyio.create_task_group() as tg:
        await tg.start(poller.run)
        poller.track(task)
        with anyio.CancelScope() as scope:
            scope.cancel()
            await task
        assert scope.cancelled_caught
        with anyio.move_on_after(0.02) as scope2:
            await task
        assert scope2.cancelled_caught
        assert task.status is TransferStatus.RUNNING
        assert rec.released == []  # blocks stay referenced while the copy runs
        assert engine.pending == [task]
        engine.complete(task)
        with anyio.fail_after(5):
            result = await task
        tg.cancel_scope.cancel()
    assert result.num_blocks == 1
    assert rec.events == [f"complete:{task.plan.plan_id}:done"]
    assert rec.released == [1]


async def test_timeout_on_copy_that_never_completes_leaves_it_pending_fm45() -> None:
    rec = Recorder()
    poller = CompletionPoller(rec, poll_interval_s=0.0005)
    engine = ControllableCopyEngine()
    task = engine.submit(load_plan([2, 3], [4, 5]))
    async with anyio.create_task_group() as tg:
        await tg.start(poller.run)
        poller.track(task)
        with pytest.raises(TimeoutError):
            with anyio.fail_after(0.05):
                await task
        assert task.status is TransferStatus.RUNNING
        assert poller.in_flight == 1
        assert rec.released == []  # quarantined: not released on timeout
        engine.complete(task)  # the event is observed later: now release
        with anyio.fail_after(5):
            await rec.delivered.wait()
        tg.cancel_scope.cancel()
    assert rec.released == [4, 5]


async def test_asyncio_task_cancel_of_awaiter(anyio_backend: str) -> None:
    if anyio_backend != "asyncio":
        pytest.skip("asyncio.Task.cancel is asyncio only")
    rec = Recorder()
    poller = CompletionPoller(rec, poll_interval_s=0.0005)
    engine = ControllableCopyEngine()
    task = engine.submit(store_plan([0], [0]))
    async with anyio.create_task_group() as tg:
        await tg.start(poller.run)
        poller.track(task)
        waiter = asyncio.ensure_future(task._wait())
        await anyio.sleep(0.01)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        engine.complete(task)
        with anyio.fail_after(5):
            await rec.delivered.wait()
        tg.cancel_scope.cancel()
    assert task.status is TransferStatus.DONE
    assert rec.released == [0]


async def test_copy_failure_fails_the_task_and_the_next_copy_succeeds() -> None:
    layout = make_layout()
    host = HostKVBuffer(layout, 8, pin_memory="never")
    faults = CopyFaults(fail_copies={0})
    engine = ThreadCopyEngine(layout, random_kv(layout, 8), host, copy_hook=faults)
    rec = Recorder()
    poller = CompletionPoller(rec, poll_interval_s=0.0005)
    async with anyio.create_task_group() as tg:
        await tg.start(poller.run)
        bad = engine.submit(store_plan([0], [0]))
        good = engine.submit(store_plan([1], [1]))
        poller.track(bad)
        poller.track(good)
        with pytest.raises(TransferError) as info:
            await bad
        assert isinstance(info.value.__cause__, RuntimeError)
        assert "injected copy failure 0" in str(info.value.__cause__)
        assert (await good).num_blocks == 1
        tg.cancel_scope.cancel()
    assert rec.events == [
        f"complete:{bad.plan.plan_id}:failed",
        f"complete:{good.plan.plan_id}:done",
    ]
    assert poller.statistics().failed == 1
    await engine.aclose()
    host.close()


async def test_launch_failure_is_delivered_and_raises_fm40() -> None:
    rec = Recorder()
    poller = CompletionPoller(rec, poll_interval_s=0.0005)
    inner = ControllableCopyEngine()
    engine = FaultyCopyEngine(inner, fail_submits={0})
    async with anyio.create_task_group() as tg:
        await tg.start(poller.run)
        task = engine.submit(load_plan([0], [0]))
        assert task.status is TransferStatus.PENDING  # FAILED once delivered
        assert not task.done()
        assert inner.submitted == []
        poller.track(task)
        with pytest.raises(TransferError, match="failed to launch") as info:
            await task
        assert isinstance(info.value.__cause__, RuntimeError)
        second = engine.submit(load_plan([1], [1]))
        assert inner.pending == [second]
        tg.cancel_scope.cancel()
    assert rec.events == [f"complete:{task.plan.plan_id}:failed"]


async def test_abandoned_task_is_delivered_and_awaiting_raises() -> None:
    rec = Recorder()
    poller = CompletionPoller(rec, poll_interval_s=0.0005)
    engine = ControllableCopyEngine()
    task = engine.submit(store_plan([0], [7]))
    async with anyio.create_task_group() as tg:
        await tg.start(poller.run)
        poller.track(task)
        task._abandon()
        await anyio.sleep(0.01)
        assert rec.released == []  # abandoning does not stop or release the copy
        engine.complete(task)
        with pytest.raises(TransferError, match="abandoned"):
            with anyio.fail_after(5):
                await task
        tg.cancel_scope.cancel()
    assert rec.events == [f"complete:{task.plan.plan_id}:abandoned"]
    assert poller.statistics().abandoned == 1


async def test_callback_failure_is_surfaced_and_poller_keeps_going_fm25() -> None:
    seen: list[int] = []

    def on_complete(task: TransferTask) -> None:
        seen.append(task.plan.plan_id)
        if len(seen) == 1:
            raise ValueError("scheduler bug")

    poller = CompletionPoller(on_complete, poll_interval_s=0.0005)
    engine = ControllableCopyEngine()
    first = engine.submit(store_plan([0], [0]))
    second = engine.submit(store_plan([1], [1]))
    poller.check_health()
    async with anyio.create_task_group() as tg:
        await tg.start(poller.run)
        poller.track(first)
        poller.track(second)
        engine.complete_all()
        with anyio.fail_after(5):
            await first  # awaiters still wake
            await second
        tg.cancel_scope.cancel()
    assert seen == [first.plan.plan_id, second.plan.plan_id]
    with pytest.raises(KvOffloadError, match="completion callback failed 1 time") as info:
        poller.check_health()
    assert isinstance(info.value.__cause__, ValueError)
    assert poller.statistics().callback_errors == 1


async def test_poller_stops_at_first_pending_task_of_a_queue() -> None:
    seen: list[str] = []
    poller = CompletionPoller(lambda t: seen.append(t.kind), poll_interval_s=0.0005)
    queue = object()
    handles = [TestCompletion(), TestCompletion()]
    tasks = [
        TransferTask._create(store_plan([i], [i]), nbytes=1, completion=h, queue=queue)
        for i, h in enumerate(handles)
    ]
    for t in tasks:
        poller.track(t)
    handles[1].finish()
    assert poller.poll() == 0
    assert handles[1].query_count == 0  # never looked past the pending head
    handles[0].finish()
    assert poller.poll() == 2
    assert [t.status for t in tasks] == [TransferStatus.DONE, TransferStatus.DONE]
    with pytest.raises(InvariantError, match="already delivered"):
        poller.track(tasks[0])


async def test_track_twice_is_refused() -> None:
    poller = CompletionPoller(lambda t: None, poll_interval_s=0.001)
    task = ControllableCopyEngine().submit(store_plan([0], [0]))
    poller.track(task)
    with pytest.raises(InvariantError, match="already tracked"):
        poller.track(task)


async def test_idle_poller_waits_without_polling_then_wakes_on_track() -> None:
    rec = Recorder()
    poller = CompletionPoller(rec, poll_interval_s=0.0005)
    engine = ControllableCopyEngine()
    async with anyio.create_task_group() as tg:
        await tg.start(poller.run)
        await anyio.sleep(0.01)
        polls = poller.statistics().polls
        await anyio.sleep(0.05)
        assert poller.statistics().polls == polls  # idle: no busy loop
        task = engine.submit(store_plan([0], [0]))
        engine.complete(task)
        poller.track(task)
        with anyio.fail_after(5):
            await task
        assert poller.statistics().polls > polls
        with pytest.raises(InvariantError, match="already running"):
            await poller.run()
        tg.cancel_scope.cancel()


async def test_drain_waits_for_in_flight_and_cancelling_it_loses_nothing() -> None:
    rec = Recorder()
    poller = CompletionPoller(rec, poll_interval_s=0.0005)
    engine = ControllableCopyEngine()
    tasks = [engine.submit(store_plan([i], [i])) for i in range(3)]
    async with anyio.create_task_group() as tg:
        await tg.start(poller.run)
        for t in tasks:
            poller.track(t)
        with anyio.move_on_after(0.02) as scope:
            await poller.drain()
        assert scope.cancelled_caught
        assert poller.in_flight == 3
        engine.complete(0)

        async def finish_rest() -> None:
            await anyio.sleep(0.02)
            engine.complete_all()

        tg.start_soon(finish_rest)
        with anyio.fail_after(5):
            await poller.drain()
        assert poller.in_flight == 0
        tg.cancel_scope.cancel()
    assert sorted(rec.released) == [0, 1, 2]


async def test_cancelling_the_poller_keeps_tasks_for_a_later_run() -> None:
    rec = Recorder()
    poller = CompletionPoller(rec, poll_interval_s=0.0005)
    engine = ControllableCopyEngine()
    task = engine.submit(store_plan([0], [0]))
    async with anyio.create_task_group() as tg:
        await tg.start(poller.run)
        poller.track(task)
        await anyio.sleep(0.01)
        tg.cancel_scope.cancel()
    engine.complete(task)
    assert task.status is TransferStatus.RUNNING
    async with anyio.create_task_group() as tg:
        await tg.start(poller.run)
        with anyio.fail_after(5):
            await task
        tg.cancel_scope.cancel()
    assert rec.released == [0]


async def test_engine_aclose_waits_for_gated_copy_fm04() -> None:
    layout = make_layout()
    host = HostKVBuffer(layout, 4, pin_memory="never")
    gate = threading.Event()
    engine = ThreadCopyEngine(layout, random_kv(layout, 4), host, copy_hook=CopyFaults(gate=gate))
    task = engine.submit(store_plan([0], [0]))
    order: list[str] = []

    async def opener() -> None:
        await anyio.sleep(0.05)
        order.append("gate_opened")
        gate.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(opener)
        with anyio.CancelScope() as scope:
            scope.cancel()  # cancellation cannot cut the shielded wait short
            await engine.aclose()
        order.append("closed")
    assert order == ["gate_opened", "closed"]
    assert task._completion is not None
    assert task._completion.query()
    assert engine.closed
    host.close()  # safe now: nothing in flight
    await engine.aclose()  # idempotent
    with pytest.raises(Exception, match="closed"):
        engine.submit(store_plan([0], [0]))
