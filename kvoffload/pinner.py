"""How the engine keeps GPU blocks alive while a copy reads or writes them.

`GpuBlockPinner` is the protocol an engine implements, `NoOpPinner` the default that does
nothing, and `RefCountPinner` a ready pinner for engines that have a GPU block allocator.

kvoffload pins a transfer's GPU blocks right before it submits the copy and unpins them
once the copy's completion was observed. Between the two, the engine must not hand those
blocks to another request: a store would copy another request's KV to the CPU under the
first request's hashes, and a load would overwrite KV that is being computed. Either way a
later request is served wrong KV, silently.

`RefCountPinner` keeps one count per block (two transfers may name the same block). The
allocator asks `RefCountPinner.is_pinned()` before reusing a block it freed, or passes
``on_release`` to learn the moment a block's last pin goes, and puts it back on its free
list then. The same hook says when the blocks of an abandoned load
(`OffloadRequest.abandon_load()`) are free: they stay pinned until the copy that was given
up on has ended.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Protocol, final

from kvoffload.errors import BlockStateError

__all__ = ["GpuBlockPinner", "NoOpPinner", "RefCountPinner"]


class GpuBlockPinner(Protocol):
    """How the engine keeps GPU blocks alive while a copy reads or writes them.

    ``pin`` is called with a transfer's GPU block ids right before it is submitted and
    ``unpin`` with the same ids once its completion was observed (success or not). The
    engine must not hand a pinned block to another request (a pin count per block is the
    usual implementation: the same block may be pinned by two transfers). With
    ``hold_blocks_on_finish``, ``finish()`` also pins the blocks a finished request still
    has to store, and unpins them once their store is planned (or given up).

    A pinner that raises is contained: when ``pin`` raises, the transfer is not started
    and its plan is undone (`PinnerError` is raised from the call that started it); when
    ``unpin`` raises, the completion is still recorded and every reference released, and
    the next step-loop call raises `PinnerError` once.
    """

    def pin(self, gpu_block_ids: Sequence[int]) -> None:
        """Keep these blocks from being reused."""

    def unpin(self, gpu_block_ids: Sequence[int]) -> None:
        """Release one pin on each of these blocks."""


@final
class NoOpPinner:
    """The default `GpuBlockPinner`: does nothing.

    Correct only when the engine itself never reuses a GPU block that a transfer in
    flight names, for example because it frees blocks of finished or preempted requests
    only after awaiting their tasks, or because it never reuses blocks within a step.
    """

    def pin(self, gpu_block_ids: Sequence[int]) -> None:
        """Do nothing."""

    def unpin(self, gpu_block_ids: Sequence[int]) -> None:
        """Do nothing."""


@final
class RefCountPinner:
    """A `GpuBlockPinner` that counts pins per GPU block.

    Args:
        on_release: called with the ids of the blocks whose last pin went in one `unpin()`
            call (in the order given), so that an allocator can make blocks it freed while
            they were pinned reusable again. It runs on the thread that processes
            completions (the event loop's).
        on_pin: called with the ids of the blocks that got their first pin in one `pin()`
            call, so that an allocator stops handing out a free block a transfer now
            reads (a block freed before its last store was planned).

    Use it as the ``pinner`` of `KVOffloader` and consult it in the allocator::

        pinner = RefCountPinner(on_release=allocator.reclaim)
        async with KVOffloader(config, gpu_kv, pinner=pinner) as off: ...
    """

    __slots__ = ("_counts", "_on_pin", "_on_release")

    def __init__(
        self,
        on_release: Callable[[Sequence[int]], None] | None = None,
        *,
        on_pin: Callable[[Sequence[int]], None] | None = None,
    ) -> None:
        self._counts: dict[int, int] = {}
        self._on_release = on_release
        self._on_pin = on_pin

    def __repr__(self) -> str:
        return f"RefCountPinner(pinned_blocks={len(self._counts)})"

    def pin(self, gpu_block_ids: Sequence[int]) -> None:
        """Add one pin to each of these blocks (a block named twice gets two)."""
        counts = self._counts
        first = [b for b in gpu_block_ids if b not in counts] if self._on_pin else ()
        for b in gpu_block_ids:
            counts[b] = counts.get(b, 0) + 1
        if first and self._on_pin is not None:
            self._on_pin(first)

    def unpin(self, gpu_block_ids: Sequence[int]) -> None:
        """Remove one pin from each of these blocks; report the blocks now free of pins.

        Raises:
            BlockStateError: a block has no pin left to remove (nothing is changed then).
        """
        counts = self._counts
        need: dict[int, int] = {}
        for b in gpu_block_ids:
            need[b] = need.get(b, 0) + 1
        for b, n in need.items():
            if counts.get(b, 0) < n:
                raise BlockStateError(
                    f"GPU block {b} unpinned {n} time(s) but holds {counts.get(b, 0)} pin(s)"
                )
        released: list[int] = []
        for b, n in need.items():
            left = counts[b] - n
            if left:
                counts[b] = left
            else:
                del counts[b]
                released.append(b)
        if released and self._on_release is not None:
            self._on_release(released)

    def is_pinned(self, gpu_block_id: int) -> bool:
        """Whether a transfer in flight names this block."""
        return gpu_block_id in self._counts

    def pin_count(self, gpu_block_id: int) -> int:
        """How many transfers in flight name this block."""
        return self._counts.get(gpu_block_id, 0)

    @property
    def num_pinned(self) -> int:
        """How many distinct blocks hold at least one pin."""
        return len(self._counts)

    def pinned_blocks(self) -> Iterable[int]:
        """The ids of the pinned blocks (a snapshot)."""
        return tuple(self._counts)
