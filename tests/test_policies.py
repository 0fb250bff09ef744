"""Each eviction policy against its reference model, and the pool's checks on policies."""

from __future__ import annotations

from collections.abc import Collection, Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffload.errors import ConfigError, InvariantError
from kvoffload.hashing import BlockHash
from kvoffload.pool.block_pool import CpuBlockPool
from kvoffload.pool.free_queue import CpuBlock, LruFreeQueue
from kvoffload.pool.policies import (
    POLICY_NAMES,
    STATIC_POLICY_NAMES,
    AdaptivePolicy,
    ArcPolicy,
    EvictionPolicy,
    LruPolicy,
    PrefixFrequencyPolicy,
    S3FifoPolicy,
    make_policy,
)
from tests.policy_models import MODELS

NUM_BLOCKS = 12


def h(i: int) -> BlockHash:
    return BlockHash(i.to_bytes(8, "little"))


OPS = st.lists(
    st.one_of(
        st.tuples(
            st.just("store"),
            st.lists(st.integers(0, 30), max_size=6, unique=True),
            st.lists(st.integers(0, NUM_BLOCKS - 1), max_size=3),
        ),
        st.tuples(st.just("hit"), st.lists(st.integers(0, 30), max_size=6), st.just([])),
        st.tuples(
            st.just("touch"), st.lists(st.integers(0, NUM_BLOCKS - 1), max_size=4), st.just([])
        ),
        st.tuples(st.just("free"), st.lists(st.integers(0, 40), max_size=5), st.just([])),
        st.tuples(
            st.just("unpublish"), st.lists(st.integers(0, NUM_BLOCKS - 1), max_size=2), st.just([])
        ),
    ),
    max_size=60,
)


def drive(
    name: str, ops: list[tuple[str, list[int], list[int]]], generic_lru: bool = False
) -> None:
    """Run ``ops`` through a pool with policy ``name`` and through the model; compare."""
    pool = CpuBlockPool(NUM_BLOCKS, policy=name)
    if generic_lru:
        pool._hooked = pool.policy  # the protocol path, not the inlined one
        pool._plain = False
        pool._levels._hooked = pool.policy  # its free set too
    blocks = [pool.block(i) for i in range(NUM_BLOCKS)]
    model = MODELS[name](blocks)
    held: list[CpuBlock] = []  # one entry per reference taken

    for op, args, extra in ops:
        if op == "store":
            missing = [k for k in args if not pool.is_cached(h(k))]
            protect = [blocks[i] for i in extra if blocks[i].ref_cnt == 0]
            n = min(len(missing), pool.num_free - len(set(protect)))
            if n <= 0:
                continue
            expected = model.victims(n, protect)
            got = pool.allocate(n, protect=protect)
            assert [b.block_id for b in got] == expected
            for b, k in zip(got, missing, strict=False):
                pool.publish(b, h(k))
            held.extend(got)
        elif op == "hit":
            hits = pool.lookup([h(k) for k in args])
            touch_seq(model, pool, hits)
            held.extend(hits)
        elif op == "touch":
            chosen = [blocks[i] for i in args]
            touch_seq(model, pool, chosen)
            held.extend(chosen)
        elif op == "free":
            if not held:
                continue
            picks = list(dict.fromkeys(i % len(held) for i in args))
            chosen = [held[i] for i in picks]
            for i in sorted(picks, reverse=True):
                del held[i]
            before = {b.block_id: b.ref_cnt for b in chosen}
            counts: dict[int, int] = {}
            for b in chosen:
                counts[b.block_id] = counts.get(b.block_id, 0) + 1
            pool.free(chosen)
            last = list(dict.fromkeys(reversed(chosen)))[::-1]  # reach 0 at the last listing
            zeroed = [b for b in last if before[b.block_id] == counts[b.block_id]]
            model.on_free(zeroed)
        else:
            for i in args:
                pool.unpublish(blocks[i])
        pool.check_invariants()


def touch_seq(model: object, pool: CpuBlockPool, chosen: Sequence[CpuBlock]) -> None:
    """Tell the model of each touch with the count the policy sees, then touch the pool."""
    shadow: dict[int, int] = {}
    for b in chosen:
        seen = b.ref_cnt + shadow.get(b.block_id, 0)
        real = b.ref_cnt
        b.ref_cnt = seen
        model.on_touch(b)  # type: ignore[attr-defined]
        b.ref_cnt = real
        shadow[b.block_id] = shadow.get(b.block_id, 0) + 1
    pool.touch(chosen)


@pytest.mark.parametrize("name", STATIC_POLICY_NAMES)
@settings(max_examples=40, deadline=None)
@given(ops=OPS)
def test_policy_matches_its_reference_model(
    name: str, ops: list[tuple[str, list[int], list[int]]]
) -> None:
    drive(name, ops)


@settings(max_examples=40, deadline=None)
@given(ops=OPS)
def test_lru_through_the_protocol_matches_the_fast_path(
    ops: list[tuple[str, list[int], list[int]]],
) -> None:
    drive("lru", ops, generic_lru=True)


def test_registry_and_names() -> None:
    assert POLICY_NAMES[0] == "lru"
    assert set(POLICY_NAMES) == {"lru", "arc", "s3fifo", "prefix-freq", "adaptive"}
    for name in POLICY_NAMES:
        policy = make_policy(name)
        assert policy.name == name
        assert isinstance(policy, EvictionPolicy)
    assert isinstance(make_policy(None), LruPolicy)
    assert isinstance(make_policy(" ARC "), ArcPolicy)
    mine = S3FifoPolicy()
    assert make_policy(mine) is mine


