"""KVOffloader end to end on CPU: real bytes through ThreadCopyEngine, asyncio and trio."""

from __future__ import annotations

import os
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import anyio
import pytest
import torch

from kvoffload.config import KVLayout, OffloadConfig
from kvoffload.errors import ClosedError, ForkedProcessError, KvOffloadError, TransferError
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


def make_kv(kind: str = "blocks_first", dtype: torch.dtype = torch.float16) -> list[torch.Tensor]:
    layout = KVLayout(
        num_layers=3, num_kv_heads=2, head_size=8, dtype=str(dtype)[6:], block_size=BS, kind=kind
    )
    gen = torch.Generator().manual_seed(0)
    return [
        torch.randn(layout.tensor_shape(NUM_GPU_BLOCKS), generator=gen).to(dtype)
        for _ in range(layout.num_layers)
    ]


def block_kv(
    kv: Sequence[torch.Tensor], gpu_block: int, kind: str = "blocks_first"
) -> torch.Tensor:
    """All layers' K and V of one GPU block, stacked."""
    if kind == "blocks_first":
        return torch.stack([t[gpu_block] for t in kv])
    return torch.stack([t[:, gpu_block] for t in kv])


def config(**overrides: object) -> OffloadConfig:
    values: dict[str, object] = {"block_size": BS, "num_cpu_blocks": 16}
    values.update(overrides)
    return OffloadConfig(**values)


@pytest.fixture
def hooked_engine() -> Iterator[Callable[[list[torch.Tensor], CopyFaults], ThreadCopyEngine]]:
    """Thread engines with a copy hook over host buffers closed at teardown."""
    hosts: list[HostKVBuffer] = []

    def make(kv: list[torch.Tensor], hook: CopyFaults) -> ThreadCopyEngine:
        layout = KVLayout.from_tensors(kv, block_size=BS)
        hosts.append(HostKVBuffer(layout, 16, pin_memory="never"))
        return ThreadCopyEngine(layout, kv, hosts[-1], copy_hook=hook)

    yield make
    for host in hosts:
        host.close()


@pytest.fixture
def gate() -> Iterator[threading.Event]:
    """Holds gated copies until set; set at teardown so no worker stays blocked."""
    event = threading.Event()
    yield event
    event.set()


class CountingPinner:
    def __init__(self) -> None:
        self.pins: Counter[int] = Counter()
        self.history: list[tuple[str, tuple[int, ...]]] = []

    def pin(self, ids: Sequence[int]) -> None:
        self.pins.update(ids)
        self.history.append(("pin", tuple(ids)))

    def unpin(self, ids: Sequence[int]) -> None:
        self.pins.subtract(ids)
        self.history.append(("unpin", tuple(ids)))

    @property
    def held(self) -> set[int]:
        return {k for k, v in self.pins.items() if v > 0}


@pytest.mark.parametrize("kind", ["blocks_first", "kv_first"])
async def test_store_then_load_moves_the_exact_bytes(kind: str) -> None:
    kv = make_kv(kind)
    async with KVOffloader(config(), kv) as off:
        prompt = list(range(5 * BS + 1))
        hs = off.hash_prompt(prompt)
        src = [3, 17, 8, 25, 0]
        expected = [block_kv(kv, g, kind).clone() for g in src]
        off.update("a", src, hs, len(prompt))
        tasks = off.store()
        assert len(tasks) == 1
        result = await tasks[0]
        assert result.num_blocks == 5
        assert result.nbytes == 5 * off.layout.bytes_per_block
        off.finish("a")
        hit = off.lookup("b", hs, len(prompt))
        assert hit == 5 * BS
        dst = [30, 1, 12, 9, 22]
        for g in dst:
            for t in kv:
                (t[g] if kind == "blocks_first" else t[:, g]).zero_()
        task = off.load("b", dst, hit)
        assert task is not None
        await task
        for g, want in zip(dst, expected, strict=True):
            assert torch.equal(block_kv(kv, g, kind), want)
        off.finish("b")
        stats = off.statistics()
        assert stats.scheduler.stored_blocks == 5
        assert stats.scheduler.loaded_blocks == 5
        assert stats.scheduler.bytes_loaded == 5 * off.layout.bytes_per_block
        assert stats.pool.num_free == stats.pool.num_blocks
        off.scheduler.check_invariants()


