"""CpuBlockPool driven by random operation sequences and compared with a plain model.

The model is what the pool promises, written the obvious way: a dict from hash to block,
a list of free block ids in LRU order, and a reference count per block. After every step
the pool must agree with it exactly (same free order, same map, same lookups, same
evictions) and ``check_invariants()`` must pass.
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvoffload.errors import BlockStateError, OutOfBlocksError
from kvoffload.hashing import BlockHash
from kvoffload.pool.block_pool import BlockRemoved, BlockStored, CpuBlockPool

NUM_BLOCKS = 6
KEYS = st.integers(min_value=0, max_value=11)


def h(i: int) -> BlockHash:
    return BlockHash(i.to_bytes(32, "little"))


class Model:
    """The reference: plain containers, no cleverness."""

    def __init__(self, num_blocks: int) -> None:
        self.refs = [0] * num_blocks
        self.hash_of: list[BlockHash | None] = [None] * num_blocks
        self.cached: dict[BlockHash, int] = {}
        self.lru: list[int] = list(range(num_blocks))  # free blocks, least recently used first
        self.evictions = 0
        self.lookups = 0
        self.hit_blocks = 0

    def _unpublish(self, block: int) -> BlockHash | None:
        key = self.hash_of[block]
        if key is not None:
            del self.cached[key]
            self.hash_of[block] = None
        return key

    def allocate(self, n: int, protect: set[int]) -> tuple[list[int], list[BlockHash]]:
        candidates = [b for b in self.lru if b not in protect]
        if n > len(candidates):
            raise OutOfBlocksError(n, len(candidates))
        taken = candidates[:n]
        evicted: list[BlockHash] = []
        for b in taken:
            self.lru.remove(b)
            key = self._unpublish(b)
            if key is not None:
                evicted.append(key)
                self.evictions += 1
            self.refs[b] = 1
        return taken, evicted

    def touch(self, blocks: list[int]) -> None:
        for b in blocks:
            if self.refs[b] == 0:
                self.lru.remove(b)
            self.refs[b] += 1

    def free(self, blocks: list[int]) -> None:
        refs = list(self.refs)
        for b in blocks:
            if refs[b] == 0:
                raise BlockStateError(f"double free of {b}")
            refs[b] -= 1
        for b in blocks:
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self.lru.append(b)

    def publish(self, block: int, key: BlockHash) -> bool:
        if self.refs[block] == 0:
            raise BlockStateError("unreferenced")
        current = self.hash_of[block]
        if current is not None:
            if current == key:
                return True
            raise BlockStateError("published under another hash")
        if key in self.cached:
            return False
        self.cached[key] = block
        self.hash_of[block] = key
        return True

    def unpublish(self, block: int) -> bool:
        return self._unpublish(block) is not None

    def lookup(self, keys: list[BlockHash]) -> list[int]:
        hits: list[int] = []
        for key in keys:
            if key not in self.cached:
                break
            hits.append(self.cached[key])
        self.lookups += 1
        self.hit_blocks += len(hits)
        return hits

    def reset(self) -> bool:
        if any(self.refs):
            return False
        for b in range(len(self.refs)):
            self._unpublish(b)
        return True


class PoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool = CpuBlockPool(NUM_BLOCKS, enable_events=True)
        self.model = Model(NUM_BLOCKS)
        self.events: list[object] = []

    def ids(self, blocks: list[object]) -> list[int]:
        return [b.block_id for b in blocks]  # type: ignore[attr-defined]

    def referenced(self) -> list[int]:
        """One entry per reference held, so a free draws a valid multiset."""
        return [b for b, r in enumerate(self.model.refs) for _ in range(r)]

    @initialize(keys=st.lists(KEYS, max_size=NUM_BLOCKS, unique=True))
    def warm(self, keys: list[int]) -> None:
        """Start from a pool holding some published, free blocks."""
        self.allocate_and_publish(keys)
        held = [b for b, r in enumerate(self.model.refs) if r]
        self.pool.free([self.pool.block(b) for b in held])
        self.model.free(held)

    def allocate_and_publish(self, keys: list[int]) -> None:
        n = min(len(keys), len(self.model.lru))
        blocks = self.pool.allocate(n)
        taken, _ = self.model.allocate(n, set())
        assert self.ids(blocks) == taken  # type: ignore[arg-type]
        for block, key in zip(blocks, keys, strict=False):
            assert self.pool.publish(block, h(key)) == self.model.publish(block.block_id, h(key))

    # -- rules -----------------------------------------------------------------------------

    @rule(n=st.integers(min_value=0, max_value=NUM_BLOCKS + 1), data=st.data())
    def allocate(self, n: int, data: st.DataObject) -> None:
        protect = set(data.draw(st.lists(st.integers(0, NUM_BLOCKS - 1), max_size=3)))
        evicted: list[BlockHash] = []
        try:
            expected, expected_evicted = self.model.allocate(n, protect)
        except OutOfBlocksError:
            before = (self.free_ids(), self.pool.statistics())
            with pytest.raises(OutOfBlocksError):
                self.pool.allocate(
                    n, protect=[self.pool.block(b) for b in protect], evicted=evicted
                )
            assert (self.free_ids(), self.pool.statistics()) == before
            assert evicted == []
            return
        blocks = self.pool.allocate(
            n, protect=[self.pool.block(b) for b in protect], evicted=evicted
        )
        assert self.ids(blocks) == expected  # type: ignore[arg-type]
        assert evicted == expected_evicted
        assert not {b.block_id for b in blocks} & protect
        assert all(b.ref_cnt == 1 and b.block_hash is None for b in blocks)

    @rule(data=st.data())
    def touch(self, data: st.DataObject) -> None:
        chosen = data.draw(st.lists(st.integers(0, NUM_BLOCKS - 1), max_size=4))
        self.pool.touch([self.pool.block(b) for b in chosen])
        self.model.touch(chosen)

    @precondition(lambda self: any(self.model.refs))
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        held = self.referenced()
        chosen = data.draw(st.lists(st.sampled_from(range(len(held))), unique=True, min_size=1))
        blocks = [held[i] for i in chosen]
        self.pool.free([self.pool.block(b) for b in blocks])
        self.model.free(blocks)

    @rule(data=st.data())
    def double_free(self, data: st.DataObject) -> None:
        """A free naming more references than are held raises and changes nothing."""
        held = self.referenced()
        extra = data.draw(st.integers(0, NUM_BLOCKS - 1))
        blocks = [*held, extra]
        blocks = data.draw(st.permutations(blocks))
        before = (self.free_ids(), [self.pool.block(b).ref_cnt for b in range(NUM_BLOCKS)])
        with pytest.raises(BlockStateError, match="double free"):
            self.pool.free([self.pool.block(b) for b in blocks])
        after = (self.free_ids(), [self.pool.block(b).ref_cnt for b in range(NUM_BLOCKS)])
        assert after == before

    @rule(data=st.data(), touch=st.booleans())
    def foreign_block(self, data: st.DataObject, touch: bool) -> None:
        """A block of another pool, among this pool's own, is refused; nothing changes."""
        other = CpuBlockPool(NUM_BLOCKS)
        foreign = other.allocate(1)[0] if not touch else other.block(0)
        held = self.referenced() if not touch else list(range(NUM_BLOCKS))
        picks = data.draw(st.lists(st.integers(0, len(held) - 1), unique=True)) if held else []
        own = [self.pool.block(held[i]) for i in picks]  # never more than the refs held
        blocks = data.draw(st.permutations([*own, foreign]))
        before = (self.free_ids(), [self.pool.block(b).ref_cnt for b in range(NUM_BLOCKS)])
        call = self.pool.touch if touch else self.pool.free
        with pytest.raises(BlockStateError, match="another pool"):
            call(blocks)
        after = (self.free_ids(), [self.pool.block(b).ref_cnt for b in range(NUM_BLOCKS)])
        assert after == before
        other.check_invariants()

    @rule(key=KEYS)
    def publish_foreign_block(self, key: int) -> None:
        """Another pool's referenced block is never published here."""
        other = CpuBlockPool(NUM_BLOCKS)
        foreign = other.allocate(1)[0]
        before = (self.free_ids(), [self.pool.block(b).ref_cnt for b in range(NUM_BLOCKS)])
        found = self.pool.get_cached(h(key))
        with pytest.raises(BlockStateError, match="another pool"):
            self.pool.publish(foreign, h(key))
        assert self.pool.get_cached(h(key)) is found
        assert foreign.block_hash is None
        after = (self.free_ids(), [self.pool.block(b).ref_cnt for b in range(NUM_BLOCKS)])
        assert after == before

    @rule(block=st.integers(0, NUM_BLOCKS - 1), key=KEYS)
    def publish(self, block: int, key: int) -> None:
        try:
            expected = self.model.publish(block, h(key))
        except BlockStateError:
            with pytest.raises(BlockStateError):
                self.pool.publish(self.pool.block(block), h(key))
            return
        assert self.pool.publish(self.pool.block(block), h(key)) == expected

    @rule(keys=st.lists(KEYS, max_size=4, unique=True))
    def store_missing(self, keys: list[int]) -> None:
        """The scheduler's path: allocate for the keys that are not cached, publish them."""
        missing = [k for k in keys if h(k) not in self.model.cached]
        self.allocate_and_publish(missing)

    @rule(block=st.integers(0, NUM_BLOCKS - 1))
    def unpublish(self, block: int) -> None:
        assert self.pool.unpublish(self.pool.block(block)) == self.model.unpublish(block)

    @rule(keys=st.lists(KEYS, max_size=6))
    def lookup(self, keys: list[int]) -> None:
        hashes = [h(k) for k in keys]
        hits = self.pool.lookup(hashes)
        assert self.ids(hits) == self.model.lookup(hashes)  # type: ignore[arg-type]
        # invariant 4: a leading run of published blocks, each under the hash asked for
        for block, key in zip(hits, hashes, strict=False):
            assert block.block_hash == key
            assert self.pool.get_cached(key) is block
        if len(hits) < len(hashes):
            assert not self.pool.is_cached(hashes[len(hits)])

    @rule(data=st.data())
    def lookup_and_pin(self, data: st.DataObject) -> None:
        """Lookup then touch the hit, as the scheduler does before a load."""
        published = sorted(self.model.cached)
        prefix = data.draw(st.lists(st.sampled_from(published), max_size=4)) if published else []
        hits = self.pool.lookup(prefix)
        assert self.ids(hits) == self.model.lookup(prefix)  # type: ignore[arg-type]
        self.pool.touch(hits)
        self.model.touch([b.block_id for b in hits])

    @rule()
    def reset_prefix_cache(self) -> None:
        assert self.pool.reset_prefix_cache() == self.model.reset()

    # -- checks ------------------------------------------------------------------------------

    def free_ids(self) -> list[int]:
        return [b.block_id for b in self.pool._free]

    @invariant()
    def agrees_with_model(self) -> None:
        pool, model = self.pool, self.model
        pool.check_invariants()
        assert self.free_ids() == model.lru
        assert [pool.block(b).ref_cnt for b in range(NUM_BLOCKS)] == model.refs
        assert [pool.block(b).block_hash for b in range(NUM_BLOCKS)] == model.hash_of
        assert {k: pool.get_cached(k) for k in model.cached} == {
            k: pool.block(b) for k, b in model.cached.items()
        }
        stats = pool.statistics()
        assert stats.num_free == len(model.lru) == pool.num_free
        assert stats.num_cached == len(model.cached)
        assert stats.evictions == model.evictions
        assert stats.lookups == model.lookups
        assert stats.hit_blocks == model.hit_blocks

    @invariant()
    def events_replay_to_the_map(self) -> None:
        """BlockStored/BlockRemoved events, replayed, rebuild exactly the published map."""
        for event in self.pool.take_events():
            self.events.append(event)
        mirror: dict[BlockHash, int] = {}
        for event in self.events:
            if isinstance(event, BlockStored):
                assert event.block_hash not in mirror
                mirror[event.block_hash] = event.block_id
            elif isinstance(event, BlockRemoved):
                assert mirror.pop(event.block_hash) == event.block_id
            else:
                mirror.clear()
        assert mirror == self.model.cached


PoolMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=50, deadline=None)
TestPoolMachine = PoolMachine.TestCase
