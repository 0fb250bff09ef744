"""Retention priorities and bounded retention in `CpuBlockPool`."""

from __future__ import annotations

import pytest

from kvoffload.errors import BlockStateError, InvalidInputError
from kvoffload.hashing import BlockHash
from kvoffload.pool.block_pool import CpuBlockPool
from kvoffload.pool.policies import POLICY_NAMES


def h(i: int) -> BlockHash:
    return BlockHash(i.to_bytes(16, "little", signed=True))


def store(pool: CpuBlockPool, keys: list[int], priority: int = 0) -> None:
    blocks = pool.allocate(len(keys))
    for block, key in zip(blocks, keys, strict=True):
        assert pool.publish(block, h(key), priority=priority)
    pool.free(blocks[::-1])
    pool.check_invariants()


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_lower_priorities_are_evicted_first(policy: str) -> None:
    pool = CpuBlockPool(6, policy=policy, max_retained_blocks=0)
    store(pool, [10, 11], priority=2)
    store(pool, [20, 21], priority=1)
    store(pool, [30, 31], priority=0)
    order = []
    for _ in range(6):
        evicted: list[BlockHash] = []
        pool.allocate(1, evicted=evicted)
        pool.check_invariants()
        order.append(int.from_bytes(evicted[0], "little", signed=True) // 10)
    assert order == [3, 3, 2, 2, 1, 1]


def test_lru_decides_within_a_level() -> None:
    pool = CpuBlockPool(4)
    store(pool, [1, 2], priority=1)
    store(pool, [3, 4], priority=1)
    evicted: list[BlockHash] = []
    pool.allocate(3, evicted=evicted)
    assert evicted == [h(2), h(1), h(4)]  # freed tail first, oldest level-1 blocks first
    pool.check_invariants()


def test_a_shared_block_keeps_its_highest_priority() -> None:
    pool = CpuBlockPool(3)
    store(pool, [1], priority=3)
    (block,) = pool.lookup([h(1)])
    pool.touch([block], priority=0)
    pool.free([block])
    assert block.priority == 3
    store(pool, [2, 3])
    evicted: list[BlockHash] = []
    pool.allocate(3, evicted=evicted)
    assert evicted[-1] == h(1)
    assert block.priority == 0  # reallocated: the new content starts at 0
    pool.check_invariants()


def test_default_priority_keeps_the_plain_path() -> None:
    pool = CpuBlockPool(4)
    store(pool, [1, 2])
    assert pool._plain
    store(pool, [3], priority=1)
    assert not pool._plain
    pool.allocate(4)
    assert pool._plain  # every raised block was reallocated
    pool.check_invariants()


@pytest.mark.parametrize("bad", [-1, 1.5, "1", 1 << 20])
def test_a_bad_priority_is_refused(bad: object) -> None:
    pool = CpuBlockPool(2)
    (block,) = pool.allocate(1)
    with pytest.raises(InvalidInputError, match="priority"):
        pool.touch([block], priority=bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match="priority"):
        pool.publish(block, h(1), priority=bad)  # type: ignore[arg-type]
    assert block.ref_cnt == 1
    assert block.block_hash is None
    pool.check_invariants()


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_a_retained_prefix_survives_a_scan(policy: str) -> None:
    pool = CpuBlockPool(20, policy=policy, max_retained_blocks=4)
    system = [1, 2, 3, 4]
    store(pool, system)
    assert len(pool.retain([h(k) for k in system], owner="sys")) == 4
    for start in range(100, 400, 8):
        store(pool, list(range(start, start + 8)))
    assert [b.block_hash for b in pool.lookup([h(k) for k in system])] == [h(k) for k in system]
    assert pool.release_retained("sys") == 4
    pool.check_invariants()
    for start in range(500, 600, 8):
        store(pool, list(range(start, start + 8)))
    if policy == "lru":
        assert pool.lookup([h(1)]) == []  # released: evictable again


def test_the_retention_bound_is_enforced() -> None:
    pool = CpuBlockPool(10, max_retained_blocks=3)
    store(pool, [1, 2, 3, 4])
    pool.retain([h(1), h(2)], owner="a")
    pool.retain([h(1), h(2)], owner="b")  # the same blocks: no more distinct ones
    assert pool.num_retained == 2
    with pytest.raises(InvalidInputError, match="max_retained_blocks=3"):
        pool.retain([h(1), h(2), h(3), h(4)], owner="c")
    assert pool.num_retained == 2
    assert pool.retained_owners == ("a", "b")
    pool.check_invariants()
    pool.release_retained("a")
    assert pool.lookup([h(1)])[0].ref_cnt == 1  # b still holds it
    pool.release_retained("b")
    with pytest.raises(InvalidInputError, match="'b'"):
        pool.release_retained("b")
    assert pool.num_free == 10
    pool.check_invariants()


def test_max_retained_blocks_must_leave_room() -> None:
    with pytest.raises(ValueError, match="max_retained_blocks"):
        CpuBlockPool(4, max_retained_blocks=4)
    assert CpuBlockPool(100).max_retained_blocks == 10


def test_retain_stops_at_the_first_unpublished_hash() -> None:
    pool = CpuBlockPool(6, max_retained_blocks=2)
    store(pool, [1, 3])
    assert len(pool.retain([h(1), h(2), h(3)], owner="x")) == 1
    assert pool.num_retained == 1


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_a_retained_block_with_a_copy_in_flight_is_never_evicted(policy: str) -> None:
    pool = CpuBlockPool(4, policy=policy, max_retained_blocks=2)
    store(pool, [1, 2])
    pool.retain([h(1), h(2)], owner="sys")
    hit = pool.lookup([h(1), h(2)])
    pool.touch(hit, priority=5)  # a load in flight pins them too
    pool.release_retained("sys")
    free_before = pool.num_free
    assert free_before == 2
    pool.allocate(2)
    assert all(b.ref_cnt == 1 and b.block_hash is not None for b in hit)
    pool.check_invariants()
    pool.free(hit)
    pool.check_invariants()


# -- random operations: the invariants, the level order and retention, for every policy ---

from hypothesis import settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule  # noqa: E402

NUM = 8
PRIORITY = st.integers(0, 3)


def _machine(policy: str) -> type[RuleBasedStateMachine]:
    class PriorityMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.pool = CpuBlockPool(NUM, policy=policy, max_retained_blocks=3)
            self.held: list[object] = []  # one entry per reference the test holds
            self.owners: set[str] = set()
            self.next_key = 0

        @rule(n=st.integers(0, 3), priority=PRIORITY)
        def store(self, n: int, priority: int) -> None:
            blocks = self.pool.allocate(min(n, self.pool.num_free))
            for block in blocks:
                self.next_key += 1
                self.pool.publish(block, h(self.next_key), priority=priority)
            self.held.extend(blocks)

        @rule(data=st.data())
        def evict_one(self, data: st.DataObject) -> None:
            free = [b for b in self.pool._blocks if b.ref_cnt == 0]
            if not free:
                return
            was = {id(b): b.priority for b in free}
            (block,) = self.pool.allocate(1)
            # The victim is of the lowest level free; its priority is reset for new data.
            assert was[id(block)] == min(was.values())
            assert block.priority == 0
            self.held.append(block)

        @rule(data=st.data(), priority=PRIORITY)
        def touch(self, data: st.DataObject, priority: int) -> None:
            cached = list(self.pool._cached.values())
            if cached:
                block = data.draw(st.sampled_from(cached))
                self.pool.touch([block], priority=priority)
                self.held.append(block)

        @rule(data=st.data())
        def free(self, data: st.DataObject) -> None:
            if self.held:
                i = data.draw(st.integers(0, len(self.held) - 1))
                self.pool.free([self.held.pop(i)])  # type: ignore[list-item]

        @rule(owner=st.sampled_from(["a", "b"]), n=st.integers(1, 4))
        def retain(self, owner: str, n: int) -> None:
            keys = [b.block_hash for b in self.pool._cached.values()][:n]
            before = self.pool.num_retained
            try:
                run = self.pool.retain(keys, owner=owner)  # type: ignore[arg-type]
            except InvalidInputError:
                assert self.pool.num_retained == before
                return
            if run:
                self.owners.add(owner)

        @rule(owner=st.sampled_from(["a", "b"]))
        def release(self, owner: str) -> None:
            if owner in self.owners:
                self.pool.release_retained(owner)
                self.owners.discard(owner)
            else:
                with pytest.raises(InvalidInputError):
                    self.pool.release_retained(owner)

        @invariant()
        def consistent(self) -> None:
            self.pool.check_invariants()
            for owner in self.pool.retained_owners:
                for block in self.pool._retained.held(owner):
                    assert block.ref_cnt >= 1  # never free, never evicted

    PriorityMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=30)
    return PriorityMachine


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_priority_state_machine(policy: str) -> None:
    _machine(policy).TestCase().runTest()


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_raise_priority_moves_a_free_or_held_block_up_without_a_reference(policy: str) -> None:
    pool = CpuBlockPool(6, policy=policy)
    store(pool, [10, 11], priority=1)
    store(pool, [20, 21, 30, 31])
    free_block = pool.get_cached(h(20))
    held_block = pool.get_cached(h(30))
    assert free_block is not None
    assert held_block is not None
    pool.touch([held_block])
    pool.raise_priority(free_block, 2)
    pool.raise_priority(held_block, 3)
    pool.raise_priority(free_block, 1)  # never lowered
    assert (free_block.priority, free_block.ref_cnt) == (2, 0)
    assert (held_block.priority, held_block.ref_cnt) == (3, 1)
    pool.check_invariants()
    pool.free([held_block])
    order = []
    for _ in range(6):
        evicted: list[BlockHash] = []
        pool.allocate(1, evicted=evicted)
        pool.check_invariants()
        order.append(int.from_bytes(evicted[0], "little", signed=True))
    assert set(order[:2]) == {21, 31}  # the priority-0 blocks go first
    assert set(order[2:4]) == {10, 11}
    assert order[4:] == [20, 30]
    with pytest.raises(InvalidInputError, match="priority"):
        pool.raise_priority(free_block, -1)
    with pytest.raises(BlockStateError, match="another pool"):
        CpuBlockPool(2).raise_priority(free_block, 1)