def test_unknown_policy_lists_the_known_ones() -> None:
    with pytest.raises(ConfigError, match=r"unknown eviction policy 'mru'.*lru, arc, s3fifo"):
        make_policy("mru")
    with pytest.raises(ConfigError, match="prefix-freq"):
        CpuBlockPool(4, policy="belady")


@pytest.mark.parametrize(
    "cls", [LruPolicy, ArcPolicy, S3FifoPolicy, PrefixFrequencyPolicy, AdaptivePolicy]
)
def test_a_policy_serves_one_pool(cls: type) -> None:
    policy = cls()
    CpuBlockPool(4, policy=policy)
    with pytest.raises(ValueError, match="already attached"):
        CpuBlockPool(4, policy=policy)


def test_s3fifo_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="small_fraction"):
        S3FifoPolicy(small_fraction=1.0)
    with pytest.raises(ValueError, match="promote_after"):
        S3FifoPolicy(promote_after=0)


class _Faulty:
    """A policy that names whatever block it was told to, for the pool's checks."""

    def __init__(self, pick: list[int]) -> None:
        self.pick = pick
        self.blocks: Sequence[CpuBlock] = ()

    @property
    def name(self) -> str:
        return "faulty"

    def attach(self, blocks: Sequence[CpuBlock], free: LruFreeQueue) -> None:
        self.blocks = blocks

    def on_touch(self, block: CpuBlock) -> None:
        pass

    def on_free(self, blocks: Sequence[CpuBlock]) -> None:
        pass

    def victims(self, n: int, protect: Collection[CpuBlock]) -> list[CpuBlock]:
        return [self.blocks[i] for i in self.pick]

    def check(self) -> None:
        pass


@pytest.mark.parametrize(
    ("pick", "n", "what"),
    [
        ([0], 1, "ref_cnt=1"),  # block 0 is held below
        ([1, 1], 2, "repeated=True"),
        ([2], 1, "protected=True"),
        ([1], 2, "chose 1 blocks, 2 were asked"),
    ],
)
def test_pool_refuses_a_faulty_policy_and_changes_nothing(
    pick: list[int], n: int, what: str
) -> None:
    pool = CpuBlockPool(4, policy=_Faulty(pick))
    pool.touch([pool.block(0)])
    before = [(b.ref_cnt, b.block_hash, b.is_free) for b in map(pool.block, range(4))]
    with pytest.raises(InvariantError, match=what.replace("(", r"\(")):
        pool.allocate(n, protect=[pool.block(2)])
    assert [(b.ref_cnt, b.block_hash, b.is_free) for b in map(pool.block, range(4))] == before
    pool.check_invariants()


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_reused_prefix_outlives_one_off_prompts(name: str) -> None:
    """A prefix hit every other request survives a stream of one-off prompts."""
    pool = CpuBlockPool(20, policy=name)
    hot = [h(i) for i in range(4)]
    survived = 0
    for step in range(40):
        for keys in (hot, [h(1000 + step * 10 + i) for i in range(3)]):
            hits = pool.lookup(keys)
            pool.touch(hits)
            new = pool.allocate(min(len(keys) - len(hits), pool.num_free))
            for b, k in zip(new, keys[len(hits) :], strict=False):
                pool.publish(b, k)
            held = hits + new
            pool.free(held[::-1])
        survived += len(pool.lookup(hot)) == 4
        pool.check_invariants()
    assert survived == 40  # the hot prefix is used every other request: all keep it


def _serve(pool: CpuBlockPool, keys: Sequence[BlockHash]) -> int:
    """One request as the replay tools drive a pool: look up, pin, store the rest, free."""
    hits = pool.lookup(keys)
    pool.touch(hits)
    new = pool.allocate(min(len(keys) - len(hits), pool.num_free))
    for b, k in zip(new, keys[len(hits) :], strict=False):
        pool.publish(b, k)
    held = hits + new
    pool.free(held[::-1])
    return len(hits)


def test_prefix_freq_heap_stays_bounded_on_hits_only() -> None:
    """Hit-only traffic never evicts; each hit used to leave a stale heap entry behind
    (50,050 of them after 1,000 requests of 50 blocks on a 100-block pool)."""
    policy = PrefixFrequencyPolicy()
    pool = CpuBlockPool(100, policy=policy)
    keys = [h(i) for i in range(50)]
    hits = sum(_serve(pool, keys) for _ in range(1000))
    assert hits == 999 * 50  # every request after the first hits all its blocks
    assert len(policy._heap) <= 2 * 50 + 64  # 50 ranked blocks
    assert len(policy._heap) <= 2 * pool.num_blocks + 64
    pool.check_invariants()


def test_prefix_freq_check_enforces_the_heap_bound() -> None:
    policy = PrefixFrequencyPolicy()
    pool = CpuBlockPool(8, policy=policy)
    keys = [h(i) for i in range(4)]
    _serve(pool, keys)
    pool.check_invariants()
    stale = policy._heap[0]
    policy._heap.extend([(stale[0], 0, stale[2])] * 100)  # entries no block owns
    with pytest.raises(InvariantError, match="beyond 2 \\* 4 ranked blocks \\+ 64"):
        policy.check()
