"""After a reset, no store reads a table entry that was not compared again, on every
shape. A reset moves every store cursor back to 0, over entries the engine may have
changed since they were stored (an entry below the cursor is read by nothing, so an
update does not compare it). Until the request's next ``update()`` compared its whole
table, it stores nothing and a finish holds or stores nothing of it: otherwise a store
would read a GPU block the engine gave to another request, under this one's hash."""

from __future__ import annotations

from typing import Any

import pytest
from groups_helpers import Rig, group

from kvoffload.config import OffloadConfig
from kvoffload.errors import BlockTableError
from kvoffload.hashing import BlockHasher, HashNamespace
from kvoffload.pool.block_pool import CpuBlockPool
from kvoffload.scheduler import OffloadScheduler

TOKENS = list(range(12))
HOLD = {"hold_blocks_on_finish": True, "hold_max_blocks": 8}


class Shape:
    """One scheduler of one shape, called with one group's flat lists; ``stored()`` and
    ``held()`` read back what it plans and holds in group "f" (the full one)."""

    def __init__(self, shape: str, **settings: object) -> None:
        config = OffloadConfig(num_cpu_blocks=32, block_size=4, **settings)  # type: ignore[arg-type]
        self.grouped = shape != "one group"
        if not self.grouped:
            self.sched: Any = OffloadScheduler(config, CpuBlockPool(32), num_gpu_blocks=32)
            hasher = BlockHasher(HashNamespace(model_id="t").root, 4)
            hasher.extend(TOKENS)
            self.hashes: Any = list(hasher.block_hashes)
            return
        groups = [group("f", "full", 4)]
        if shape == "full + sliding window":
            groups.append(group("w", "sliding_window", 4, window=8))
        self.rig = Rig(groups, cpu_blocks=32, gpu_blocks=32, checkpoint_tokens=4, config=config)
        self.sched = self.rig.sched
        self.hashes = self.rig.hashes(TOKENS)
        self.window = shape == "full + sliding window"

    def update(self, table: list[int], computed: int) -> None:
        if not self.grouped:
            self.sched.update("a", table, self.hashes[: len(table)], computed)
            return
        tables = {"f": table}
        hashes = {"f": self.hashes["f"][: len(table)]}
        if self.window:
            tables["w"] = [20 + i for i in range(len(table))]
            hashes["w"] = self.hashes["w"][: len(table)]
        self.sched.update("a", tables, hashes, computed)

    def store(self) -> tuple[int, ...]:
        """This step's stores of group "f", completed; its GPU blocks."""
        plan = self.sched.plan_stores()
        if plan is None:
            return ()
        if not self.grouped:
            self.sched.complete(plan, True)
            return tuple(plan.gpu_block_ids)
        self.sched.complete_all(plan, True)
        part = plan.plans.get("f")
        return () if part is None else tuple(part.gpu_block_ids)

    def finish(self) -> object:
        """Finish "a": what one group holds, or the grouped plan and holds."""
        out = self.sched.finish("a")
        if not self.grouped:
            return list(out)
        if out is not None:
            self.sched.complete_all(out, True)
            return {"planned": {n: p.gpu_block_ids for n, p in out.plans.items()}}
        return self.sched.held_blocks("a").get("f", [])


SHAPES = ["one group", "one full group", "full + sliding window"]


def stored_then_changed_below_the_cursor(s: Shape) -> None:
    """Blocks 0 and 1 stored from GPU blocks 1 and 2; then the engine's entry 0 became 7
    (below the cursor: not compared, the known table keeps 1)."""
    s.update([1, 2], 8)
    assert s.store() == (1, 2)
    s.update([7, 2, 3], 8)


@pytest.mark.parametrize("shape", SHAPES)
def test_after_a_reset_a_table_is_compared_again_before_anything_is_stored(shape: str) -> None:
    s = Shape(shape)
    stored_then_changed_below_the_cursor(s)
    s.sched.reset()
    assert s.store() == ()  # not from the table as it was known
    with pytest.raises(BlockTableError, match=r"\[0\] changed from 1 to 7"):
        s.update([7, 2, 3], 12)
    s.update([1, 2, 3], 12)  # the table it knows: compared whole, stores may read it
    assert s.store() == (1, 2, 3)
    s.sched.check_invariants()


@pytest.mark.parametrize("shape", SHAPES)
def test_a_finish_after_a_reset_holds_nothing_not_compared_again(shape: str) -> None:
    s = Shape(shape, **HOLD)
    stored_then_changed_below_the_cursor(s)
    s.sched.reset()
    assert s.finish() == []  # entry 0 is the engine's block 7 now, not 1
    assert s.store() == ()
    assert not s.sched.take_released_holds()
    s.sched.check_invariants()


def test_a_finish_after_a_reset_stores_no_point_from_a_table_not_compared_again() -> None:
    s = Shape("full + sliding window")
    stored_then_changed_below_the_cursor(s)
    s.sched.reset()
    assert s.finish() == []
    s.sched.check_invariants()


@pytest.mark.parametrize("shape", SHAPES)
def test_a_preempted_request_needs_no_recheck(shape: str) -> None:
    """A preemption drops the table: the next one is new, nothing to compare again."""
    s = Shape(shape)
    stored_then_changed_below_the_cursor(s)
    s.sched.reset()
    s.sched.preempt("a")
    s.update([9, 10, 11], 12)
    assert s.store() == (9, 10, 11)
    s.sched.check_invariants()
