"""Mistakes a real integrator makes get a clear error, not a hang or an obscure failure.

Calls from the wrong thread, task or process; foreign blocks; odd values; a failed launch
that reported done too early.
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import threading
from collections.abc import Sequence

import anyio
import anyio.to_thread
import pytest
import torch

import kvoffload.build as build_module
from kvoffload._session import Session
from kvoffload.bench.pool import bookkeeping_bytes_per_block
from kvoffload.config import KVLayout, OffloadConfig
from kvoffload.errors import (
    BlockStateError,
    ClosedError,
    ConfigError,
    ForkedProcessError,
    HostMemoryError,
    InvalidInputError,
    KvOffloadError,
    LayoutMismatchError,
    TransferError,
    WrongContextError,
)
from kvoffload.hashing import BlockHash
from kvoffload.offloader import POOL_BOOKKEEPING_BYTES_PER_BLOCK, KVOffloader
from kvoffload.pool import CpuBlockPool
from kvoffload.storage.host_buffer import HostKVBuffer
from kvoffload.testing import ControllableCopyEngine, CopyFaults, FaultyCopyEngine
from kvoffload.transfer.thread_engine import ThreadCopyEngine

pytestmark = pytest.mark.anyio

BS = 4


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def layout() -> KVLayout:
    return KVLayout(num_layers=2, num_kv_heads=2, head_size=8, dtype="float16", block_size=BS)


def make_kv(num_gpu_blocks: int = 16) -> list[torch.Tensor]:
    return [torch.zeros(layout().tensor_shape(num_gpu_blocks), dtype=torch.float16)] * 2


def config(**overrides: object) -> OffloadConfig:
    values: dict[str, object] = {"block_size": BS, "num_cpu_blocks": 8}
    values.update(overrides)
    return OffloadConfig(**values)


# -- item 2: step-loop calls from another thread ------------------------------------------


async def test_a_step_loop_call_from_a_worker_thread_is_refused() -> None:
    async with KVOffloader(config(), make_kv()) as off:
        hs = off.hash_prompt(list(range(2 * BS)))
        off.update("a", [0, 1], hs, 2 * BS)
        with pytest.raises(WrongContextError, match=r"store\(\) called from thread"):
            await anyio.to_thread.run_sync(off.store)
        with pytest.raises(WrongContextError, match="event loop's thread"):
            await anyio.to_thread.run_sync(lambda: off.lookup("b", hs, 2 * BS + 1))
        assert off.scheduler.num_in_flight == 0  # nothing was planned or submitted
        assert off.scheduler.request_state("a").num_stored_blocks == 0
        with anyio.fail_after(5):
            await off.drain()
        (task,) = off.store()  # from the loop's thread: works
        await task
        assert all(off.pool.is_cached(h) for h in hs)


# -- item 3: aclose() in a forked child ----------------------------------------------------


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
async def test_aclose_in_a_forked_child_raises(anyio_backend: str) -> None:
    if anyio_backend == "trio":
        pytest.skip("fork from inside a trio run is not supported by trio")
    engine = ControllableCopyEngine(num_gpu_blocks=16, num_cpu_blocks=8)
    async with KVOffloader(config(), make_kv(), copy_engine=engine) as off:
        hs = off.hash_prompt(list(range(BS)))
        off.update("a", [0], hs, BS)
        (task,) = off.store()  # a copy of the parent's, in flight
        pid = os.fork()
        if pid == 0:  # pragma: no cover - child
            code = 1
            closing = off.aclose()
            try:
                closing.send(None)  # its first step: no event loop needed to see the refusal
            except ForkedProcessError:
                code = 0
            except BaseException:
                code = 2
            finally:
                closing.close()
            os._exit(code)
        done, status = 0, 0
        try:
            with anyio.move_on_after(10):
                while not done:  # the child must not hang
                    done, status = os.waitpid(pid, os.WNOHANG)
                    await anyio.sleep(0.01)
        finally:
            engine.complete(task)  # so that the parent's own close never waits
            if not done:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
        assert done, "aclose() in the forked child hung"
        assert os.waitstatus_to_exitcode(status) == 0


# -- item 4: aclose() from another task -------------------------------------------------------


async def test_aclose_from_another_task_is_refused_and_the_owner_still_closes() -> None:
    errors: list[BaseException] = []
    off = KVOffloader(config(), make_kv())
    async with off:

        async def close_from_elsewhere() -> None:
            try:
                await off.aclose()
            except WrongContextError as exc:
                errors.append(exc)

        async with anyio.create_task_group() as tg:
            tg.start_soon(close_from_elsewhere)
        assert len(errors) == 1
        assert "task that entered" in str(errors[0])
        assert off.lookup("a", [], 1) == 0  # still open
    with pytest.raises(Exception, match="closed"):
        off.lookup("a", [], 1)


# -- item 5: foreign blocks ---------------------------------------------------------------------


def test_touch_and_free_refuse_a_block_of_another_pool() -> None:
    mine, other = CpuBlockPool(4), CpuBlockPool(4)
    own = mine.allocate(2)
    theirs = other.allocate(1)
    with pytest.raises(BlockStateError, match="block 0 belongs to another pool"):
        mine.free([own[0], theirs[0]])
    with pytest.raises(BlockStateError, match="another pool"):
        mine.touch([own[1], other.block(3)])
    assert [b.ref_cnt for b in own] == [1, 1]
    mine.check_invariants()
    other.check_invariants()
    big = CpuBlockPool(8)
    with pytest.raises(BlockStateError, match="block 6 belongs to another pool"):
        mine.touch([big.block(6)])


def test_publish_refuses_a_block_of_another_pool() -> None:
    # Published here, another pool's block would be served for this pool's lookups.
    mine, other = CpuBlockPool(4), CpuBlockPool(4)
    (theirs,) = other.allocate(1)
    key = BlockHash(bytes(32))
    with pytest.raises(BlockStateError, match="block 0 belongs to another pool"):
        mine.publish(theirs, key)
    assert mine.lookup([key]) == []
    assert theirs.block_hash is None
    mine.check_invariants()
    other.check_invariants()


# -- item 6: odd values -------------------------------------------------------------------------


def test_odd_values_get_clear_errors() -> None:
    with pytest.raises(ConfigError, match="num_cpu_blocks .*not a bool"):
        OffloadConfig(num_cpu_blocks=True)
    cfg = config()
    with pytest.raises(ConfigError, match="frozen: cannot set block_size=8"):
        cfg.block_size = 8
    with pytest.raises(LayoutMismatchError, match="no GPU block"):
        KVOffloader(config(), make_kv(num_gpu_blocks=0))
    host = HostKVBuffer(layout(), 4, pin_memory="never")
    try:
        with pytest.raises(InvalidInputError, match=r"block_id 99 out of range \[0, 4\)"):
            host.block_bytes(99)
        with pytest.raises(InvalidInputError):
            host.block_bytes(-1)
        assert host.block_bytes(3).numel() == layout().bytes_per_block
    finally:
        host.close()


# -- item 8: a failed launch reports done only after its release -------------------------------


class Pins:
    def __init__(self) -> None:
        self.count = 0

    def pin(self, ids: Sequence[int]) -> None:
        self.count += len(ids)

    def unpin(self, ids: Sequence[int]) -> None:
        self.count -= len(ids)


async def test_a_load_whose_launch_failed_is_done_only_after_its_release() -> None:
    inner = ControllableCopyEngine(num_gpu_blocks=16, num_cpu_blocks=8)
    engine = FaultyCopyEngine(inner, fail_submits={1})
    pins = Pins()
    async with KVOffloader(config(), make_kv(), copy_engine=engine, pinner=pins) as off:
        hs = off.hash_prompt(list(range(2 * BS)))
        off.update("a", [0, 1], hs, 2 * BS)
        (store,) = off.store()
        inner.complete(store)
        await off.drain()
        off.finish("a")
        hit = off.lookup("b", hs, 2 * BS + 1)
        task = off.load("b", [4, 5], hit)
        assert task is not None
        assert not task.done()  # its pins and references are still held
        assert pins.count == 2
        await off.drain()
        assert task.done()
        assert pins.count == 0
        assert off.pool.num_free == off.pool.num_blocks
        off.scheduler.check_invariants()


async def test_a_failed_completion_callback_is_raised_by_every_later_step_call() -> None:
    """A bug in what runs when a copy ends (here: the launcher's `on_ended` hook) is not
    lost in the poller: every step-loop call after it raises it, chained."""
    async with KVOffloader(config(), make_kv()) as off:
        hs = off.hash_prompt(list(range(2 * BS)))
        off.update("a", [0, 1], hs, 2 * BS)

        def broken(task: object, tokens: int) -> None:
            raise ValueError("a bug in the completion path")

        off._life.launcher.on_ended = broken
        (task,) = off.store()
        with anyio.fail_after(5):
            await task  # the copy itself ended; its awaiter still wakes
        with anyio.fail_after(5):
            while off._life.launcher.poller.statistics().callback_errors == 0:
                await anyio.sleep(0.001)
        for call in (
            lambda: off.update("a", [0, 1], hs, 2 * BS),
            off.store,
            lambda: off.lookup("b", hs, 2 * BS + 1),
            lambda: off.finish("a"),
        ):
            with pytest.raises(KvOffloadError, match="completion callback failed 1 time") as info:
                call()
            assert isinstance(info.value.__cause__, ValueError)


# -- item 1: the whole cost is checked before anything is allocated -------------------------


def test_a_pool_too_large_for_memory_is_refused_before_anything_is_built(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_pool(*args: object, **kwargs: object) -> None:
        raise AssertionError("the pool was built before the memory check")

    monkeypatch.setattr(build_module, "CpuBlockPool", no_pool)
    monkeypatch.setattr(build_module, "available_host_memory", lambda: 1 << 30)
    per_block = layout().bytes_per_block
    with pytest.raises(HostMemoryError) as info:
        KVOffloader(config(num_cpu_blocks=1 << 31), make_kv())
    message = str(info.value)
    assert f"{(1 << 31) * per_block} bytes of host buffer" in message
    assert f"{(1 << 31) * POOL_BOOKKEEPING_BYTES_PER_BLOCK} bytes of bookkeeping" in message
    assert f"can still use {1 << 30} bytes" in message
    # With a copy engine of its own, only the bookkeeping counts (the host buffer exists).
    engine = ControllableCopyEngine(num_gpu_blocks=16)
    with pytest.raises(HostMemoryError, match=" 0 bytes of host buffer"):
        KVOffloader(config(num_cpu_blocks=1 << 31), make_kv(), copy_engine=engine)


async def test_a_large_pool_is_built_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    tiny = KVLayout(num_layers=1, num_kv_heads=1, head_size=1, dtype="float16", block_size=BS)
    kv = [torch.zeros(tiny.tensor_shape(8), dtype=torch.float16)]
    built_on: list[int] = []
    real = Session.build

    def record(self: Session) -> None:
        built_on.append(threading.get_ident())
        real(self)

    monkeypatch.setattr(Session, "build", record)
    off = KVOffloader(config(num_cpu_blocks=70_000), kv)
    assert built_on == []
    with pytest.raises(ClosedError, match="built on entering"):
        off.pool
    async with off:
        assert off.pool.num_blocks == 70_000
        assert built_on != [threading.get_ident()]
        assert len(built_on) == 1


async def test_the_hints_of_a_large_pool_exist_before_it_is_built() -> None:
    tiny = KVLayout(num_layers=1, num_kv_heads=1, head_size=1, dtype="float16", block_size=BS)
    kv = [torch.zeros(tiny.tensor_shape(8), dtype=torch.float16)]
    off = KVOffloader(config(num_cpu_blocks=70_000), kv)
    off.hints.clock = lambda: 5.0  # set before entering, kept once the pool is built
    assert off.hints.sessions == ()
    async with off:
        assert off.hints.clock() == 5.0
        assert off.hints.retain_for(list(range(3 * BS)), 10.0, session="s") == 0
        assert off.hints.deadline("s") == 15.0


def test_the_pool_benchmark_measures_bookkeeping_per_block() -> None:
    measured = bookkeeping_bytes_per_block(20_000)
    assert 40 < measured <= POOL_BOOKKEEPING_BYTES_PER_BLOCK


# -- item 7: no reference cycles in the steady state ---------------------------------------


async def test_steady_state_leaves_no_cyclic_garbage(anyio_backend: str) -> None:
    """Stores, loads, failed copies awaited and waits cancelled, under ``gc.disable()``:
    the reference count frees everything; the cycle collector finds nothing."""
    kv = make_kv(num_gpu_blocks=8)
    host = HostKVBuffer(layout(), 8, pin_memory="never")
    faults = CopyFaults(fail_copies=set(range(0, 10_000, 3)))
    engine = ThreadCopyEngine(layout(), kv, host, copy_hook=faults)

    async def one_request(off: KVOffloader, i: int) -> None:
        prompt = list(range(i % 5 * 100, i % 5 * 100 + 3 * BS + 1))
        hs = off.hash_prompt(prompt)
        rid = f"r{i}"
        hit = off.lookup(rid, hs, len(prompt), allow_defer=True)
        if hit:
            load = off.load(rid, [0, 1, 2][: hit // BS], hit)
            assert load is not None
            with contextlib.suppress(TransferError):
                await load
        off.update(rid, [0, 1, 2], hs, 3 * BS)
        for task in off.store():
            with contextlib.suppress(TransferError), anyio.move_on_after(0 if i % 2 else 5):
                await task  # every other wait is cancelled
        off.finish(rid)
        await off.drain()

    try:
        async with KVOffloader(config(), kv, copy_engine=engine) as off:
            for i in range(20):
                await one_request(off, i)
            gc.collect()
            gc.disable()
            try:
                for i in range(20, 220):
                    await one_request(off, i)
                found = gc.collect()
            finally:
                gc.enable()
            stats = off.statistics().scheduler
            assert stats.failed_stores + stats.failed_loads > 20  # failures were exercised
            assert found == 0, f"{found} objects were only freed by the cycle collector"
    finally:
        host.close()