async def test_completion_needs_no_awaiter_and_no_api_call() -> None:
    # FM-54: the poller drives completion by itself.
    kv = make_kv()
    async with KVOffloader(config(), kv) as off:
        hs = off.hash_prompt(list(range(2 * BS)))
        off.update("a", [0, 1], hs, 2 * BS)
        assert len(off.store()) == 1
        with anyio.fail_after(5):
            while not all(off.pool.is_cached(h) for h in hs):
                await anyio.sleep(0.001)
        assert off.statistics().scheduler.stored_blocks == 2


async def test_use_outside_the_context_raises_closed() -> None:
    off = KVOffloader(config(), make_kv())
    with pytest.raises(ClosedError, match="created"):
        off.lookup("a", [], 1)
    async with off:
        pass
    with pytest.raises(ClosedError, match="closed"):
        off.update("a", [], [], 0)
    with pytest.raises(ClosedError):
        async with off:
            pass
    await off.aclose()  # idempotent


async def test_failed_copy_publishes_nothing_and_releases_refs(hooked_engine: Any) -> None:
    kv = make_kv()
    engine = hooked_engine(kv, CopyFaults(fail_copies=[0]))
    pinner = CountingPinner()
    async with KVOffloader(config(), kv, copy_engine=engine, pinner=pinner) as off:
        hs = off.hash_prompt(list(range(3 * BS)))
        off.update("a", [4, 5, 6], hs, 3 * BS)
        (task,) = off.store()
        with pytest.raises(TransferError, match="injected copy failure") as info:
            await task
        assert isinstance(info.value.__cause__, RuntimeError)
        assert not any(off.pool.is_cached(h) for h in hs)
        assert off.pool.num_free == off.pool.num_blocks
        assert off.lookup("b", hs, 3 * BS + 1) == 0
        assert not pinner.held
        assert off.statistics().scheduler.failed_stores == 1


async def test_pinner_holds_gpu_blocks_until_the_copy_finished(
    hooked_engine: Any, gate: Any
) -> None:
    # FM-05 / invariant 7: a finished request's GPU blocks stay pinned while its store runs.
    kv = make_kv()
    engine = hooked_engine(kv, CopyFaults(gate=gate))
    pinner = CountingPinner()
    async with KVOffloader(config(), kv, copy_engine=engine, pinner=pinner) as off:
        hs = off.hash_prompt(list(range(2 * BS)))
        off.update("a", [7, 9], hs, 2 * BS)
        (task,) = off.store()
        off.finish("a")
        assert pinner.held == {7, 9}
        await anyio.sleep(0.01)
        assert pinner.held == {7, 9}
        assert off.scheduler.has_request("a")
        gate.set()
        await task
        assert pinner.held == set()
        assert not off.scheduler.has_request("a")
        assert pinner.history == [("pin", (7, 9)), ("unpin", (7, 9))]


async def test_cancelled_awaiter_leaves_the_copy_running(hooked_engine: Any, gate: Any) -> None:
    # FM-47: cancelling the wait never aborts the copy or frees its blocks early.
    kv = make_kv()
    engine = hooked_engine(kv, CopyFaults(gate=gate))
    async with KVOffloader(config(), kv, copy_engine=engine) as off:
        hs = off.hash_prompt(list(range(2 * BS)))
        off.update("a", [1, 2], hs, 2 * BS)
        (task,) = off.store()
        with anyio.move_on_after(0.02) as scope:
            await task
        assert scope.cancelled_caught
        assert not task.done()
        assert off.pool.num_free == off.pool.num_blocks - 2  # still referenced
        assert not any(off.pool.is_cached(h) for h in hs)
        gate.set()
        await task
        assert all(off.pool.is_cached(h) for h in hs)
        assert off.pool.num_free == off.pool.num_blocks


async def test_timeout_on_a_copy_that_never_completes_keeps_blocks_referenced() -> None:
    # FM-45: the caller's timeout frees nothing; the blocks wait for the real completion.
    engine = ControllableCopyEngine(num_gpu_blocks=NUM_GPU_BLOCKS, num_cpu_blocks=16)
    async with KVOffloader(config(), make_kv(), copy_engine=engine) as off:
        hs = off.hash_prompt(list(range(3 * BS)))
        off.update("a", [0, 1, 2], hs, 3 * BS)
        (task,) = off.store()
        with pytest.raises(TimeoutError):
            with anyio.fail_after(0.05):
                await task
        assert off.pool.num_free == off.pool.num_blocks - 3
        off.scheduler.check_invariants()
        engine.complete(task)
        await off.drain()
        assert off.pool.num_free == off.pool.num_blocks
        assert all(off.pool.is_cached(h) for h in hs)


