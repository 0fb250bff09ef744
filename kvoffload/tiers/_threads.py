"""`IoThreads`: the worker threads a tier moves bytes in, with a light hop on asyncio."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from typing import TypeVar, final

import anyio
import anyio.to_thread

__all__ = ["IoThreads"]

_R = TypeVar("_R")


@final
class IoThreads:
    """At most ``threads`` calls at once, each in a worker thread.

    On asyncio a call goes to a private thread pool through ``asyncio.wrap_future``: a
    lighter hop than ``anyio.to_thread``, which an engine's event loop pays once per tier
    batch. On another backend (trio) it goes through ``anyio.to_thread`` with the same
    bound. Either way a cancelled caller waits for its call to finish before the
    cancellation goes on, since the call reads or writes the caller's buffers.

    Args:
        threads: calls at once.
        name: prefix of the threads' names.
    """

    def __init__(self, threads: int, name: str) -> None:
        self.limiter = anyio.CapacityLimiter(threads)
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix=name)

    async def run(self, fn: Callable[..., _R], *args: object) -> _R:
        """``fn(*args)`` in a worker thread; its result or exception."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # not asyncio (trio)
            return await anyio.to_thread.run_sync(fn, *args, limiter=self.limiter)
        future = self._pool.submit(fn, *args)
        try:
            return await asyncio.wrap_future(future)
        except BaseException:
            if not future.done():  # cancelled while the call runs: let it finish first
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(concurrent.futures.wait, [future])
            raise

    def shutdown(self) -> None:
        """Let the idle threads go (calls still running finish)."""
        self._pool.shutdown(wait=False)
