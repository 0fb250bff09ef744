from __future__ import annotations

import dataclasses
import os
import sys
import tracemalloc
from types import FrameType
from typing import Any

import pytest
import torch

from kvoffload.errors import BlockStateError, InvariantError, OutOfBlocksError
from kvoffload.hashing import BlockHash
from kvoffload.pool.block_pool import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    CpuBlockPool,
    PoolStatistics,
)
from kvoffload.pool.free_queue import CpuBlock


def h(i: int) -> BlockHash:
    return BlockHash(i.to_bytes(32, "little"))


def free_ids(pool: CpuBlockPool) -> list[int]:
    """Block ids in the free queue, LRU first (a walk of the list)."""
    return [b.block_id for b in pool._free]


def store(pool: CpuBlockPool, keys: list[int]) -> list[CpuBlock]:
    """Allocate and publish one block per key, keeping the references."""
    blocks = pool.allocate(len(keys))
    for block, key in zip(blocks, keys, strict=True):
        assert pool.publish(block, h(key))
    return blocks


def total_refs(pool: CpuBlockPool) -> int:
    return sum(pool.block(i).ref_cnt for i in range(pool.num_blocks))


# -- construction and sizes ----------------------------------------------------------------


def test_new_pool() -> None:
    pool = CpuBlockPool(4)
    assert pool.num_blocks == 4
    assert pool.num_free == 4
    assert pool.num_cached == 0
    assert pool.usage == 0.0
    assert free_ids(pool) == [0, 1, 2, 3]
    assert repr(pool) == "CpuBlockPool(num_blocks=4, num_free=4, num_cached=0)"
    pool.check_invariants()


@pytest.mark.parametrize("n", [0, -1])
def test_bad_size(n: int) -> None:
    with pytest.raises(ValueError, match=f"num_blocks must be >= 1, got {n}"):
        CpuBlockPool(n)


def test_records_are_slotted() -> None:
    pool = CpuBlockPool(2, enable_events=True)
    records: list[object] = [
        pool,
        pool.block(0),
        pool.statistics(),
        BlockStored(h(1), pool.block(0).block_id),
        BlockRemoved(h(1), pool.block(0).block_id),
        AllBlocksCleared(),
    ]
    for record in records:
        assert not hasattr(record, "__dict__"), type(record).__name__


def test_block_by_id() -> None:
    pool = CpuBlockPool(3)
    assert [pool.block(i).block_id for i in range(3)] == [0, 1, 2]
    assert pool.block(1) is pool.block(1)
    for bad in (-1, 3):
        with pytest.raises(IndexError, match=rf"block_id {bad} out of range \[0, 3\)"):
            pool.block(bad)


def test_usage() -> None:
    pool = CpuBlockPool(4)
    blocks = pool.allocate(3)
    assert pool.usage == 0.75
    pool.free(blocks[:1])
    assert pool.usage == 0.5
    pool.touch(blocks[1:2])  # a second reference changes nothing
    assert pool.usage == 0.5


# -- allocate ------------------------------------------------------------------------------


def test_allocate_takes_lru_blocks_with_one_reference() -> None:
    pool = CpuBlockPool(5)
    blocks = pool.allocate(3)
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert all(b.ref_cnt == 1 and not b.is_free for b in blocks)
    assert pool.num_free == 2
    assert free_ids(pool) == [3, 4]
    assert pool.allocate(0) == []
    pool.check_invariants()


def test_allocate_negative() -> None:
    pool = CpuBlockPool(2)
    with pytest.raises(ValueError, match="negative number of blocks: -1"):
        pool.allocate(-1)
    assert pool.num_free == 2


def test_allocate_beyond_free_changes_nothing() -> None:
    pool = CpuBlockPool(4)
    held = store(pool, [1, 2])
    pool.free(held[1:])
    before = (free_ids(pool), pool.statistics())
    with pytest.raises(OutOfBlocksError, match=r"cannot allocate 4 CPU block\(s\): only 3 free"):
        pool.allocate(4)
    assert (free_ids(pool), pool.statistics()) == before
    assert pool.is_cached(h(2))
    pool.check_invariants()