async def test_reset_abandons_in_flight_transfers() -> None:
    # FM-37
    engine = ControllableCopyEngine(num_gpu_blocks=NUM_GPU_BLOCKS, num_cpu_blocks=16)
    async with KVOffloader(config(), make_kv(), copy_engine=engine) as off:
        done = off.hash_prompt(list(range(2 * BS)))
        off.update("a", [0, 1], done, 2 * BS)
        (first,) = off.store()
        engine.complete(first)
        await first
        pending = off.hash_prompt(list(range(100, 100 + 2 * BS)))
        off.update("b", [2, 3], pending, 2 * BS)
        (second,) = off.store()
        async with anyio.create_task_group() as tg:
            results: list[bool] = []

            async def do_reset() -> None:
                results.append(await off.reset())

            tg.start_soon(do_reset)
            await anyio.sleep(0.01)
            assert not results  # waits for the abandoned store
            assert off.lookup("q", done, 2 * BS + 1) == 0  # already invisible
            engine.complete(second)
        assert results == [True]
        with pytest.raises(TransferError, match="abandoned"):
            await second
        assert off.pool.num_cached == 0
        assert off.pool.num_free == off.pool.num_blocks
        assert off.statistics().scheduler.abandoned_transfers == 1


async def test_close_waits_for_copies_in_flight(hooked_engine: Any, gate: Any) -> None:
    # FM-04: memory is released only after every copy finished.
    kv = make_kv()
    engine = hooked_engine(kv, CopyFaults(gate=gate))

    async def open_gate_later() -> None:
        await anyio.sleep(0.05)
        gate.set()

    async with anyio.create_task_group() as tg:
        async with KVOffloader(config(), kv, copy_engine=engine) as off:
            hs = off.hash_prompt(list(range(2 * BS)))
            off.update("a", [1, 2], hs, 2 * BS)
            (task,) = off.store()
            tg.start_soon(open_gate_later)
        # Leaving the block closed the offloader: it must have waited for the gate.
        assert gate.is_set()
        assert task.done()
        assert off.pool.num_free == off.pool.num_blocks
        assert all(off.pool.is_cached(h) for h in hs)
        assert engine.closed


async def test_completion_callback_failure_is_surfaced() -> None:
    # FM-25: an exception in completion handling is never silently lost.
    class BrokenPinner(CountingPinner):
        def unpin(self, ids: Sequence[int]) -> None:
            raise RuntimeError("unpin exploded")

    engine = ControllableCopyEngine(num_gpu_blocks=NUM_GPU_BLOCKS, num_cpu_blocks=16)
    async with KVOffloader(config(), make_kv(), copy_engine=engine, pinner=BrokenPinner()) as off:
        hs = off.hash_prompt(list(range(BS)))
        off.update("a", [0], hs, BS)
        (task,) = off.store()
        engine.complete(task)
        await off.drain()
        with pytest.raises(KvOffloadError) as info:
            off.lookup("b", hs, BS + 1)
        assert "unpin exploded" in repr(info.value.__cause__)


async def test_load_failure_raises_and_unpublishes(hooked_engine: Any) -> None:
    # FM-40: a failed load is never served as a hit.
    kv = make_kv()
    engine = hooked_engine(kv, CopyFaults(fail_copies=[1]))
    async with KVOffloader(config(), kv, copy_engine=engine) as off:
        hs = off.hash_prompt(list(range(2 * BS)))
        off.update("a", [0, 1], hs, 2 * BS)
        await off.store()[0]
        hit = off.lookup("b", hs, 2 * BS + 1)
        task = off.load("b", [5, 6], hit)
        assert task is not None
        with pytest.raises(TransferError):
            await task
        stats = off.statistics().scheduler
        assert stats.failed_loads == 1
        assert stats.loaded_blocks == 0
        assert off.lookup("c", hs, 2 * BS + 1) == 0


