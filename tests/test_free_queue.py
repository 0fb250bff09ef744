from __future__ import annotations

import gc
import os
import sys
import tracemalloc
from collections.abc import Callable
from types import FrameType

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvoffload.errors import (
    BlockStateError,
    InvalidInputError,
    InvariantError,
    OutOfBlocksError,
)
from kvoffload.pool.free_queue import BlockId, CpuBlock, LruFreeQueue


def blocks(n: int) -> list[CpuBlock]:
    return [CpuBlock(BlockId(i)) for i in range(n)]


def ids(queue: LruFreeQueue) -> list[int]:
    return [b.block_id for b in queue]


def test_cpu_block_has_no_dict() -> None:
    block = CpuBlock(BlockId(3))
    assert not hasattr(block, "__dict__")
    with pytest.raises(AttributeError):
        block.color = "red"  # type: ignore[attr-defined]
    assert block.block_id == 3
    assert block.ref_cnt == 0
    assert block.block_hash is None
    assert not block.is_free


def test_queue_has_no_dict() -> None:
    assert not hasattr(LruFreeQueue(), "__dict__")


def test_blocks_compare_by_identity() -> None:
    a, b = CpuBlock(BlockId(1)), CpuBlock(BlockId(1))
    assert a != b
    assert a == a
    assert len({a, b}) == 2


def test_initial_contents_in_order() -> None:
    bs = blocks(5)
    q = LruFreeQueue(bs)
    assert len(q) == 5
    assert ids(q) == [0, 1, 2, 3, 4]
    assert all(b.is_free for b in bs)
    assert q.check() == bs
    assert repr(q) == "LruFreeQueue(len=5)"


def test_empty_queue() -> None:
    q = LruFreeQueue()
    assert len(q) == 0
    assert list(q) == []
    assert q.check() == []
    with pytest.raises(OutOfBlocksError, match=r"cannot allocate 1 CPU block\(s\): only 0 free"):
        q.popleft()
    assert q.popleft_n(0) == []


def test_popleft_takes_lru_and_unlinks() -> None:
    bs = blocks(3)
    q = LruFreeQueue(bs)
    first = q.popleft()
    assert first is bs[0]
    assert not first.is_free
    assert ids(q) == [1, 2]
    assert len(q) == 2
    q.check()


def test_popleft_n() -> None:
    bs = blocks(6)
    q = LruFreeQueue(bs)
    taken = q.popleft_n(4)
    assert taken == bs[:4]
    assert not any(b.is_free for b in taken)
    assert ids(q) == [4, 5]
    assert q.popleft_n(2) == bs[4:]
    assert len(q) == 0
    q.check()
    q.append(bs[1])
    assert ids(q) == [1]
    q.check()


def test_popleft_n_more_than_queued_changes_nothing() -> None:
    q = LruFreeQueue(blocks(3))
    with pytest.raises(
        OutOfBlocksError, match=r"cannot allocate 4 CPU block\(s\): only 3 free"
    ) as e:
        q.popleft_n(4)
    assert e.value.requested == 4
    assert e.value.num_free == 3
    assert ids(q) == [0, 1, 2]
    q.check()


def test_popleft_n_zero_is_empty_and_negative_is_refused() -> None:
    q = LruFreeQueue(blocks(2))
    assert q.popleft_n(0) == []
    with pytest.raises(InvalidInputError, match="negative number of blocks: -3"):
        q.popleft_n(-3)
    assert len(q) == 2


def test_append_goes_to_mru_end() -> None:
    bs = blocks(4)
    q = LruFreeQueue(bs[:2])
    q.append(bs[3])
    q.append(bs[2])
    assert ids(q) == [0, 1, 3, 2]
    q.check()


def test_append_twice_raises_and_changes_nothing() -> None:
    bs = blocks(2)
    q = LruFreeQueue(bs)
    with pytest.raises(BlockStateError, match="block 0 is already in the free queue"):
        q.append(bs[0])
    assert ids(q) == [0, 1]
    assert len(q) == 2
    q.check()


def test_append_n_in_order() -> None:
    bs = blocks(5)
    q = LruFreeQueue(bs[:1])
    q.append_n([bs[4], bs[2], bs[3]])
    assert ids(q) == [0, 4, 2, 3]
    q.append_n([])
    q.append_n(iter([bs[1]]))
    assert ids(q) == [0, 4, 2, 3, 1]
    q.check()