def test_allocate_evicts_published_free_blocks_lru_first() -> None:
    pool = CpuBlockPool(3)
    pool.free(store(pool, [10, 11, 12]))  # freed in order: 10 is least recently used
    evicted: list[BlockHash] = []
    taken = pool.allocate(2, evicted=evicted)
    assert [b.block_id for b in taken] == [0, 1]
    assert evicted == [h(10), h(11)]
    assert all(b.block_hash is None for b in taken)
    assert not pool.is_cached(h(10))
    assert not pool.is_cached(h(11))
    assert pool.get_cached(h(12)) is pool.block(2)
    assert pool.statistics().evictions == 2
    pool.check_invariants()


def test_allocate_unpublished_blocks_count_no_eviction() -> None:
    pool = CpuBlockPool(2)
    evicted: list[BlockHash] = []
    pool.free(pool.allocate(2, evicted=evicted))
    pool.allocate(2, evicted=evicted)
    assert evicted == []
    assert pool.statistics().evictions == 0


def test_allocate_protect_skips_and_keeps_lru_position() -> None:
    pool = CpuBlockPool(5)
    pool.free(store(pool, [0, 1, 2, 3, 4]))
    b0, b1 = pool.block(0), pool.block(1)
    taken = pool.allocate(2, protect=[b0, b1])
    assert [b.block_id for b in taken] == [2, 3]
    assert free_ids(pool) == [0, 1, 4]
    assert pool.is_cached(h(0))
    assert pool.is_cached(h(1))
    pool.check_invariants()


def test_allocate_protect_counts_only_free_protected_blocks() -> None:
    pool = CpuBlockPool(4)
    held = pool.allocate(1)  # referenced, so protecting it frees nothing up
    with pytest.raises(OutOfBlocksError, match=r"cannot allocate 2 CPU block\(s\): only 1 free"):
        pool.allocate(2, protect={pool.block(1), pool.block(2), held[0]})
    assert pool.num_free == 3
    assert [b.block_id for b in pool.allocate(1, protect=[pool.block(1), pool.block(2)])] == [3]
    pool.check_invariants()


# -- FM-22 at the pool level: blocks a caller holds or protects are never the victims -------


def test_fm22_touched_blocks_are_never_evicted_by_the_next_allocate() -> None:
    pool = CpuBlockPool(4)
    pool.free(store(pool, [2, 3, 4, 5]))  # full: every block published and free
    hits = pool.lookup([h(2), h(3)])
    pool.touch(hits)
    new = pool.allocate(2)
    assert not {b.block_id for b in new} & {b.block_id for b in hits}
    assert pool.lookup([h(2), h(3)]) == hits
    with pytest.raises(OutOfBlocksError):
        pool.allocate(1)
    assert pool.is_cached(h(2))
    pool.check_invariants()


def test_fm22_protected_keys_survive_a_full_pool() -> None:
    pool = CpuBlockPool(4)
    pool.free(store(pool, [2, 7, 8, 9]))  # key 2 is the LRU block
    present = pool.get_cached(h(2))
    assert present is not None
    new = pool.allocate(3, protect=[present])
    assert present not in new
    assert pool.is_cached(h(2))
    assert free_ids(pool) == [present.block_id]


# -- touch and free ------------------------------------------------------------------------


def test_touch_takes_a_reference() -> None:
    pool = CpuBlockPool(3)
    b = pool.block(1)
    pool.touch([b])
    assert b.ref_cnt == 1
    assert free_ids(pool) == [0, 2]
    pool.touch([b, b])
    assert b.ref_cnt == 3
    assert pool.num_free == 2
    pool.touch([])
    pool.check_invariants()


def test_free_order_sets_eviction_order() -> None:
    pool = CpuBlockPool(4)
    blocks = pool.allocate(4)
    pool.free(blocks[::-1])  # tail first
    assert free_ids(pool) == [3, 2, 1, 0]
    assert [b.block_id for b in pool.allocate(2)] == [3, 2]


def test_free_keeps_block_while_referenced() -> None:
    pool = CpuBlockPool(2)
    (b,) = pool.allocate(1)
    pool.touch([b])
    pool.free([b])
    assert b.ref_cnt == 1
    assert pool.num_free == 1
    pool.free([b])
    assert b.ref_cnt == 0
    assert free_ids(pool) == [1, 0]


def test_fm13_same_block_twice_in_one_free() -> None:
    pool = CpuBlockPool(3)
    (b,) = pool.allocate(1)
    pool.touch([b])
    assert b.ref_cnt == 2
    pool.free([b, b])
    assert b.ref_cnt == 0
    walk = free_ids(pool)
    assert walk.count(b.block_id) == 1
    assert pool.num_free == len(walk) == 3
    pool.check_invariants()


