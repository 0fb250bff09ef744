"""Random operation sequences over the engine parts, with invariants checked after every step.

- `GpuBlockAllocator` with its `RefCountPinner`: a block a request uses or a transfer pins
  is never handed out; a prefix match returns only blocks registered under those hashes.
- `OffloadRequest` over a real `KVOffloader`: the handle's hashes always equal hashing all
  its tokens from scratch, the scheduler only ever holds hashes of full computed blocks,
  and the scheduler's and pool's invariants hold.
"""

from __future__ import annotations

import anyio
import anyio.from_thread
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from kvoffload import KVLayout, KVOffloader, OffloadConfig, OffloadRequest, hash_prompt
from kvoffload.hashing import BlockHash

pytest.importorskip("transformers")

from kvoffload.integrations.transformers import GpuBlockAllocator

NUM_BLOCKS = 8


def _h(i: int) -> BlockHash:
    return BlockHash(i.to_bytes(32, "little"))


class AllocatorMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.alloc = GpuBlockAllocator(NUM_BLOCKS)
        self.tables: list[list[int]] = []  # what "requests" hold (one ref per entry)
        self.transfers: list[list[int]] = []  # pins of transfers in flight
        self.cached: dict[BlockHash, int] = {}  # the model of the prefix cache

    def _owned(self) -> set[int]:
        return {b for t in self.tables for b in t}

    @rule(n=st.integers(1, 4))
    def allocate(self, n: int) -> None:
        blocks = self.alloc.allocate(n)
        if blocks is None:
            assert self.alloc.num_free < n
            return
        assert len(set(blocks)) == n
        busy = self._owned() | {b for t in self.transfers for b in t}
        assert not set(blocks) & busy, "a used or pinned block was handed out"
        for b in blocks:  # handing a block out drops its old hash
            self.cached = {h: c for h, c in self.cached.items() if c != b}
        self.tables.append(blocks)

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def cache_a_block(self, data: st.DataObject) -> None:
        table = data.draw(st.sampled_from(self.tables))
        b = data.draw(st.sampled_from(table))
        h = _h(data.draw(st.integers(0, 5)))
        self.alloc.cache(h, b)
        if h not in self.cached and b not in self.cached.values():
            self.cached[h] = b

    @rule(hashes=st.lists(st.integers(0, 5), max_size=4))
    def match(self, hashes: list[int]) -> None:
        chain = [_h(i) for i in hashes]
        got = self.alloc.match(chain, len(chain))
        want: list[int] = []
        for h in chain:
            if h not in self.cached:
                break
            want.append(self.cached[h])
        assert got == want
        if got:
            self.tables.append(got)

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        table = self.tables.pop(data.draw(st.integers(0, len(self.tables) - 1)))
        self.alloc.free(table)

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def start_transfer(self, data: st.DataObject) -> None:
        table = data.draw(st.sampled_from(self.tables))
        blocks = data.draw(st.lists(st.sampled_from(table), min_size=1, max_size=3))
        self.alloc.pinner.pin(blocks)
        self.transfers.append(blocks)

    @precondition(lambda self: self.transfers)
    @rule(data=st.data())
    def complete_transfer(self, data: st.DataObject) -> None:
        blocks = self.transfers.pop(data.draw(st.integers(0, len(self.transfers) - 1)))
        self.alloc.pinner.unpin(blocks)

    @invariant()
    def consistent(self) -> None:
        self.alloc.check_invariants()
        stats = self.alloc.statistics()
        assert stats.num_used == len(self._owned())
        assert stats.num_free + stats.num_held + stats.num_used == NUM_BLOCKS
        assert stats.num_cached == len(self.cached)


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


BS = 4
LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_size=4, dtype="float32", block_size=BS)


class HandleMachine(RuleBasedStateMachine):
    """Handles on a real offloader, driven from a portal thread's event loop."""

    @initialize()
    def open(self) -> None:
        self.portal_cm = anyio.from_thread.start_blocking_portal()
        self.portal = self.portal_cm.__enter__()
        kv = [torch.zeros(LAYOUT.tensor_shape(64))]
        config = OffloadConfig(block_size=BS, num_cpu_blocks=12, model_id="sm")
        self.reqs: dict[str, OffloadRequest] = {}
        self.tables: dict[str, list[int]] = {}
        self.reported: dict[str, int] = {}
        self.next_id = 0
        self.off = KVOffloader(config, kv, layout=LAYOUT)
        # The offloader's task group must be entered and left in one task.
        self.off_cm = self.portal.wrap_async_context_manager(self.off)
        self.off_cm.__enter__()

    def teardown(self) -> None:
        if hasattr(self, "portal"):
            for req in self.reqs.values():
                self.portal.call(req.__exit__, None, None, None)
            self.off_cm.__exit__(None, None, None)
            self.portal_cm.__exit__(None, None, None)

    @rule(prompt=st.lists(st.integers(0, 3), max_size=14))
    def new_request(self, prompt: list[int]) -> None:
        rid = f"r{self.next_id}"
        self.next_id += 1
        self.reqs[rid] = self.portal.call(self.off.request, rid, prompt)
        self.tables[rid] = []

    @precondition(lambda self: getattr(self, "reqs", None))
    @rule(data=st.data())
    def lookup(self, data: st.DataObject) -> None:
        req = self.reqs[data.draw(st.sampled_from(sorted(self.reqs)))]
        hit = self.portal.call(req.lookup)
        assert hit % BS == 0
        assert hit <= max(0, req.num_tokens - 1)

    @precondition(lambda self: getattr(self, "reqs", None))
    @rule(data=st.data(), tokens=st.lists(st.integers(0, 3), max_size=6))
    def step(self, data: st.DataObject, tokens: list[int]) -> None:
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        req, table = self.reqs[rid], self.tables[rid]
        req.extend(tokens)
        done = data.draw(st.integers(req.num_computed_tokens, req.num_tokens))
        table += list(range(len(table), req.blocks_for(req.num_tokens)))
        self.portal.call(req.advance, table, done)
        self.portal.call(self.off.store)
        state = self.off.scheduler.request_state(rid)
        # The computed full blocks, and after a preemption those reported before it.
        reported = max(done // BS, self.reported.get(rid, 0))
        assert list(state.block_hashes) == list(req.block_hashes[:reported])
        self.reported[rid] = len(state.block_hashes)

    @precondition(lambda self: getattr(self, "reqs", None))
    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        self.portal.call(self.reqs[rid].preempt)
        self.tables[rid] = []

    @precondition(lambda self: getattr(self, "reqs", None))
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        req = self.reqs.pop(rid)
        del self.tables[rid]
        self.portal.call(req.__exit__, None, None, None)
        assert req.finished

    @rule()
    def drain(self) -> None:
        self.portal.call(self.off.drain)

    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "off"):
            return
        for req in self.reqs.values():
            assert list(req.block_hashes) == hash_prompt(
                list(req.token_ids), BS, self.off.namespace
            )
        self.portal.call(self.off.scheduler.check_invariants)
        self.portal.call(self.off.pool.check_invariants)


TestHandleMachine = HandleMachine.TestCase
TestHandleMachine.settings = settings(
    max_examples=25,
    stateful_step_count=20,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
