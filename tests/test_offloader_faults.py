"""KVOffloader under engine faults and bad input: nothing lost, nothing leaked, never bricked.

A pinner that raises, a bad ``after=``, a malformed block table in one request, a scope
cancelled around ``async with`` while a copy runs, finished blocks held on finish.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator, Sequence

import anyio
import anyio.lowlevel
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvoffload.config import KVLayout, OffloadConfig
from kvoffload.errors import BlockTableError, InputTypeError, PinnerError
from kvoffload.offloader import KVOffloader
from kvoffload.storage.host_buffer import HostKVBuffer
from kvoffload.testing import ControllableCopyEngine, CopyFaults
from kvoffload.transfer.thread_engine import ThreadCopyEngine

pytestmark = pytest.mark.anyio

BS = 4
NUM_GPU_BLOCKS = 32


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def make_kv() -> list[torch.Tensor]:
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_size=8, dtype="float16", block_size=BS)
    gen = torch.Generator().manual_seed(0)
    return [
        torch.randn(layout.tensor_shape(NUM_GPU_BLOCKS), generator=gen).half()
        for _ in range(layout.num_layers)
    ]


def config(**overrides: object) -> OffloadConfig:
    values: dict[str, object] = {"block_size": BS, "num_cpu_blocks": 16}
    values.update(overrides)
    return OffloadConfig(**values)


class FlakyPinner:
    """Counts pins; raises from ``pin`` / ``unpin`` while told to."""

    def __init__(self) -> None:
        self.pins: Counter[int] = Counter()
        self.fail_pin = False
        self.fail_unpin = False

    def pin(self, ids: Sequence[int]) -> None:
        if self.fail_pin:
            raise RuntimeError("pin exploded")
        self.pins.update(ids)

    def unpin(self, ids: Sequence[int]) -> None:
        self.pins.subtract(ids)
        if self.fail_unpin:
            raise RuntimeError("unpin exploded")

    @property
    def held(self) -> set[int]:
        return {k for k, v in self.pins.items() if v > 0}


@pytest.fixture
def gate() -> Iterator[threading.Event]:
    event = threading.Event()
    yield event
    event.set()


def engine() -> ControllableCopyEngine:
    return ControllableCopyEngine(num_gpu_blocks=NUM_GPU_BLOCKS, num_cpu_blocks=16)


# -- item 5: the engine's pinner raises -----------------------------------------------------


async def test_pin_failure_undoes_the_store_and_leaks_nothing() -> None:
    pinner = FlakyPinner()
    async with KVOffloader(config(), make_kv(), pinner=pinner) as off:
        hs = off.hash_prompt(list(range(2 * BS)))
        off.update("a", [0, 1], hs, 2 * BS)
        pinner.fail_pin = True
        with pytest.raises(PinnerError, match="pin exploded") as info:
            off.store()
        assert isinstance(info.value.__cause__, RuntimeError)
        off.scheduler.check_invariants()
        assert off.pool.num_free == off.pool.num_blocks
        # Nothing pending: a deferring lookup does not wait for a store that never runs.
        assert off.lookup("q", hs, 2 * BS + 1, allow_defer=True) == 0
        pinner.fail_pin = False
        (task,) = off.store()  # the same blocks, planned again
        await task
        assert all(off.pool.is_cached(h) for h in hs)
        assert not pinner.held


async def test_pin_failure_on_load_keeps_the_hit_pinned() -> None:
    pinner = FlakyPinner()
    async with KVOffloader(config(), make_kv(), pinner=pinner) as off:
        hs = off.hash_prompt(list(range(2 * BS)))
        off.update("a", [0, 1], hs, 2 * BS)
        await off.store()[0]
        off.finish("a")
        hit = off.lookup("b", hs, 2 * BS + 1)
        pinner.fail_pin = True
        with pytest.raises(PinnerError):
            off.load("b", [5, 6], hit)
        pinner.fail_pin = False
        assert all(off.pool.is_cached(h) for h in hs)
        task = off.load("b", [5, 6], hit)
        assert task is not None
        await task
        off.finish("b")
        assert off.pool.num_free == off.pool.num_blocks
        off.scheduler.check_invariants()


async def test_unpin_failure_is_reported_once_and_the_offloader_keeps_working() -> None:
    pinner = FlakyPinner()
    eng = engine()
    async with KVOffloader(config(), make_kv(), copy_engine=eng, pinner=pinner) as off:
        hs = off.hash_prompt(list(range(BS)))
        off.update("a", [0], hs, BS)
        (task,) = off.store()
        pinner.fail_unpin = True
        eng.complete(task)
        await off.drain()
        pinner.fail_unpin = False
        assert off.pool.is_cached(hs[0])  # the completion was recorded
        assert off.pool.num_free == off.pool.num_blocks
        with pytest.raises(PinnerError, match="unpin exploded"):
            off.lookup("b", hs, BS + 1)
        assert off.lookup("b", hs, 2 * BS) == BS  # once only
        off.release("b")
        off.scheduler.check_invariants()


# -- item 3: a bad after= or a bad request does not lose the batch ----------------------------


async def test_bad_after_raises_and_the_next_store_takes_the_whole_batch() -> None:
    async with KVOffloader(config(), make_kv()) as off:
        a = off.hash_prompt(list(range(2 * BS)))
        b = off.hash_prompt(list(range(100, 100 + 3 * BS)))
        off.update("a", [0, 1], a, 2 * BS)
        off.update("b", [2, 3, 4], b, 3 * BS)
        with pytest.raises(InputTypeError, match="after must be"):
            off.store(after="not an event")
        off.scheduler.check_invariants()
        assert off.pool.num_free == off.pool.num_blocks
        (task,) = off.store()
        await task
        assert task.plan.num_blocks == 5
        assert all(off.pool.is_cached(h) for h in a + b)


async def test_one_requests_bad_table_is_refused_alone() -> None:
    async with KVOffloader(config(), make_kv()) as off:
        a = off.hash_prompt(list(range(2 * BS)))
        b = off.hash_prompt(list(range(100, 100 + 2 * BS)))
        off.update("a", [0, 1], a, 2 * BS)
        with pytest.raises(BlockTableError, match=r"'b'.*out of range \[0, 32\)"):
            off.update("b", [2, NUM_GPU_BLOCKS], b, 2 * BS)
        with pytest.raises(BlockTableError, match="appears twice"):
            off.update("b", [3, 3], b, 2 * BS)
        (task,) = off.store()
        await task
        assert all(off.pool.is_cached(h) for h in a)


# -- item 6: cancelling the scope around the offloader ----------------------------------------


async def test_cancelled_scope_around_the_offloader_exits_when_the_copy_ends(
    gate: threading.Event,
) -> None:
    kv = make_kv()
    layout = KVLayout.from_tensors(kv, block_size=BS)
    host = HostKVBuffer(layout, 16, pin_memory="never")
    eng = ThreadCopyEngine(layout, kv, host, copy_hook=CopyFaults(gate=gate))
    off = KVOffloader(config(), kv, copy_engine=eng)
    timer = threading.Timer(0.1, gate.set)
    try:
        with anyio.fail_after(10):  # a hang fails the test instead of the run
            with anyio.CancelScope() as scope:
                async with off:
                    hs = off.hash_prompt(list(range(2 * BS)))
                    off.update("a", [1, 2], hs, 2 * BS)
                    (task,) = off.store()
                    timer.start()
                    scope.cancel()
                    await anyio.sleep(10)
        assert scope.cancelled_caught
        assert gate.is_set()
        assert task.done()
        assert off.pool.num_free == off.pool.num_blocks
        assert all(off.pool.is_cached(h) for h in hs)
        off.scheduler.check_invariants()
    finally:
        timer.cancel()
        host.close()


# -- item 11: finish holds deferred blocks ----------------------------------------------------


async def test_finish_pins_held_blocks_until_their_store_is_planned() -> None:
    pinner = FlakyPinner()
    eng = engine()
    cfg = config(num_cpu_blocks=2, hold_blocks_on_finish=True)
    async with KVOffloader(cfg, make_kv(), copy_engine=eng, pinner=pinner) as off:
        x = off.hash_prompt(list(range(100, 100 + 2 * BS)))
        off.update("x", [10, 11], x, 2 * BS)
        (busy,) = off.store()  # fills the pool
        a = off.hash_prompt(list(range(2 * BS)))
        off.update("a", [0, 1], a, 2 * BS)
        assert off.store() == []  # deferred
        off.finish("a")
        assert pinner.held == {0, 1, 10, 11}
        eng.complete(busy)
        await off.drain()
        off.finish("x")
        assert pinner.held == {0, 1}  # held by the finish, not by a copy
        (task,) = off.store()
        assert task.gpu_block_ids == (0, 1)
        assert pinner.pins[0] == 1  # the copy's pin now; the hold's was dropped
        eng.complete(task)
        await off.drain()
        assert not pinner.held
        assert all(off.pool.is_cached(h) for h in a)
        off.scheduler.check_invariants()


async def test_close_releases_holds() -> None:
    pinner = FlakyPinner()
    eng = engine()
    cfg = config(num_cpu_blocks=1, hold_blocks_on_finish=True)
    async with KVOffloader(cfg, make_kv(), copy_engine=eng, pinner=pinner) as off:
        x = off.hash_prompt(list(range(100, 100 + BS)))
        off.update("x", [10], x, BS)
        (busy,) = off.store()
        a = off.hash_prompt(list(range(2 * BS)))
        off.update("a", [0, 1], a, 2 * BS)
        off.store()
        off.finish("a")
        assert pinner.held == {0, 1, 10}
        eng.complete(busy)
    assert not pinner.held
    assert off.statistics().scheduler.held_blocks == 0


# -- random pinner failures and random cancellation of the scope around the offloader --------

OPS = st.lists(
    st.tuples(
        st.sampled_from(["update", "store", "complete", "fail", "lookup_load", "finish"]),
        st.integers(0, 3),  # request
        st.booleans(),  # the pinner raises during this op
    ),
    max_size=25,
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, cancel_at=st.integers(0, 30), backend=st.sampled_from(["asyncio", "trio"]))
def test_random_pinner_failures_and_cancellation_leave_the_offloader_whole(
    ops: list[tuple[str, int, bool]], cancel_at: int, backend: str
) -> None:
    """Whatever the pinner does and wherever the surrounding scope is cancelled, leaving
    ``async with`` ends (within the copies' time), and every reference and pin is back."""
    pinner = FlakyPinner()
    eng = engine()
    off = KVOffloader(config(num_cpu_blocks=6), make_kv(), copy_engine=eng, pinner=pinner)
    prompts = [list(range(r * 1000, r * 1000 + 3 * BS + 1)) for r in range(4)]
    tables = [[r * 4 + k for k in range(4)] for r in range(4)]
    finished: set[int] = set()

    async def finish_copies_later() -> None:
        while True:  # the copies end on their own time, whoever waits
            await anyio.sleep(0.002)
            eng.complete_all()

    async def scenario() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(finish_copies_later)
            with anyio.fail_after(10), anyio.CancelScope() as scope:
                async with off:
                    for step, (op, r, pin_fails) in enumerate(ops):
                        if step == cancel_at:
                            scope.cancel()
                            await anyio.lowlevel.checkpoint()
                        pinner.fail_pin = pinner.fail_unpin = pin_fails
                        rid = f"r{r}"
                        try:
                            run_op(off, eng, op, r, rid, prompts[r], tables[r], finished)
                        except PinnerError:
                            pass
                        finally:
                            pinner.fail_pin = pinner.fail_unpin = False
                        off.scheduler.check_invariants()
                        await anyio.lowlevel.checkpoint()
            tg.cancel_scope.cancel()

    anyio.run(scenario, backend=backend)
    assert eng.pending == []
    off.scheduler.check_invariants()
    assert off.scheduler.num_in_flight == 0
    assert off.pool.num_free == off.pool.num_blocks - sum(
        len(off.scheduler.request_state(f"r{r}").pinned)
        for r in range(4)
        if off.scheduler.has_request(f"r{r}")
    )
    assert not pinner.held


def run_op(
    off: KVOffloader,
    eng: ControllableCopyEngine,
    op: str,
    r: int,
    rid: str,
    prompt: list[int],
    table: list[int],
    finished: set[int],
) -> None:
    if r in finished:
        return
    hs = off.hash_prompt(prompt)
    if op == "update":
        off.update(rid, table[:3], hs, 3 * BS)
        with pytest.raises(BlockTableError):
            off.update(rid, [*table[:3], table[0]], hs, 3 * BS)  # duplicate: refused
    elif op == "store":
        off.store()
    elif op in {"complete", "fail"} and eng.pending:
        task = eng.pending[0]
        eng.complete(task) if op == "complete" else eng.fail(task)
    elif op == "lookup_load":
        if off.scheduler.has_request(rid) and off.scheduler.request_state(rid).gpu_block_ids:
            return
        hit = off.lookup(rid, hs, len(prompt))
        if hit:
            off.load(rid, table[: hit // BS], hit)
    elif op == "finish" and off.scheduler.has_request(rid):
        off.finish(rid)
        finished.add(r)