def test_fm14_double_free_raises_and_changes_nothing() -> None:
    pool = CpuBlockPool(4)
    a, b = pool.allocate(2)
    pool.free([b])
    before = (free_ids(pool), a.ref_cnt, b.ref_cnt, pool.statistics())
    with pytest.raises(
        BlockStateError, match=r"free of block 1 whose ref_cnt is 0 \(double free\)"
    ):
        pool.free([b])
    with pytest.raises(BlockStateError, match="block 1"):
        pool.free([a, b])  # a's decrement is rolled back
    assert (free_ids(pool), a.ref_cnt, b.ref_cnt, pool.statistics()) == before
    assert b.ref_cnt == 0  # never clamped below zero or re-queued
    pool.check_invariants()
    first = pool.allocate(1)
    second = pool.allocate(1)
    assert first[0] is not second[0]
    assert len({first[0].block_id, second[0].block_id, a.block_id}) == 3


def test_fm14_same_block_twice_at_ref_one_rolls_back() -> None:
    pool = CpuBlockPool(2)
    (b,) = pool.allocate(1)
    with pytest.raises(BlockStateError, match="double free"):
        pool.free([b, b])
    assert b.ref_cnt == 1
    assert free_ids(pool) == [1]
    pool.check_invariants()


# -- publish, unpublish, lookup --------------------------------------------------------------


def test_publish_and_lookup() -> None:
    pool = CpuBlockPool(4)
    blocks = store(pool, [1, 2, 3])
    assert pool.num_cached == 3
    assert [b.block_hash for b in blocks] == [h(1), h(2), h(3)]
    assert pool.lookup([h(1), h(2), h(3), h(4)]) == blocks
    assert pool.lookup([h(1), h(9), h(3)]) == blocks[:1]  # stops at the first miss
    assert pool.lookup([h(2)]) == [blocks[1]]
    assert pool.lookup([]) == []
    assert pool.is_cached(h(3))
    assert not pool.is_cached(h(4))
    assert pool.get_cached(h(2)) is blocks[1]
    assert pool.get_cached(h(4)) is None
    # lookup takes no reference
    assert [b.ref_cnt for b in blocks] == [1, 1, 1]


def test_lookup_sees_free_published_blocks() -> None:
    pool = CpuBlockPool(2)
    blocks = store(pool, [1, 2])
    pool.free(blocks)
    assert pool.lookup([h(1), h(2)]) == blocks
    assert pool.num_free == 2


def test_publish_unreferenced_raises() -> None:
    pool = CpuBlockPool(2)
    with pytest.raises(BlockStateError, match="publish of block 0 with ref_cnt 0"):
        pool.publish(pool.block(0), h(1))
    assert pool.num_cached == 0
    assert pool.block(0).block_hash is None


def test_publish_is_idempotent_for_the_same_hash() -> None:
    pool = CpuBlockPool(2)
    (b,) = store(pool, [1])
    assert pool.publish(b, h(1))
    assert pool.num_cached == 1


def test_publish_under_a_second_hash_raises() -> None:
    pool = CpuBlockPool(2)
    (b,) = store(pool, [1])
    with pytest.raises(BlockStateError, match="block 0 is already published under"):
        pool.publish(b, h(2))
    assert b.block_hash == h(1)
    assert not pool.is_cached(h(2))


def test_publish_a_hash_another_block_holds() -> None:
    pool = CpuBlockPool(3)
    (first,) = store(pool, [7])
    (second,) = pool.allocate(1)
    assert pool.publish(second, h(7)) is False
    assert pool.get_cached(h(7)) is first
    assert second.block_hash is None
    assert pool.num_cached == 1
    pool.free([second])
    assert pool.get_cached(h(7)) is first
    pool.check_invariants()


def test_unpublish() -> None:
    pool = CpuBlockPool(2)
    (b,) = store(pool, [1])
    assert pool.unpublish(b) is True
    assert b.block_hash is None
    assert b.ref_cnt == 1
    assert pool.lookup([h(1)]) == []
    assert pool.unpublish(b) is False
    # the hash can be published again, by any referenced block
    (other,) = pool.allocate(1)
    assert pool.publish(other, h(1))
    pool.check_invariants()


