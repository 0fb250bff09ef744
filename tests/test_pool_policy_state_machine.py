"""The pool and scheduler state machines, run with every eviction policy.

Which free blocks an allocation takes is the policy's choice, so the model adopts the
pool's choice after checking it: as many blocks as asked, all free, none protected. Every
other promise (reference counts, the hash map, lookups, events, statistics, rollback on
a double free) is compared exactly, and ``check_invariants()`` (which runs the policy's own
check) passes after every step. LRU itself runs here through the generic policy path.
The scheduler machine of ``test_scheduler_state_machine.py`` runs with a drawn policy
and admission filter, with all of its checks (exact KV delivered, no leaked reference).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, rule, run_state_machine_as_test

from kvoffload.config import OffloadConfig
from kvoffload.errors import BlockStateError, OutOfBlocksError
from kvoffload.hashing import BlockHash
from kvoffload.pool.block_pool import CpuBlockPool
from kvoffload.pool.policies import POLICY_NAMES
from kvoffload.scheduler import OffloadScheduler
from tests.scheduler_helpers import BS
from tests.test_pool_state_machine import NUM_BLOCKS, Model, PoolMachine, h
from tests.test_scheduler_state_machine import NUM_GPU_BLOCKS, SchedulerMachine


class PolicyModel(Model):
    """The plain model, taking whichever blocks the policy chose."""

    def allocate_chosen(
        self, chosen: list[int], protect: set[int]
    ) -> tuple[list[int], list[BlockHash]]:
        free = [b for b in self.lru if b not in protect]
        if len(chosen) > len(free):
            raise OutOfBlocksError(len(chosen), len(free))
        assert len(set(chosen)) == len(chosen)
        assert set(chosen) <= set(free), "the policy chose a held or protected block"
        evicted: list[BlockHash] = []
        for b in chosen:
            self.lru.remove(b)
            key = self._unpublish(b)
            if key is not None:
                evicted.append(key)
                self.evictions += 1
            self.refs[b] = 1
        return chosen, evicted


def machine_for(policy: str) -> type[PoolMachine]:
    class PolicyPoolMachine(PoolMachine):
        def __init__(self) -> None:
            super().__init__()
            self.pool = CpuBlockPool(NUM_BLOCKS, enable_events=True, policy=policy)
            if policy == "lru":
                self.pool._hooked = self.pool.policy  # exercise the protocol path
                self.pool._plain = False
                self.pool._levels._hooked = self.pool.policy  # its free set too
            self.model = PolicyModel(NUM_BLOCKS)

        def allocate_and_publish(self, keys: list[int]) -> None:
            n = min(len(keys), len(self.model.lru))
            blocks = self.pool.allocate(n)
            self.model.allocate_chosen(self.ids(blocks), set())  # type: ignore[arg-type]
            for block, key in zip(blocks, keys, strict=False):
                assert self.pool.publish(block, h(key)) == self.model.publish(
                    block.block_id, h(key)
                )

        @rule(n=st.integers(min_value=0, max_value=NUM_BLOCKS + 1), data=st.data())
        def allocate(self, n: int, data: st.DataObject) -> None:
            protect = set(data.draw(st.lists(st.integers(0, NUM_BLOCKS - 1), max_size=3)))
            available = len([b for b in self.model.lru if b not in protect])
            evicted: list[BlockHash] = []
            if n > available:
                before = (sorted(self.free_ids()), self.pool.statistics())
                with pytest.raises(OutOfBlocksError):
                    self.pool.allocate(
                        n, protect=[self.pool.block(b) for b in protect], evicted=evicted
                    )
                assert (sorted(self.free_ids()), self.pool.statistics()) == before
                assert evicted == []
                return
            blocks = self.pool.allocate(
                n, protect=[self.pool.block(b) for b in protect], evicted=evicted
            )
            _, expected_evicted = self.model.allocate_chosen(self.ids(blocks), protect)  # type: ignore[arg-type]
            assert evicted == expected_evicted
            assert all(b.ref_cnt == 1 and b.block_hash is None for b in blocks)

        @rule(data=st.data())
        def double_free(self, data: st.DataObject) -> None:
            held = self.referenced()
            extra = data.draw(st.integers(0, NUM_BLOCKS - 1))
            blocks = data.draw(st.permutations([*held, extra]))
            before = (self.free_ids(), [self.pool.block(b).ref_cnt for b in range(NUM_BLOCKS)])
            with pytest.raises(BlockStateError, match="double free"):
                self.pool.free([self.pool.block(b) for b in blocks])
            after = (self.free_ids(), [self.pool.block(b).ref_cnt for b in range(NUM_BLOCKS)])
            assert after == before
            self.pool.check_invariants()

        @invariant()
        def agrees_with_model(self) -> None:
            # The free *set* is the pool's promise; its order belongs to the policy.
            saved = self.model.lru
            self.model.lru = self.free_ids()
            assert sorted(saved) == sorted(self.model.lru)
            try:
                super().agrees_with_model()
            finally:
                self.model.lru = saved

    PolicyPoolMachine.__name__ = f"PoolMachine_{policy.replace('-', '_')}"
    return PolicyPoolMachine


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_pool_state_machine_per_policy(policy: str) -> None:

    run_state_machine_as_test(
        machine_for(policy),
        settings=settings(max_examples=40, stateful_step_count=40, deadline=None),
    )


class PolicySchedulerMachine(SchedulerMachine):
    """The scheduler state machine with a drawn eviction policy and admission filter."""

    @initialize(
        restore=st.booleans(),
        size=st.integers(2, 8),
        policy=st.sampled_from(POLICY_NAMES),
        admission=st.sampled_from(["always", "seen_twice", "seen:3:4"]),
        hold=st.booleans(),
    )
    def setup(  # type: ignore[override]
        self, restore: bool, size: int, policy: str, admission: str, hold: bool
    ) -> None:
        config = OffloadConfig(
            block_size=BS,
            num_cpu_blocks=size,
            restore_evicted=restore,
            eviction_policy=policy,
            store_admission=admission,
            hold_blocks_on_finish=hold,
            hold_max_blocks=4,
            hold_max_steps=3,
        )
        self.sched = OffloadScheduler(
            config,
            CpuBlockPool(size, policy=policy),
            bytes_per_block=100,
            num_gpu_blocks=NUM_GPU_BLOCKS,
        )


TestSchedulerWithPolicies = PolicySchedulerMachine.TestCase
TestSchedulerWithPolicies.settings = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