async def test_lazy_mode_through_the_offloader() -> None:
    kv = make_kv()

    class View:
        def __init__(self, items: list[tuple[int, bytes]]) -> None:
            self.items = items

        def iter_eviction_order(self):  # type: ignore[no-untyped-def]
            return iter(self.items)

    async with KVOffloader(config(store_mode="lazy", lazy_offload_blocks=2), kv) as off:
        hs = off.hash_prompt(list(range(3 * BS)))
        view = View([(9, hs[2]), (8, hs[1]), (7, hs[0])])
        (task,) = off.store(gpu_cache=view)  # type: ignore[arg-type]
        await task
        assert task.gpu_block_ids == (9, 8)
        assert [off.pool.is_cached(h) for h in hs] == [False, True, True]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
async def test_use_in_a_forked_child_raises(anyio_backend: str) -> None:
    # FM-52
    if anyio_backend == "trio":
        pytest.skip("fork from inside a trio run is not supported by trio")
    async with KVOffloader(config(), make_kv()) as off:
        pid = os.fork()
        if pid == 0:  # pragma: no cover - child
            try:
                off.lookup("a", [], 1)
            except ForkedProcessError:
                os._exit(0)
            except BaseException:
                os._exit(2)
            os._exit(1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0


async def test_work_started_during_a_reset_survives_it() -> None:
    # reset() waits for the abandoned transfers; a store the engine starts meanwhile is
    # new work: it publishes, and reset() reports that the cache is not empty.
    engine = ControllableCopyEngine(num_gpu_blocks=NUM_GPU_BLOCKS, num_cpu_blocks=16)
    async with KVOffloader(config(), make_kv(), copy_engine=engine) as off:
        old = off.hash_prompt(list(range(2 * BS)))
        off.update("old", [0, 1], old, 2 * BS)
        (abandoned,) = off.store()
        off.finish("old")  # a live request would store its blocks again after the reset
        results: list[bool] = []
        async with anyio.create_task_group() as tg:

            async def do_reset() -> None:
                results.append(await off.reset())

            tg.start_soon(do_reset)
            await anyio.sleep(0.01)
            new = off.hash_prompt(list(range(500, 500 + 2 * BS)))
            off.update("new", [4, 5], new, 2 * BS)
            (fresh,) = off.store()
            engine.complete(abandoned)
            engine.complete(fresh)
        assert results == [False]
        assert off.lookup("q", new, 2 * BS + 1) == 2 * BS
        assert off.lookup("q2", old, 2 * BS + 1) == 0
        off.release("q")
        off.scheduler.check_invariants()


async def test_cancelled_while_opening_releases_what_it_made(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    made: list[HostKVBuffer] = []
    real_create = HostKVBuffer.create

    with anyio.CancelScope() as scope:

        async def create_then_get_cancelled(*args: object, **kwargs: object) -> HostKVBuffer:
            buffer = await real_create(*args, **kwargs)  # type: ignore[arg-type]
            made.append(buffer)
            scope.cancel()  # lands at the open's next checkpoint
            return buffer

        monkeypatch.setattr(HostKVBuffer, "create", create_then_get_cancelled)
        off = KVOffloader(config(), make_kv())
        async with off:
            pytest.fail("the body must not run: the open was cancelled")
    assert scope.cancelled_caught
    assert len(made) == 1
    with pytest.raises(ClosedError):
        made[0].raw  # the buffer was closed by the failed open
    with pytest.raises(ClosedError, match="closed"):
        off.lookup("a", [], 1)


async def test_cancelled_drain_and_reset_leave_nothing_behind() -> None:
    # Cancelling the wait of drain() or reset() cancels only the wait: the transfers
    # complete later and release every reference.
    engine = ControllableCopyEngine(num_gpu_blocks=NUM_GPU_BLOCKS, num_cpu_blocks=16)
    async with KVOffloader(config(), make_kv(), copy_engine=engine) as off:
        hs = off.hash_prompt(list(range(2 * BS)))
        off.update("a", [0, 1], hs, 2 * BS)
        (store,) = off.store()
        with anyio.move_on_after(0.01) as scope:
            await off.drain()
        assert scope.cancelled_caught
        assert off.pool.num_free == off.pool.num_blocks - 2
        with anyio.move_on_after(0.01) as scope:
            await off.reset()
        assert scope.cancelled_caught
        assert off.pool.num_cached == 0  # the reset itself happened
        engine.complete(store)
        await off.drain()
        assert off.pool.num_free == off.pool.num_blocks
        assert off.pool.num_cached == 0  # the abandoned store published nothing
        off.scheduler.check_invariants()
