"""Random operation sequences over the engine parts, with invariants checked after every step.

- `GpuBlockAllocator` with its `RefCountPinner`: a block a request uses or a transfer pins
  is never handed out; a prefix match returns only blocks registered under those hashes.
- `OffloadRequest` over a real `KVOffloader`: the handle's hashes always equal hashing all
  its tokens from scratch, the scheduler only ever holds hashes of full computed blocks,
  and the scheduler's and pool's invariants hold. The machine also makes a second handle
  for an id in use or finished (refused), calls a finished handle (refused, whatever the
  call), and breaks the pinner's next ``unpin`` (the `PinnerError` it leaves surfaces
  once, and a ``finish`` it surfaces in still finishes the request). Loads are started
  and abandoned: an abandoned load's task is resolved at once, its request holds no pin,
  and the blocks it names are the load's (until its copy ended and was processed).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import TypeVar

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

from kvoffload import (
    KVLayout,
    KVOffloader,
    OffloadConfig,
    OffloadRequest,
    PinnerError,
    RequestStateError,
    TransferStatus,
    hash_prompt,
)
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


T = TypeVar("T")

BS = 4
LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_size=4, dtype="float32", block_size=BS)


class BreakablePinner:
    """A pinner whose next ``unpin`` raises once ``break_next`` is set."""

    def __init__(self) -> None:
        self.break_next = False

    def pin(self, gpu_block_ids: Sequence[int]) -> None:
        pass

    def unpin(self, gpu_block_ids: Sequence[int]) -> None:
        if self.break_next:
            self.break_next = False
            raise RuntimeError("unpin broke")


AFTER_FINISH: dict[str, Callable[[OffloadRequest], object]] = {
    "lookup": lambda r: r.lookup(),
    "load": lambda r: r.load([0]),
    "advance": lambda r: r.advance([], 0),
    "extend": lambda r: r.extend([1]),
    "release": lambda r: r.release(),
    "abandon_load": lambda r: r.abandon_load(),
    "preempt": lambda r: r.preempt(),
    "finish": lambda r: r.finish(),
}


class HandleMachine(RuleBasedStateMachine):
    """Handles on a real offloader, driven from a portal thread's event loop."""

    @initialize()
    def open(self) -> None:
        self.portal_cm = anyio.from_thread.start_blocking_portal()
        self.portal = self.portal_cm.__enter__()
        kv = [torch.zeros(LAYOUT.tensor_shape(64))]
        config = OffloadConfig(block_size=BS, num_cpu_blocks=12, model_id="sm")
        self.reqs: dict[str, OffloadRequest] = {}
        self.done: dict[str, OffloadRequest] = {}
        self.tables: dict[str, list[int]] = {}
        self.reported: dict[str, int] = {}
        self.next_id = 0
        self.pinner = BreakablePinner()
        self.off = KVOffloader(config, kv, layout=LAYOUT, pinner=self.pinner)
        # The offloader's task group must be entered and left in one task.
        self.off_cm = self.portal.wrap_async_context_manager(self.off)
        self.off_cm.__enter__()

    def teardown(self) -> None:
        if hasattr(self, "portal"):
            for req in self.reqs.values():
                try:
                    self.portal.call(req.__exit__, None, None, None)
                except PinnerError:
                    assert req.finished
            self.off_cm.__exit__(None, None, None)
            self.portal_cm.__exit__(None, None, None)

    def call(self, f: Callable[..., T], *args: object) -> T:
        """A step-loop call; the PinnerError a broken unpin left is raised once, by a call
        that then did nothing, so it is made again."""
        try:
            return self.portal.call(f, *args)
        except PinnerError:
            return self.portal.call(f, *args)

    @rule(prompt=st.lists(st.integers(0, 3), max_size=14))
    def new_request(self, prompt: list[int]) -> None:
        rid = f"r{self.next_id}"
        self.next_id += 1
        self.reqs[rid] = self.call(self.off.request, rid, prompt)
        self.tables[rid] = []

    @precondition(lambda self: getattr(self, "reqs", None) or getattr(self, "done", None))
    @rule(data=st.data(), prompt=st.lists(st.integers(0, 3), max_size=14))
    def second_handle_for_an_id(self, data: st.DataObject, prompt: list[int]) -> None:
        """A client's retry: another handle for an id that is live (before or after its
        first call) or finished is refused, and the first handle keeps its request."""
        rid = data.draw(st.sampled_from(sorted([*self.reqs, *self.done])))
        live = rid in self.reqs
        off = self.off

        def request() -> None:
            try:
                off.request(rid, prompt)
            except PinnerError:
                off.request(rid, prompt)

        def refused() -> tuple[int, int]:
            # one call on the loop's thread: the poller cannot end a copy (and drop a
            # finished request) between the two counts
            before = off.statistics().scheduler.live_requests
            with pytest.raises(RequestStateError, match="in use" if live else "not reused"):
                request()
            return before, off.statistics().scheduler.live_requests

        before, after = self.portal.call(refused)
        assert after == before

    @precondition(lambda self: getattr(self, "done", None))
    @rule(data=st.data(), call=st.sampled_from(sorted(AFTER_FINISH)))
    def call_a_finished_handle(self, data: st.DataObject, call: str) -> None:
        req = self.done[data.draw(st.sampled_from(sorted(self.done)))]
        free = self.off.pool.num_free
        with pytest.raises(RequestStateError, match="already finished"):
            self.portal.call(AFTER_FINISH[call], req)
        assert self.off.pool.num_free == free  # nothing pinned, nothing registered
        assert not self.off.scheduler.has_request(req.request_id) or (
            self.off.scheduler.request_state(req.request_id).finished
        )

    @rule()
    def break_the_next_unpin(self) -> None:
        self.pinner.break_next = True

    @precondition(lambda self: getattr(self, "reqs", None))
    @rule(data=st.data())
    def lookup(self, data: st.DataObject) -> None:
        req = self.reqs[data.draw(st.sampled_from(sorted(self.reqs)))]
        hit = self.call(req.lookup)
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
        self.call(req.advance, table, done)
        self.call(self.off.store)
        state = self.off.scheduler.request_state(rid)
        # The computed full blocks, and after a preemption those reported before it.
        reported = max(done // BS, self.reported.get(rid, 0))
        assert list(state.block_hashes) == list(req.block_hashes[:reported])
        self.reported[rid] = len(state.block_hashes)

    @precondition(lambda self: getattr(self, "reqs", None))
    @rule(data=st.data(), abandon=st.booleans())
    def load(self, data: st.DataObject, abandon: bool) -> None:
        """Look up, load the hit, and (maybe) abandon the load right away."""
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        req, table = self.reqs[rid], self.tables[rid]
        if not self.call(req.lookup):
            return
        table += list(range(len(table), req.blocks_for(req.num_tokens)))
        # In a tuple: the portal would await a task it is handed back.
        (task,) = self.call(lambda: (req.load(table),))
        if task is None or not abandon:
            return
        blocks = self.call(req.abandon_load)
        assert req.hit_tokens == 0
        assert not self.off.scheduler.request_state(rid).pinned
        assert task.done()  # resolved now, whether or not its copy had ended
        if blocks:  # still in flight: the task is abandoned, the blocks are its
            assert task.status is TransferStatus.ABANDONED
            assert blocks == task.gpu_block_ids
        else:  # processed before the call: nothing to abandon
            assert task.status is TransferStatus.DONE

    @precondition(lambda self: getattr(self, "reqs", None))
    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        self.call(self.reqs[rid].preempt)
        self.tables[rid] = []

    @precondition(lambda self: getattr(self, "reqs", None))
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        req = self.reqs.pop(rid)
        del self.tables[rid]
        with contextlib.suppress(PinnerError):  # surfaced once; the request is finished
            self.portal.call(req.__exit__, None, None, None)
        assert req.finished
        self.done[rid] = req
        sched = self.off.scheduler
        # Dropped now, or kept (finished) only until its last transfer completes.
        assert not sched.has_request(rid) or sched.request_state(rid).finished
        assert sched.was_finished(rid)

    @rule()
    def drain(self) -> None:
        self.call(self.off.drain)

    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "off"):
            return
        for rid, req in self.reqs.items():
            assert list(req.block_hashes) == hash_prompt(
                list(req.token_ids), BS, self.off.namespace
            )
            # A live handle's id is reserved from its creation, before any call.
            assert self.off.scheduler.has_request(rid)
            assert not self.off.scheduler.request_state(rid).finished
        self.portal.call(self.off.scheduler.check_invariants)
        self.portal.call(self.off.pool.check_invariants)


TestHandleMachine = HandleMachine.TestCase
TestHandleMachine.settings = settings(
    max_examples=25,
    stateful_step_count=20,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
