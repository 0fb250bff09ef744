"""Reads before writes: the gate every tier operation passes."""

from __future__ import annotations

import anyio
import pytest

from kvoffload.tiers.health import PriorityGate

pytestmark = pytest.mark.anyio


async def test_writes_leave_a_slot_for_reads_and_wait_behind_waiting_reads() -> None:
    gate = PriorityGate(2)
    order: list[str] = []
    release = anyio.Event()

    async def op(name: str, read: bool) -> None:
        await gate.acquire(read)
        order.append(name)
        try:
            await release.wait()
        finally:
            gate.release()

    async with anyio.create_task_group() as tg:
        tg.start_soon(op, "w1", False)
        await anyio.wait_all_tasks_blocked()
        tg.start_soon(op, "w2", False)  # the last slot is for reads: w2 waits
        await anyio.wait_all_tasks_blocked()
        assert order == ["w1"]
        tg.start_soon(op, "r1", True)
        await anyio.wait_all_tasks_blocked()
        assert order == ["w1", "r1"]
        tg.start_soon(op, "r2", True)  # full: r2 waits, and w2 must not pass it
        await anyio.wait_all_tasks_blocked()
        release.set()
    assert order.index("r2") < order.index("w2")


async def test_cancelled_waiter_leaves_no_trace() -> None:
    gate = PriorityGate(1)
    await gate.acquire(True)
    with anyio.move_on_after(0.01):
        await gate.acquire(True)
    gate.release()
    with anyio.fail_after(1):
        await gate.acquire(False)  # nothing counts as a waiting read any more
    gate.release()
