"""The multi-group offloader state machine (`tests/test_offloader_groups_state_machine.py`)
with a disk tier per group: the same engine simulation (conversations that look up, load,
compute in chunks, store, finish or are preempted, over a small CPU pool), plus resets of
the CPU pools (the tiers keep their blocks, so later lookups are served by promotions),
waits for the tiers' work, and one group's tier failing every read for a while. After every
step: `KVOffloader.check_invariants()` (every group's scheduler, ledger and tier manager),
and every load's bytes are checked in every group, those promoted from a tier included.
Every shape of that machine runs with tiers: one full group (a plain one-group offloader),
full + sliding window, full + recurrent, full + chunked; blocks are also corrupted in
place in a group's tier file (header or payload), which a promotion must refuse.
"""

from __future__ import annotations

import errno
import shutil
import tempfile
from pathlib import Path
from typing import NoReturn

import anyio
import anyio.from_thread
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, rule
from tier_helpers import patch_file

from kvoffload import KVOffloader, OffloadConfig
from kvoffload.tiers.disk import DiskTier
from tests.test_offloader_groups import BS
from tests.test_offloader_groups_state_machine import CPU_BLOCKS, OffloaderGroupsMachine


async def _broken(*args: object) -> NoReturn:
    raise OSError(errno.EIO, "Input/output error")


async def _settle(off: KVOffloader) -> None:
    await off.drain()
    with anyio.fail_after(10):
        while True:
            tiers = off.statistics().tiers
            assert tiers is not None
            if tiers.refs_held == 0 and tiers.promotions_in_flight == 0:
                return
            await anyio.sleep(0.005)


async def _reset(off: KVOffloader) -> None:
    await off.reset()


class TieredGroupsMachine(OffloaderGroupsMachine):
    KIND = "sliding"

    @initialize()
    def start(self) -> None:  # type: ignore[override]
        self.dir = Path(tempfile.mkdtemp(prefix="kvoffload-groups-"))
        self.hosts = {}  # the offloader makes its own host buffers (tiers need them)
        self.corrupted = 0
        tier = {"kind": "disk", "path": str(self.dir / "kv.bin"), "capacity_bytes": "4MiB"}
        tier.update({"retry_initial_s": 0.01, "retry_max_s": 0.02})
        if self.one:
            config = OffloadConfig(num_cpu_blocks=CPU_BLOCKS, block_size=BS, tiers=[tier])
            off = KVOffloader(config, self.model.kv["full"], pinner=self.pinners["full"])
        else:
            config = OffloadConfig(
                num_cpu_blocks=CPU_BLOCKS, block_size=BS, checkpoint_tokens=8, tiers=[tier]
            )
            off = KVOffloader(config, self.model.kv, groups=self.model.groups, pinner=self.pinners)
        self._enter(off)
        if self.one:
            manager = off.tiers
            assert manager is not None
            self.tiers = {"full": manager.tiers[0]}  # type: ignore[union-attr]
        else:
            session = off._life.front
            assert session is not None
            assert session.tiers is not None
            self.tiers = {n: m.tiers[0] for n, m in session.tiers.managers.items()}

    def teardown(self) -> None:
        try:
            super().teardown()
        finally:
            d = getattr(self, "dir", None)
            if d is not None:
                shutil.rmtree(d, ignore_errors=True)

    @rule()
    def settle_tiers(self) -> None:
        self.portal.call(_settle, self.off)

    @rule()
    def reset(self) -> None:
        self.portal.call(_reset, self.off)

    @rule(group=st.integers(0, 1), broken=st.booleans())
    def tier_reads_fail(self, group: int, broken: bool) -> None:
        tier = self.tiers[self.names[group % len(self.names)]]
        for op in ("exists", "get"):
            if broken:
                setattr(tier, op, _broken)
            else:
                vars(tier).pop(op, None)

    @rule(
        group=st.integers(0, 1),
        pick=st.integers(0, 1 << 30),
        where=st.sampled_from(["header", "payload"]),
    )
    def corrupt_tier_block(self, group: int, pick: int, where: str) -> None:
        """Flip bits of one block in a group's tier file, in place: a promotion of it
        must fail its verification (a miss), never load the wrong KV."""
        self.portal.call(_settle, self.off)  # no write or re-creation under way
        tier = self.tiers[self.names[group % len(self.names)]]
        assert isinstance(tier, DiskTier)
        index = dict(tier._index)
        if not index or tier._identity is None:
            return
        slot = sorted(index.values())[pick % len(index)]
        if where == "header":
            offset = tier._header_offset(slot) + 50
        else:
            offset = tier._offset(slot) + pick % 64
        patch_file(tier.path, offset, lambda old: bytes(b ^ 0x10 for b in old))
        self.corrupted += 1


class TieredFullOnly(TieredGroupsMachine):
    KIND = "full"


class TieredFullChunked(TieredGroupsMachine):
    KIND = "chunked"


class TieredFullSliding(TieredGroupsMachine):
    KIND = "sliding"


class TieredFullRecurrent(TieredGroupsMachine):
    KIND = "recurrent"


SETTINGS = settings(
    max_examples=25,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestTieredFullOnly = SETTINGS(TieredFullOnly).TestCase
TestTieredFullChunked = SETTINGS(TieredFullChunked).TestCase
TestTieredFullSliding = SETTINGS(TieredFullSliding).TestCase
TestTieredFullRecurrent = SETTINGS(TieredFullRecurrent).TestCase


def test_the_machine_loads_bytes_promoted_from_the_tiers() -> None:
    """A run whose load is served by promotions only: the machine's checks cover them."""
    for cls in (TieredFullOnly, TieredFullSliding, TieredFullRecurrent, TieredFullChunked):
        m = cls()
        m.start()
        try:
            m.admit(0, 12)
            m._compute("r1", 10)
            m._compute("r1", 10)
            m._end("r1", False)
            m.settle_tiers()
            m.reset()
            m.admit(0, 3)  # nothing on CPU: a miss that starts the promotions
            assert m.loads == 0
            m._end("r2", True)  # preempted: the conversation stays as it was
            m.settle_tiers()
            m.admit(0, 3)
            assert m.loads == 1
            m.invariants_hold()
            stats = m.off.statistics().tiers
            assert stats is not None
            assert all(t.blocks_promoted > 0 for t in stats.tiers)
        finally:
            m.teardown()


def test_a_block_corrupted_in_a_tier_file_is_never_loaded() -> None:
    """Every block of every group's tier file corrupted in place after the CPU cache was
    emptied: the promotions fail their checks, the next turn loads nothing."""
    for cls in (TieredFullOnly, TieredFullSliding, TieredFullRecurrent, TieredFullChunked):
        m = cls()
        m.start()
        try:
            m.admit(0, 12)
            m._compute("r1", 8)
            m._compute("r1", 4)
            m._end("r1", False)
            m.settle_tiers()
            m.reset()
            for group in range(len(m.names)):
                for pick in range(8):  # a distinct byte each time, every slot at least once
                    m.corrupt_tier_block(group, pick, "payload")
            assert m.corrupted == 8 * len(m.names), cls
            m.admit(0, 3)  # nothing on CPU: a miss that starts the promotions
            m._end("r2", True)
            m.settle_tiers()
            m.invariants_hold()
            m.admit(0, 3)
            assert m.loads == 0, cls
            m.invariants_hold()
        finally:
            m.teardown()
