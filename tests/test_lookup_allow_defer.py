"""`lookup(allow_defer=True)` on the façade and on the request handle: the lookup that may
answer ``None`` ("ask again later")."""

from __future__ import annotations

import pytest
import torch

from kvoffload import (
    InvalidInputError,
    KVLayout,
    KVOffloader,
    OffloadConfig,
    RequestStateError,
)
from kvoffload.testing import ControllableCopyEngine

pytestmark = pytest.mark.anyio

BS = 4
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_size=4, dtype="float32", block_size=BS)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def make_kv(num_blocks: int = 32) -> list[torch.Tensor]:
    return [torch.zeros(LAYOUT.tensor_shape(num_blocks)) for _ in range(2)]


def config() -> OffloadConfig:
    return OffloadConfig(block_size=BS, num_cpu_blocks=32, model_id="m")


async def test_the_offloader_defers_while_the_next_block_is_being_stored() -> None:
    engine = ControllableCopyEngine()
    async with KVOffloader(config(), make_kv(), copy_engine=engine) as off:
        prompt = list(range(13))
        hashes = off.hash_prompt(prompt)
        off.update("a", [0, 1, 2, 3], hashes, 13)
        [store] = off.store()
        assert off.lookup("b", hashes, 13) == 0  # a shorter hit, never "ask again"
        assert off.lookup("b", hashes, 13, allow_defer=True) is None
        assert off.lookup("b", hashes, 13, allow_defer=True) is None  # the older spelling
        engine.complete(store)
        await store
        assert off.lookup("b", hashes, 13, allow_defer=True) == 12
        assert off.scheduler.request_state("b").pinned  # the hit is pinned, as by lookup
        off.release("b")
        assert off.lookup("c", hashes, 13, allow_defer=True, no_read=True) == 0
        off.scheduler.check_invariants()
        for rid in ("a", "b", "c"):
            off.finish(rid)


async def test_the_handle_defers_while_the_next_block_is_being_stored() -> None:
    engine = ControllableCopyEngine()
    async with KVOffloader(config(), make_kv(), copy_engine=engine) as off:
        prompt = list(range(13))
        with off.request("a", prompt) as a:
            a.advance([0, 1, 2, 3], 13)
            [store] = off.store()
        with off.request("b", prompt) as b:
            assert b.lookup(allow_defer=True) is None  # "ask again after the store"
            assert b.hit_tokens == 0
            engine.complete(store)
            await store
            assert b.lookup(allow_defer=True) == 12
            assert b.hit_tokens == 12
            with pytest.raises(InvalidInputError, match="num_computed_tokens"):
                b.lookup(num_computed_tokens=3, allow_defer=True)
            # after the engine's prefix
            assert b.lookup(num_computed_tokens=4, allow_defer=True) == 8
            b.release()
        with pytest.raises(RequestStateError, match=r"'b' is already finished: lookup\(\)"):
            b.lookup(allow_defer=True)


async def test_a_store_that_never_lands_stops_the_deferral_after_the_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvoffload.scheduler import loads  # noqa: PLC0415

    MAX_LOOKUP_DEFERRALS = 64
    monkeypatch.setattr(loads, "MAX_LOOKUP_DEFERRALS", MAX_LOOKUP_DEFERRALS)
    engine = ControllableCopyEngine()
    async with KVOffloader(config(), make_kv(), copy_engine=engine) as off:
        off.scheduler.clock = lambda: 0.0  # the deadline never passes: the count
        prompt = list(range(13))
        hashes = off.hash_prompt(prompt)
        off.update("a", [0, 1, 2, 3], hashes, 13)
        [store] = off.store()  # never completed: the next block stays "being filled"
        for _ in range(MAX_LOOKUP_DEFERRALS):
            assert off.lookup("b", hashes, 13, allow_defer=True) is None
        assert off.statistics().scheduler.deferrals_bounded == 0
        # Then it answers with what is on CPU (nothing), counted; a new run may follow.
        assert off.lookup("b", hashes, 13, allow_defer=True) == 0
        stats = off.statistics().scheduler
        assert stats.deferrals_bounded == 1
        assert stats.deferred_lookups == MAX_LOOKUP_DEFERRALS
        assert off.lookup("b", hashes, 13, allow_defer=True) is None
        off.scheduler.check_invariants()
        engine.complete(store)
        await store
        assert off.lookup("b", hashes, 13, allow_defer=True) == 12
        off.release("b")
        for rid in ("a", "b"):
            off.finish(rid)


async def test_the_deferral_ends_at_its_deadline_on_the_scheduler_clock() -> None:
    from kvoffload.scheduler.loads import DEFER_DEADLINE_S  # noqa: PLC0415

    engine = ControllableCopyEngine()
    now = [100.0]
    async with KVOffloader(config(), make_kv(), copy_engine=engine) as off:
        off.scheduler.clock = lambda: now[0]
        prompt = list(range(13))
        hashes = off.hash_prompt(prompt)
        off.update("a", [0, 1, 2, 3], hashes, 13)
        [store] = off.store()
        assert off.lookup("b", hashes, 13, allow_defer=True) is None
        now[0] += DEFER_DEADLINE_S / 2
        assert off.lookup("b", hashes, 13, allow_defer=True) is None
        now[0] += DEFER_DEADLINE_S / 2  # the deadline, from the first "ask again"
        assert off.lookup("b", hashes, 13, allow_defer=True) == 0
        assert off.statistics().scheduler.deferrals_bounded == 1
        # Another request's run starts on its own.
        assert off.lookup("c", hashes, 13, allow_defer=True) is None
        engine.complete(store)
        await store
        for rid in ("a", "b", "c"):
            off.finish(rid)
