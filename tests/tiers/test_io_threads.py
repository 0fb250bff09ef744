"""IoThreads: results and errors come back, at most N calls run at once, and a cancelled
caller waits for its call (which may be using the caller's buffers) to finish."""

from __future__ import annotations

import threading
import time

import anyio
import pytest

from kvoffload.tiers._threads import IoThreads

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """Both backends: asyncio takes the tier's own pool, trio anyio's threads."""
    return str(request.param)


async def test_result_and_error_come_back() -> None:
    threads = IoThreads(2, "test")
    try:
        assert await threads.run(lambda a, b: a + b, 2, 3) == 5
        assert await threads.run(threading.get_ident) != threading.get_ident()

        def boom() -> None:
            raise ValueError("from the thread")

        with pytest.raises(ValueError, match="from the thread"):
            await threads.run(boom)
    finally:
        threads.shutdown()


async def test_at_most_n_calls_at_once() -> None:
    threads = IoThreads(2, "test")
    lock = threading.Lock()
    running = peak = 0

    def call() -> None:
        nonlocal running, peak
        with lock:
            running += 1
            peak = max(peak, running)
        time.sleep(0.02)
        with lock:
            running -= 1

    try:
        async with anyio.create_task_group() as tg:
            for _ in range(6):
                tg.start_soon(threads.run, call)
        assert peak == 2
    finally:
        threads.shutdown()


async def test_a_cancelled_caller_waits_for_its_call() -> None:
    threads = IoThreads(1, "test")
    started, release = threading.Event(), threading.Event()
    finished: list[bool] = []

    def call() -> None:
        started.set()
        release.wait(5)
        time.sleep(0.05)  # still touching the caller's buffers after the release
        finished.append(True)

    try:
        with anyio.CancelScope() as scope:

            async def cancel_when_started() -> None:
                await anyio.to_thread.run_sync(started.wait, 5)
                scope.cancel()
                release.set()

            async with anyio.create_task_group() as tg:
                tg.start_soon(cancel_when_started)
                await threads.run(call)
        assert scope.cancel_called
        assert finished == [True]  # the cancellation waited for the call
    finally:
        threads.shutdown()