def test_unpublish_all_ignores_references() -> None:
    pool = CpuBlockPool(3, enable_events=True)
    held = store(pool, [1, 2])
    pool.take_events()
    assert pool.unpublish_all() == 2
    assert pool.num_cached == 0
    assert all(b.block_hash is None and b.ref_cnt == 1 for b in held)
    assert pool.take_events() == [
        BlockRemoved(h(1), held[0].block_id),
        BlockRemoved(h(2), held[1].block_id),
    ]
    assert pool.unpublish_all() == 0
    pool.check_invariants()


def test_reset_prefix_cache_refuses_while_referenced() -> None:
    pool = CpuBlockPool(3)
    blocks = store(pool, [1, 2])
    assert pool.reset_prefix_cache() is False
    assert pool.num_cached == 2
    pool.free(blocks[:1])
    assert pool.reset_prefix_cache() is False
    assert pool.lookup([h(1), h(2)]) == blocks
    pool.free(blocks[1:])
    assert pool.reset_prefix_cache() is True
    assert pool.num_cached == 0
    assert pool.lookup([h(1)]) == []
    assert all(pool.block(i).block_hash is None for i in range(3))
    pool.check_invariants()


# -- events and statistics -----------------------------------------------------------------


def test_events_in_order() -> None:
    pool = CpuBlockPool(2, enable_events=True)
    a, b = store(pool, [1, 2])
    pool.unpublish(b)
    pool.free([a, b])
    (c,) = pool.allocate(1)  # a: evicted
    (d,) = pool.allocate(1)  # b: unpublished already, no event
    assert c is a
    assert d is b
    assert pool.take_events() == [
        BlockStored(h(1), a.block_id),
        BlockStored(h(2), b.block_id),
        BlockRemoved(h(2), b.block_id),
        BlockRemoved(h(1), a.block_id),
    ]
    assert pool.take_events() == []
    pool.publish(c, h(3))
    pool.free([c, d])
    assert pool.reset_prefix_cache()
    assert pool.take_events() == [BlockStored(h(3), c.block_id), AllBlocksCleared()]


def test_no_events_when_disabled() -> None:
    pool = CpuBlockPool(2)
    blocks = store(pool, [1, 2])
    pool.unpublish(blocks[0])
    pool.free(blocks)
    pool.allocate(2)
    assert pool.take_events() == []


def test_events_are_frozen() -> None:
    event = BlockStored(h(1), CpuBlockPool(1).block(0).block_id)
    with pytest.raises(dataclasses.FrozenInstanceError):
        event.block_id = 3  # type: ignore[misc]