def test_append_n_with_a_queued_block_keeps_the_ones_before() -> None:
    bs = blocks(5)
    q = LruFreeQueue(bs[:2])
    with pytest.raises(BlockStateError, match="block 1 is already in the free queue"):
        q.append_n([bs[2], bs[3], bs[1], bs[4]])
    assert ids(q) == [0, 1, 2, 3]
    assert not bs[4].is_free
    q.check()


def test_append_n_with_a_duplicate() -> None:
    bs = blocks(3)
    q = LruFreeQueue()
    with pytest.raises(BlockStateError, match="block 0 is already"):
        q.append_n([bs[0], bs[1], bs[0]])
    assert ids(q) == [0, 1]
    q.check()


def test_remove_anywhere() -> None:
    bs = blocks(5)
    q = LruFreeQueue(bs)
    q.remove(bs[2])
    q.remove(bs[0])
    q.remove(bs[4])
    assert ids(q) == [1, 3]
    assert not bs[2].is_free
    q.check()
    q.remove(bs[1])
    q.remove(bs[3])
    assert len(q) == 0
    q.check()


def test_remove_not_queued_raises() -> None:
    bs = blocks(2)
    q = LruFreeQueue(bs[:1])
    with pytest.raises(BlockStateError, match="block 1 is not in the free queue"):
        q.remove(bs[1])
    q.remove(bs[0])
    with pytest.raises(BlockStateError, match="block 0 is not in the free queue"):
        q.remove(bs[0])
    assert len(q) == 0
    q.check()


def test_iter_after() -> None:
    bs = blocks(5)
    q = LruFreeQueue(bs)
    assert [b.block_id for b in q.iter_after(None)] == [0, 1, 2, 3, 4]
    assert [b.block_id for b in q.iter_after(bs[1])] == [2, 3, 4]
    assert list(q.iter_after(bs[4])) == []
    q.remove(bs[3])
    with pytest.raises(BlockStateError, match="block 3 is not in the free queue"):
        next(q.iter_after(bs[3]))


def test_iteration_survives_removing_the_current_block() -> None:
    bs = blocks(6)
    q = LruFreeQueue(bs)
    seen = []
    for block in q:
        seen.append(block.block_id)
        if block.block_id % 2 == 0:
            q.remove(block)
    assert seen == [0, 1, 2, 3, 4, 5]
    assert ids(q) == [1, 3, 5]
    q.check()


def test_check_detects_broken_links() -> None:
    bs = blocks(3)
    q = LruFreeQueue(bs)
    bs[1]._prev = bs[2]
    with pytest.raises(InvariantError, match="link broken"):
        q.check()
    bs[1]._prev = bs[0]
    q.check()
    q._len += 1
    with pytest.raises(InvariantError, match="holds 3 blocks but counts 4"):
        q.check()
    q._len -= 1
    bs[2]._next = bs[0]
    with pytest.raises(InvariantError, match="link broken"):
        q.check()


# -- O(1) and allocation-free --------------------------------------------------------------


def _lines_run(fn: Callable[[], object]) -> int:
    """Lines of kvoffload's own code that ``fn()`` executes (a work count, not a clock)."""
    count = 0

    def local(frame: FrameType, event: str, arg: object) -> object:
        nonlocal count
        if event == "line":
            count += 1
        return local

    def trace(frame: FrameType, event: str, arg: object) -> object:
        return local if f"{os.sep}kvoffload{os.sep}" in frame.f_code.co_filename else None

    previous = sys.gettrace()
    sys.settrace(trace)
    try:
        fn()
    finally:
        sys.settrace(previous)
    return count


