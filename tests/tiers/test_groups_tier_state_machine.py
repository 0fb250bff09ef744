"""The multi-group offloader state machine (`tests/test_offloader_groups_state_machine.py`)
with a disk tier per group: the same engine simulation (conversations that look up, load,
compute in chunks, store, finish or are preempted, over a small CPU pool), plus resets of
the CPU pools (the tiers keep their blocks, so later lookups are served by promotions),
waits for the tiers' work, and one group's tier failing every read for a while. After every
step: `KVOffloader.check_invariants()` (every group's scheduler, ledger and tier manager),
and every load's bytes are checked in every group, those promoted from a tier included.
"""

from __future__ import annotations

import contextlib
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

from kvoffload import KVOffloader, OffloadConfig
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
        tier = {"kind": "disk", "path": str(self.dir / "kv.bin"), "capacity_bytes": "4MiB"}
        tier.update({"retry_initial_s": 0.01, "retry_max_s": 0.02})
        config = OffloadConfig(
            num_cpu_blocks=CPU_BLOCKS, block_size=BS, checkpoint_tokens=8, tiers=[tier]
        )
        off = KVOffloader(config, self.model.kv, groups=self.model.groups, pinner=self.pinners)
        self.stack = contextlib.ExitStack()
        self.portal = self.stack.enter_context(anyio.from_thread.start_blocking_portal())
        self.off = self.stack.enter_context(self.portal.wrap_async_context_manager(off))
        session = off._groups
        assert session is not None
        assert session.group_tiers is not None
        self.tiers = {n: m.tiers[0] for n, m in session.group_tiers.managers.items()}

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
        tier = self.tiers[self.names[group]]
        for op in ("exists", "get"):
            if broken:
                setattr(tier, op, _broken)
            else:
                vars(tier).pop(op, None)


class TieredFullSliding(TieredGroupsMachine):
    KIND = "sliding"


class TieredFullRecurrent(TieredGroupsMachine):
    KIND = "recurrent"


SETTINGS = settings(
    max_examples=10,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestTieredFullSliding = SETTINGS(TieredFullSliding).TestCase
TestTieredFullRecurrent = SETTINGS(TieredFullRecurrent).TestCase


def test_the_machine_loads_bytes_promoted_from_the_tiers() -> None:
    """A run whose load is served by promotions only: the machine's checks cover them."""
    for cls in (TieredFullSliding, TieredFullRecurrent):
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