def test_statistics() -> None:
    pool = CpuBlockPool(3)
    assert pool.statistics() == PoolStatistics(
        num_blocks=3, num_free=3, num_cached=0, lookups=0, hit_blocks=0, evictions=0
    )
    blocks = store(pool, [1, 2, 3])
    pool.lookup([h(1), h(2), h(5)])
    pool.lookup([h(9)])
    pool.free(blocks)
    pool.allocate(1)
    stats = pool.statistics()
    assert stats == PoolStatistics(
        num_blocks=3, num_free=2, num_cached=2, lookups=2, hit_blocks=2, evictions=1
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        stats.lookups = 0  # type: ignore[misc]


# -- check_invariants catches breaches -----------------------------------------------------


def test_check_invariants_detects_a_free_block_outside_the_queue() -> None:
    pool = CpuBlockPool(3)
    (b,) = pool.allocate(1)
    b.ref_cnt = 0  # as if a decref skipped the queue
    with pytest.raises(InvariantError, match="block 0: ref_cnt=0 but not in the free queue"):
        pool.check_invariants()


def test_check_invariants_detects_a_referenced_block_in_the_queue() -> None:
    pool = CpuBlockPool(3)
    pool.block(2).ref_cnt = 1
    with pytest.raises(InvariantError, match="block 2: ref_cnt=1 but in the free queue"):
        pool.check_invariants()


def test_check_invariants_detects_negative_refs_and_stale_hashes() -> None:
    pool = CpuBlockPool(2)
    (b,) = store(pool, [1])
    b.ref_cnt = -1
    with pytest.raises(InvariantError, match="ref_cnt -1"):
        pool.check_invariants()
    b.ref_cnt = 1
    pool.check_invariants()
    b.block_hash = h(2)
    with pytest.raises(InvariantError, match="hash"):
        pool.check_invariants()


# -- FM-16 and FM-24 ---------------------------------------------------------------------


def test_fm16_hit_miss_cycles_return_to_baseline() -> None:
    pool = CpuBlockPool(32)
    hot = [h(i) for i in range(8)]
    pool.free(store(pool, list(range(8))))
    next_key = 1000
    baseline_cached = None
    for cycle in range(10_000):
        # a hit: the hot prompt, then a suffix that misses and is stored
        hits = pool.lookup(hot)
        assert len(hits) == 8, cycle
        pool.touch(hits)
        new = pool.allocate(2)
        for block in new:
            assert pool.publish(block, h(next_key))
            next_key += 1
        pool.free([*hits, *new][::-1])
        # a miss whose store fails: nothing may stay published or referenced
        assert pool.lookup([h(next_key)]) == []
        failed = pool.allocate(3)
        pool.free(failed)
        next_key += 1

        assert pool.num_free == 32, cycle
        assert total_refs(pool) == 0, cycle
        if cycle == 20:
            baseline_cached = pool.num_cached
        if baseline_cached is not None:
            assert pool.num_cached == baseline_cached, cycle
        if cycle % 1000 == 0:
            pool.check_invariants()
    assert baseline_cached is not None
    assert 8 < baseline_cached <= 32
    pool.check_invariants()


def _lines_of_failed_allocate(pool: CpuBlockPool, n: int, **kwargs: Any) -> int:
    """Lines of kvoffload's code that one refused ``pool.allocate(n, ...)`` runs."""
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
        with pytest.raises(OutOfBlocksError):
            pool.allocate(n, **kwargs)
    finally:
        sys.settrace(previous)
    assert count > 0
    return count


def test_fm24_full_pool_of_referenced_blocks_fails_fast() -> None:
    pool = CpuBlockPool(1000)
    held = pool.allocate(1000)
    small = CpuBlockPool(10)
    small_held = small.allocate(10)
    # Failing fast: a refused allocate does as much work on 1,000 referenced blocks as on
    # 10 (it never walks them), counted in lines of kvoffload's code run, not in seconds.
    assert _lines_of_failed_allocate(pool, 3) == _lines_of_failed_allocate(small, 3)
    small.free(small_held)
    for _ in range(1000):
        with pytest.raises(OutOfBlocksError) as info:
            pool.allocate(3)
    assert info.value.requested == 3
    assert info.value.num_free == 0
    assert "cannot allocate 3 CPU block(s): only 0 free" in str(info.value)
    # a freed block is usable at once
    pool.free(held[:1])
    assert pool.allocate(1) == held[:1]
    pool.check_invariants()


def test_fm24_only_protected_blocks_free_fails_fast() -> None:
    pool = CpuBlockPool(100)
    held = pool.allocate(98)
    with pytest.raises(OutOfBlocksError, match=r"only 0 free"):
        pool.allocate(1, protect=[pool.block(98), pool.block(99)])
    small = CpuBlockPool(4)
    small_held = small.allocate(2)
    # As much work with 98 referenced blocks as with 2: the refusal never walks them.
    assert _lines_of_failed_allocate(
        pool, 1, protect=[pool.block(98), pool.block(99)]
    ) == _lines_of_failed_allocate(small, 1, protect=[small.block(2), small.block(3)])
    small.free(small_held)
    pool.free(held)
    pool.check_invariants()


def test_fm19_many_cycles_keep_memory_flat_and_handles_plain() -> None:
    # FM-19: 100,000 allocate/publish/free cycles hold no growing state, and a block
    # handle is a plain record (an int id), never a view that pins pool storage.
    pool = CpuBlockPool(64)
    block = pool.allocate(1)[0]
    assert isinstance(block.block_id, int)
    assert not any(isinstance(getattr(block, f), torch.Tensor) for f in ("block_id", "ref_cnt"))
    pool.free([block])
    hashes = [bytes([i % 256, i // 256]) for i in range(512)]

    def cycle(i: int) -> None:
        blocks = pool.allocate(4)
        for j, b in enumerate(blocks):
            pool.publish(b, hashes[(4 * i + j) % 512])
        pool.free(blocks[::-1])

    for i in range(1_000):
        cycle(i)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(100_000):
            cycle(i)
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 64 * 1024, f"pool state grew by {grown} bytes over 100,000 cycles"
    pool.check_invariants()
    assert pool.num_free == 64
