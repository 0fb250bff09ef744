"""A hypothesis state machine over KVOffloader with a real disk tier below a small CPU pool.

Random stores, lookups (deferring or not) with loads, lookups from another request while
a store of the same prefix is in flight (promotions may run meanwhile), waits for the
background work, resets, in-place corruption of blocks in the tier file, deletion of
the file, and session hints: retain for a while, release, advance the hints' clock,
prefetch (awaited, or cancelled after a few checkpoints). After
every step: the scheduler's and the tier manager's ``check_invariants()``, and every
published CPU block holds exactly the KV of its hash. Every load is checked bit-exact
against the KV the engine would compute (wrong KV is the worst bug there is).
"""

from __future__ import annotations

import tempfile
import threading
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import torch
from anyio.from_thread import BlockingPortal, start_blocking_portal
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from tier_helpers import (
    BS,
    block_kv,
    compute_and_store,
    config,
    expected_block,
    make_kv,
    patch_file,
    settle,
    tokens,
    wait_until,
)

from kvoffload.offloader import KVOffloader
from kvoffload.testing import CopyFaults
from kvoffload.tiers.disk import DiskTier
from kvoffload.transfer.thread_engine import ThreadCopyEngine

PROMPTS = 6
MAX_BLOCKS = 4


def prompt(family: int, length: int) -> list[int]:
    """Families share nothing; a longer prompt of a family extends the shorter ones."""
    return tokens(family, MAX_BLOCKS)[: length * BS + 1]


class TierMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.TemporaryDirectory(prefix="kvoffload-tier-sm-")
        self.path = Path(self.dir.name) / "kv.bin"
        self.kv = make_kv()
        self.portal_cm: Any = None
        self.portal: BlockingPortal | None = None
        self.off_cm: Any = None
        self.off: KVOffloader | None = None
        self.next_id = 0
        self.loaded_from_tier = 0
        self.now = 0.0
        self.deadlines: dict[str, float] = {}  # session -> when its hint ends (the model)

    @initialize(
        cpu_blocks=st.integers(3, 10),
        queue=st.integers(1, 8),
        slots=st.integers(2, 12),
        prefetch_share=st.sampled_from([0.25, 0.5, 1.0]),
        retained_share=st.sampled_from([0.25, 0.5]),
    )
    def setup(
        self, cpu_blocks: int, queue: int, slots: int, prefetch_share: float, retained_share: float
    ) -> None:
        tier = {
            "kind": "disk",
            "path": str(self.path),
            "capacity_bytes": 4096 + slots * 8192 + 1024 * 1024,
            "max_queued_writes": queue,
            "max_in_flight": 2,
            "max_batch_blocks": 3,
            "retry_initial_s": 0.01,
            "retry_max_s": 0.02,
        }
        cfg = config(
            [tier],
            num_cpu_blocks=cpu_blocks,
            max_prefetch_fraction=prefetch_share,
            max_retained_fraction=retained_share,
        )
        self.portal_cm = start_blocking_portal("asyncio")
        self.portal = self.portal_cm.__enter__()
        self.off_cm = self.portal.wrap_async_context_manager(KVOffloader(cfg, self.kv))
        self.off = self.off_cm.__enter__()
        self.o.hints.clock = lambda: self.now

    def teardown(self) -> None:
        try:
            if self.off_cm is not None:
                self.off_cm.__exit__(None, None, None)
                assert self.off is not None
                assert self.off.pool.num_free == self.off.pool.num_blocks
        finally:
            if self.portal_cm is not None:
                self.portal_cm.__exit__(None, None, None)
            self.dir.cleanup()

    def call(self, fn: Any, *args: Any) -> Any:
        assert self.portal is not None
        return self.portal.call(fn, *args)

    def rid(self) -> str:
        self.next_id += 1
        return f"r{self.next_id}"

    @property
    def o(self) -> KVOffloader:
        assert self.off is not None
        return self.off

    # -- rules ---------------------------------------------------------------------------

    @rule(family=st.integers(0, PROMPTS - 1), length=st.integers(1, MAX_BLOCKS))
    def store(self, family: int, length: int) -> None:
        p = prompt(family, length)
        self.call(compute_and_store, self.o, self.kv, self.rid(), p, range(length))

    @rule(
        family=st.integers(0, PROMPTS - 1),
        length=st.integers(1, MAX_BLOCKS),
        allow_defer=st.booleans(),
        accept=st.integers(0, MAX_BLOCKS),
    )
    def lookup_and_load(self, family: int, length: int, allow_defer: bool, accept: int) -> None:
        p = prompt(family, length)
        rid = self.rid()
        hashes = self.o.hash_prompt(p)
        hit = self.call(lambda: self.o.lookup(rid, hashes, len(p), allow_defer=allow_defer))
        if hit is None:
            self.call(self.o.finish, rid)
            return
        n = min(hit // BS, accept)
        gpu = list(range(16, 16 + length))
        for g in gpu:
            for t in self.kv:
                t[g] = float("nan")

        async def load() -> None:
            task = self.o.load(rid, gpu, n * BS)
            if task is not None:
                await task

        self.call(load)
        for i in range(n):
            assert torch.equal(block_kv(self.kv, gpu[i]), expected_block(hashes[i], self.kv)), i
        self.call(self.o.finish, rid)

    @rule(family=st.integers(0, PROMPTS - 1), length=st.integers(1, MAX_BLOCKS))
    def store_and_drop_from_cpu(self, family: int, length: int) -> None:
        """Store, let the write-downs land, then empty the CPU cache: the tier has it."""
        self.store(family, length)
        self.call(settle, self.o)
        self.reset()

    @rule(
        family=st.integers(0, PROMPTS - 1),
        length=st.integers(1, MAX_BLOCKS),
        allow_defer=st.booleans(),
        from_tier=st.booleans(),
    )
    def lookup_while_storing(
        self, family: int, length: int, allow_defer: bool, from_tier: bool
    ) -> None:
        """Keep a store in flight (its copies wait on a gate) across a lookup of the same
        prefix from another request; the tiers may promote meanwhile (``from_tier``: the
        prefix was written down and dropped from CPU first). Checked inside the step too,
        while the store is still in flight."""
        if from_tier:
            self.store_and_drop_from_cpu(family, length)
        p = prompt(family, length)
        hashes = self.o.hash_prompt(p)
        writer, reader = self.rid(), self.rid()
        engine = self.o._life.engines["g0"]
        assert isinstance(engine, ThreadCopyEngine)
        gate = threading.Event()
        engine._copy_hook = CopyFaults(gate=gate)
        tasks: list[Any] = []
        try:
            for i, block_hash in enumerate(hashes):
                want = expected_block(block_hash, self.kv)
                for layer, t in enumerate(self.kv):
                    t[i] = want[layer]

            def start() -> None:
                self.o.update(writer, list(range(length)), hashes, length * BS)
                tasks.extend(self.o.store())

            self.call(start)
            hit = self.call(lambda: self.o.lookup(reader, hashes, len(p), allow_defer=allow_defer))
            self.call(wait_promotions, self.o)
            self.consistent()
            if hit:
                self.call(self.o.release, reader)
        finally:
            gate.set()

            async def drain() -> None:
                for task in tasks:
                    await task

            self.call(drain)
            engine._copy_hook = None
        self.call(self.o.finish, writer)
        self.call(self.o.finish, reader)

    @rule()
    def wait_background(self) -> None:
        self.call(settle, self.o)

    @rule()
    def reset(self) -> None:
        self.call(self.o.reset)
        self.deadlines.clear()  # a reset ends every hint

    # -- session hints ---------------------------------------------------------------------

    @rule(
        family=st.integers(0, PROMPTS - 1),
        length=st.integers(1, MAX_BLOCKS),
        seconds=st.floats(0.5, 60.0),
        session=st.integers(0, 2),
    )
    def hint(self, family: int, length: int, seconds: float, session: int) -> None:
        p = prompt(family, length)
        name = f"s{session}"
        retained = self.call(lambda: self.o.hints.retain_for(p, seconds, session=name))
        assert 0 <= retained <= length
        self.deadlines[name] = self.now + seconds

    @rule(session=st.integers(0, 2))
    def release_hint(self, session: int) -> None:
        name = f"s{session}"
        released = self.call(self.o.hints.release, name)
        assert released >= 0
        self.deadlines.pop(name, None)
        assert name not in self.o.hints.sessions

    @rule(seconds=st.floats(0.0, 90.0))
    def advance_clock(self, seconds: float) -> None:
        """Time passes; the next store() lets the hints whose time is up go."""
        self.now += seconds
        self.call(self.o.store)
        self.deadlines = {s: d for s, d in self.deadlines.items() if d > self.now}
        for name in self.o.hints.sessions:
            assert name in self.deadlines, name  # an expired hint holds nothing

    @rule(family=st.integers(0, PROMPTS - 1), length=st.integers(1, MAX_BLOCKS))
    def prefetch(self, family: int, length: int) -> None:
        p = prompt(family, length)
        hashes = self.o.hash_prompt(p)
        on_cpu = self.call(self.o.hints.prefetch, p)
        assert 0 <= on_cpu <= length
        tiers = self.o.tiers
        assert tiers is not None
        assert tiers.prefetch_blocks == 0  # nothing held once it returned
        for i in range(on_cpu):
            assert self.o.pool.is_cached(hashes[i]), i

    @rule(
        family=st.integers(0, PROMPTS - 1),
        length=st.integers(1, MAX_BLOCKS),
        checkpoints=st.integers(0, 30),
        during_read=st.booleans(),
    )
    def prefetch_cancelled(
        self, family: int, length: int, checkpoints: int, during_read: bool
    ) -> None:
        """A prefetch cancelled after a few checkpoints (at its probe, or after it), or
        (``during_read``) once it holds CPU blocks: every CPU block it took is released,
        nothing half-published."""
        p = prompt(family, length)
        tiers = self.o.tiers
        assert tiers is not None

        async def run() -> None:
            done = anyio.Event()

            async def prefetch() -> None:
                try:
                    await self.o.hints.prefetch(p)
                finally:
                    done.set()

            with anyio.CancelScope() as scope:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(prefetch)
                    for _ in range(checkpoints):
                        await anyio.lowlevel.checkpoint()
                    while during_read and not done.is_set() and tiers.prefetch_blocks == 0:
                        await anyio.sleep(0.0005)
                    scope.cancel()

        self.call(run)
        tiers = self.o.tiers
        assert tiers is not None
        assert tiers.prefetch_blocks == 0

    @rule(pick=st.integers(0, 1 << 30), where=st.sampled_from(["header", "payload"]))
    def corrupt_tier_block(self, pick: int, where: str) -> None:
        self.call(settle, self.o)  # no write or re-creation of the file under way
        tiers = self.o.tiers
        assert tiers is not None
        if not tiers.statistics().tiers[0].healthy:
            return  # the file may be re-created at any moment
        tier = self.tier()
        index = dict(tier._index)
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return
        if not index or (st.st_dev, st.st_ino) != tier._identity:
            return  # the file was deleted: the tier has not noticed yet
        slot = sorted(index.values())[pick % len(index)]
        if where == "header":
            offset = tier._header_offset(slot) + 50
        else:
            offset = tier._offset(slot) + pick % 1024
        patch_file(self.path, offset, lambda old: bytes(b ^ 0x10 for b in old))

    @rule()
    def delete_tier_file(self) -> None:
        if self.path.is_file():
            self.path.unlink()

    def tier(self) -> DiskTier:
        tiers = self.o.tiers
        assert tiers is not None
        tier = tiers.tiers[0]
        assert isinstance(tier, DiskTier)
        return tier

    # -- invariants ----------------------------------------------------------------------

    @invariant()
    def consistent(self) -> None:
        if self.off is None:
            return

        def check() -> None:
            self.o.scheduler.check_invariants()
            tiers = self.o.tiers
            assert tiers is not None
            tiers.check_invariants()
            assert tiers.prefetch_blocks <= tiers.max_prefetch_blocks
            pool = self.o.pool
            assert pool.num_retained <= pool.max_retained_blocks
            host = self.o.host
            assert host is not None
            for block_id in range(self.o.pool.num_blocks):
                block = self.o.pool.block(block_id)
                if block.block_hash is not None:
                    want = expected_block(block.block_hash, self.kv)
                    assert torch.equal(host.block(block_id), want), block_id

        self.call(check)


async def wait_promotions(off: KVOffloader) -> None:
    """Wait until no promotion is in flight (stores may still be)."""
    tiers = off.tiers
    assert tiers is not None
    await wait_until(lambda: tiers.statistics().promotions_in_flight == 0)


TierMachine.TestCase.settings = settings(
    max_examples=30,
    stateful_step_count=20,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestTierMachine = TierMachine.TestCase
