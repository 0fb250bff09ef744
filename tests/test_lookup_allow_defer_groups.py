"""`lookup(allow_defer=True)` with several KV cache groups answers "ask again later" by the
same rule as one group (`kvoffload.scheduler.loads.lookup_defers`): while a block the next
longer hit needs in some group is being stored, or a hit block is being loaded for
another request. Regression: a grouped handle's deferring lookup never deferred."""

from __future__ import annotations

import pytest
import torch

from kvoffload import KVOffloader, OffloadConfig
from kvoffload.groups import KVCacheGroup
from kvoffload.layout import KVLayout
from kvoffload.testing import ControllableCopyEngine

pytestmark = pytest.mark.anyio

BS = 4
ATTN = KVLayout(num_layers=2, num_kv_heads=1, head_size=4, dtype="float32", block_size=BS)
GROUPS = (
    KVCacheGroup.from_layout(ATTN, name="full"),
    KVCacheGroup.from_layout(ATTN, name="swa", kind="sliding_window", window=9),
)


async def test_a_grouped_lookup_defers_while_the_next_hit_is_being_stored() -> None:
    config = OffloadConfig(num_cpu_blocks=16, block_size=BS, checkpoint_tokens=8)
    kv = {g.name: [torch.zeros(ATTN.tensor_shape(24)) for _ in range(2)] for g in GROUPS}
    engines = {g.name: ControllableCopyEngine() for g in GROUPS}
    tokens = list(range(17))
    async with KVOffloader(config, kv, groups=GROUPS, copy_engine=engines) as off:
        with off.request("a", tokens) as a:
            assert a.lookup() == 0
            a.advance({g.name: list(range(5)) for g in GROUPS}, 16)
            assert off.store()  # the store of 16 tokens in every group, still copying
            with off.request("b", tokens) as b:
                try:
                    deferred = [b.lookup(allow_defer=True), b.lookup(allow_defer=True)]
                    plain = b.lookup()  # the plain lookup never defers
                    before = off.statistics().scheduler.deferred_lookups
                finally:  # a failed check must not leave the copies hanging
                    for engine in engines.values():
                        engine.complete_all()
                    await off.drain()
                assert deferred == [None, None]
                assert plain == 0
                assert b.lookup(allow_defer=True) == 16
                assert before == 2
                b.release()
        off.check_invariants()


async def test_a_grouped_lookup_stops_deferring_at_the_bound_and_answers_from_cpu() -> None:
    """As with one group (`deferral_spent()`): a store that never lands makes a request ask
    again only until its run of "ask again" answers reaches the deadline; the next lookup
    answers with what is on CPU, and the cut is counted."""
    config = OffloadConfig(num_cpu_blocks=16, block_size=BS, checkpoint_tokens=8)
    kv = {g.name: [torch.zeros(ATTN.tensor_shape(24)) for _ in range(2)] for g in GROUPS}
    engines = {g.name: ControllableCopyEngine() for g in GROUPS}
    tokens = list(range(17))
    now = [100.0]
    async with KVOffloader(config, kv, groups=GROUPS, copy_engine=engines) as off:
        off._life.front.scheduler.clock = lambda: now[0]  # type: ignore[union-attr]
        with off.request("a", tokens) as a:
            assert a.lookup() == 0
            a.advance({g.name: list(range(5)) for g in GROUPS}, 16)
            assert off.store()  # never completes while b asks
            with off.request("b", tokens) as b:
                try:
                    answers = [b.lookup(allow_defer=True) for _ in range(3)]
                    now[0] += 0.5  # within the deadline: still "ask again"
                    answers.append(b.lookup(allow_defer=True))
                    now[0] += 1.0  # past it: answered with the CPU hit (nothing yet)
                    answers.append(b.lookup(allow_defer=True))
                    answers.append(b.lookup(allow_defer=True))  # a new run starts
                    bounded = off.statistics().scheduler.deferrals_bounded
                finally:
                    for engine in engines.values():
                        engine.complete_all()
                    await off.drain()
                assert answers == [None, None, None, None, 0, None]
                assert bounded == 1
                b.release()
        off.check_invariants()


def test_a_promotion_of_a_later_store_point_alone_defers_the_lookup() -> None:
    """Regression: a recurrent group's tier held only the state where a request ended (a
    vLLM engine keeps no other), so no state of the points before it; with the full
    group's blocks back on CPU and that state's promotion still running, the lookup
    answered at once from CPU (the next aligned hit lacked a state nobody brings in) and
    the prefix was computed. A longer hit whose every missing block is being filled, in
    every group, now defers it."""
    from kvoffload.build import build_grouped_scheduler  # noqa: PLC0415
    from kvoffload.groups import needed  # noqa: PLC0415
    from kvoffload.hashing import BlockHash  # noqa: PLC0415
    from kvoffload.scheduler.group_loads import promotions_defer  # noqa: PLC0415

    full = KVCacheGroup.from_layout(ATTN, name="full")
    rec = KVCacheGroup(
        name="rec", kind="recurrent", block_size=BS, num_layers=1, bytes_per_layer_block=64
    )
    config = OffloadConfig(num_cpu_blocks=16, block_size=BS, checkpoint_tokens=BS)
    sched = build_grouped_scheduler(config, [full, rec], checkpoint_tokens=BS)
    lanes = {
        name: [BlockHash(bytes([k, i]) * 16) for i in range(4)]
        for k, name in enumerate(("full", "rec"))
    }
    ledgers = {name: sched.ledger(name) for name in lanes}

    def promote(name: str, indices: range, land: bool) -> None:
        ledger = ledgers[name]
        promotion = ledger.open_promotion([(i, lanes[name][i]) for i in indices], set())
        assert promotion is not None
        if land:
            ledger.close_promotion(promotion, [True] * len(promotion.blocks))

    class NothingProbing:
        def promoting(self, group: str, block_hash: BlockHash) -> bool:
            return False

    def defers() -> bool:
        return promotions_defer(
            sched.groups,
            ledgers,
            lanes,
            {},
            NothingProbing(),
            0,
            17,
            0,
            BS,  # type: ignore[arg-type]
        )

    promote("full", range(4), land=True)  # the full group's blocks are back
    assert not defers()  # nothing of the recurrent group is coming: no reason to wait
    promote("rec", needed(rec, 16), land=False)  # the state at the end is being read
    assert defers()  # the hit at 16 is there once it lands
    sched.check_invariants()
