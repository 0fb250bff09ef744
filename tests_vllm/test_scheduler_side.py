"""One scheduler side for every model shape: the class that serves a model of one
full-attention group is the class that serves one of several groups; only the loads'
timing (`loads_are_async`) follows the number of groups."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from harness import make_request
from test_scheduler_groups import GroupHarness
from test_scheduler_level import make, prompt
from vllm.v1.core.sched.output import SchedulerOutput

from kvoffload.config import OffloadConfig
from kvoffload.errors import ConfigError
from kvoffload.groups import KVCacheGroup
from kvoffload.hashing import BlockHash
from kvoffload.integrations.vllm.metadata import KVOffloadConnectorMetadata
from kvoffload.integrations.vllm.scheduler_side import SchedulerSide

FULL = KVCacheGroup(name="g0", kind="full", block_size=16, num_layers=2, bytes_per_layer_block=64)
WINDOW = KVCacheGroup(
    name="g1",
    kind="sliding_window",
    block_size=16,
    window=32,
    num_layers=1,
    bytes_per_layer_block=64,
)
ROOTS = {"g0": BlockHash(bytes(32)), "g1": BlockHash(bytes([1]) * 32)}


def test_one_class_serves_one_group_and_two_groups(model_dir: Path) -> None:
    one = make(model_dir)
    two = GroupHarness(model_dir)
    assert type(one.side) is type(two.side) is SchedulerSide
    for h, async_loads in ((one, False), (two, True)):
        side = h.side
        assert isinstance(side, SchedulerSide)
        metas: list[KVOffloadConnectorMetadata] = []
        build = side.build_connector_meta

        def spy(out: SchedulerOutput, build: Any = build, metas: Any = metas) -> Any:
            metas.append(build(out))
            return metas[-1]

        side.build_connector_meta = spy  # type: ignore[method-assign]
        h.run(make_request("a", prompt(4, 5, seed=1), max_tokens=2))
        h.settle()
        assert {m.async_loads for m in metas} == {async_loads}  # a policy of the groups
        assert any(m.group_stores for m in metas)  # every plan travels as a GroupTransfer
        assert not hasattr(metas[0], "loads")  # one format: no plain plan fields
        assert not hasattr(metas[0], "stores")
        own = h.side.statistics().scheduler  # type: ignore[union-attr]
        assert own is not None
        assert own.stored_blocks >= 4


def test_lazy_stores_serve_one_group(model_dir: Path) -> None:
    """A finished request's blocks wait in vLLM's free queue: the lazy scan stores the
    ones closest to eviction from there, through the one group's view."""
    h = make(model_dir, store_mode="lazy", lazy_offload_blocks=8)
    h.run(make_request("a", prompt(4, 5, seed=1), max_tokens=2))
    for _ in range(3):
        h.step()
    h.settle()
    h.check()
    assert h.stats().stored_blocks >= 4
    assert h.pool.num_cached >= 4


def test_lazy_stores_are_refused_for_a_group_not_full_attention() -> None:
    lazy = OffloadConfig(num_cpu_blocks=8, block_size=16, store_mode="lazy")
    SchedulerSide(lazy, [FULL], ROOTS, world_size=1, num_gpu_blocks=64)  # honoured
    with pytest.raises(ConfigError, match=r"store_mode='lazy'.*group 'g1' \(sliding_window\)"):
        SchedulerSide(lazy, [FULL, WINDOW], ROOTS, world_size=1, num_gpu_blocks=64)


@pytest.mark.parametrize("groups", [1, 2])
def test_a_reused_request_id_runs_without_offload_and_nothing_breaks(
    model_dir: Path, groups: int
) -> None:
    """kvoffload refuses every call naming a finished request's id (its state is never
    reused), and a client may send a new request under an id it used before: the
    connector serves that request without offload instead of failing vLLM's step, and
    the next request is offloaded as usual."""
    h = make(model_dir) if groups == 1 else GroupHarness(model_dir)
    side = h.side
    assert isinstance(side, SchedulerSide)

    def stats() -> Any:
        own = side.statistics().scheduler
        assert own is not None
        return own

    tokens = prompt(4, 5, seed=3)
    h.run(make_request("a", tokens, max_tokens=2))
    h.settle()
    stored = stats().stored_blocks
    assert stored >= 4
    assert side.scheduler.was_finished("a")
    h.run(make_request("a", tokens, max_tokens=2))  # vLLM takes the id again
    h.settle()
    assert stats().stored_blocks == stored  # nothing stored for the reused id
    assert stats().load_plans == 0  # nor loaded
    assert not side.scheduler.has_request("a")
    h.run(make_request("b", prompt(6, 5, seed=4), max_tokens=2))  # 2 blocks more
    h.settle()
    assert stats().stored_blocks >= stored + 2  # the next request is offloaded again
    side.scheduler.check_invariants()