def _cycle_lines(size: int, ops: int) -> int:
    bs = blocks(size)
    q = LruFreeQueue(bs)
    middle = bs[size // 2 : size // 2 + ops]

    def cycle() -> None:
        for b in middle:
            q.remove(b)
        for b in middle:
            q.append(b)
        for _ in range(ops):
            q.append(q.popleft())

    return _lines_run(cycle)


def test_operations_do_not_depend_on_queue_length() -> None:
    # An O(n) remove or append would run ~200x more lines on the large queue; O(1) ones
    # run exactly as many on both.
    small = _cycle_lines(2_000, 1_000)
    large = _cycle_lines(400_000, 1_000)
    assert small > 0
    assert large == small, (small, large)


def _net_allocations(fn: Callable[[], None]) -> tuple[int, int]:
    """Blocks and traced bytes still allocated after ``fn`` (with gc off)."""
    gc.collect()
    gc.disable()
    try:
        fn()  # warm up caches, interned method objects, ...
        tracemalloc.start()
        before_blocks = sys.getallocatedblocks()
        before_bytes = tracemalloc.get_traced_memory()[0]
        fn()
        after_blocks = sys.getallocatedblocks()
        after_bytes = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
    finally:
        gc.enable()
    return after_blocks - before_blocks, after_bytes - before_bytes


def test_operations_allocate_no_objects() -> None:
    bs = blocks(200)
    q = LruFreeQueue(bs)
    cycles = 20_000

    def churn() -> None:
        append, remove, popleft = q.append, q.remove, q.popleft
        for i in range(cycles):
            b = bs[i % 200]
            remove(b)
            append(b)
            append(popleft())

    delta_blocks, delta_bytes = _net_allocations(churn)
    # 60,000 operations: even one object per operation would leave tens of thousands.
    assert delta_blocks < 100, delta_blocks
    assert delta_bytes < 4096, delta_bytes
    assert len(q) == 200
    q.check()


# -- model-based property test -------------------------------------------------------------

N = 12


class FreeQueueMachine(RuleBasedStateMachine):
    """LruFreeQueue against a plain list (LRU first)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = blocks(N)
        self.queue = LruFreeQueue(self.blocks[: N // 2])
        self.model: list[CpuBlock] = list(self.blocks[: N // 2])

    def outside(self) -> list[CpuBlock]:
        return [b for b in self.blocks if b not in self.model]

    @rule(data=st.data())
    def append(self, data: st.DataObject) -> None:
        block = data.draw(st.sampled_from(self.blocks))
        if block in self.model:
            with pytest.raises(BlockStateError):
                self.queue.append(block)
        else:
            self.queue.append(block)
            self.model.append(block)

    @rule(data=st.data())
    def append_n(self, data: st.DataObject) -> None:
        chosen = data.draw(st.lists(st.sampled_from(self.blocks), max_size=5))
        expected = list(self.model)
        failed = False
        for block in chosen:
            if block in expected:
                failed = True
                break
            expected.append(block)
        if failed:
            with pytest.raises(BlockStateError):
                self.queue.append_n(chosen)
        else:
            self.queue.append_n(chosen)
        self.model = expected

    @rule(data=st.data())
    def remove(self, data: st.DataObject) -> None:
        block = data.draw(st.sampled_from(self.blocks))
        if block in self.model:
            self.queue.remove(block)
            self.model.remove(block)
        else:
            with pytest.raises(BlockStateError):
                self.queue.remove(block)

    @rule()
    def popleft(self) -> None:
        if self.model:
            assert self.queue.popleft() is self.model.pop(0)
        else:
            with pytest.raises(OutOfBlocksError):
                self.queue.popleft()

    @rule(n=st.integers(min_value=0, max_value=N + 1))
    def popleft_n(self, n: int) -> None:
        if n <= len(self.model):
            assert self.queue.popleft_n(n) == self.model[:n]
            del self.model[:n]
        else:
            with pytest.raises(OutOfBlocksError):
                self.queue.popleft_n(n)

    @precondition(lambda self: bool(self.model))
    @rule(data=st.data())
    def iter_after(self, data: st.DataObject) -> None:
        block = data.draw(st.sampled_from(self.model))
        at = self.model.index(block)
        assert list(self.queue.iter_after(block)) == self.model[at + 1 :]

    @invariant()
    def matches_model(self) -> None:
        assert len(self.queue) == len(self.model)
        assert list(self.queue) == self.model
        assert self.queue.check() == self.model
        for block in self.blocks:
            assert block.is_free == (block in self.model)


FreeQueueMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None
)
TestFreeQueueMachine = FreeQueueMachine.TestCase
