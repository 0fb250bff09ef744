"""A promotion that never ends cannot make `lookup(allow_defer=True)` answer "ask again"
forever: after `MAX_LOOKUP_DEFERRALS` answers in a row, or the tiers' deferral deadline,
the lookup answers with what is on CPU (counted in ``deferrals_bounded``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest
from tier_helpers import BS, check, compute_and_store, config, make_kv, settle, tokens

from kvoffload.offloader import KVOffloader
from kvoffload.scheduler import loads
from kvoffload.tiers.promote import Promoter

pytestmark = pytest.mark.anyio

MAX_LOOKUP_DEFERRALS = 64
"""The count bound, lowered for these tests (the library's is far higher)."""


def disk(path: Path) -> dict[str, object]:
    return {"kind": "disk", "path": str(path), "capacity_bytes": "4MiB", "op_timeout_s": 3}


@pytest.fixture
def stuck_probe(monkeypatch: pytest.MonkeyPatch) -> anyio.Event:
    """Every probe of the tiers waits until the returned event is set (never, unless the
    test sets it)."""
    release = anyio.Event()
    real_probe = Promoter._probe

    async def probe(self: Promoter, *args: Any) -> Any:
        await release.wait()
        return await real_probe(self, *args)

    monkeypatch.setattr(Promoter, "_probe", probe)
    return release


async def evict_tail(off: KVOffloader, prompt: list[int], keep: int) -> list[Any]:
    """Store ``prompt`` (written to the tier), then drop all but ``keep`` blocks from CPU."""
    kv = make_kv()
    hashes = await compute_and_store(off, kv, "a", prompt, range(len(prompt) // BS))
    await settle(off)
    for block_hash in hashes[keep:]:
        block = off.pool.get_cached(block_hash)
        assert block is not None
        off.pool.unpublish(block)
    return hashes


async def test_a_probe_that_never_ends_defers_at_most_the_bound(
    tmp_path: Path, stuck_probe: anyio.Event, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(loads, "MAX_LOOKUP_DEFERRALS", MAX_LOOKUP_DEFERRALS)
    async with KVOffloader(config([disk(tmp_path / "kv.bin")]), make_kv()) as off:
        off.scheduler.clock = lambda: 0.0  # no deadline: the count bounds it
        prompt = tokens(3, 6)
        hashes = await evict_tail(off, prompt, keep=2)
        for _ in range(MAX_LOOKUP_DEFERRALS):
            assert off.lookup("b", hashes, len(prompt), allow_defer=True) is None
        assert off.tiers is not None
        assert off.tiers.is_promoting(hashes[2])  # the probe still has not answered
        # The bound: the CPU hit (two blocks), pinned as any lookup's, and counted.
        assert off.lookup("b", hashes, len(prompt), allow_defer=True) == 2 * BS
        assert off.scheduler.request_state("b").pinned
        assert off.statistics().scheduler.deferrals_bounded == 1
        assert off.statistics().tiers.deferred_lookups == MAX_LOOKUP_DEFERRALS  # type: ignore[union-attr]
        off.release("b")
        off.finish("b")
        check(off)
        stuck_probe.set()
        await settle(off)
        check(off)


async def test_a_probe_that_never_ends_defers_until_the_tiers_deadline(
    tmp_path: Path, stuck_probe: anyio.Event
) -> None:
    now = [50.0]
    async with KVOffloader(config([disk(tmp_path / "kv.bin")]), make_kv()) as off:
        off.scheduler.clock = lambda: now[0]
        assert off.tiers is not None
        deadline = off.tiers.defer_deadline_s
        assert deadline == 3 * (1 + 256 // 16)  # a probe, 16 reads: each op_timeout_s
        prompt = tokens(4, 6)
        hashes = await evict_tail(off, prompt, keep=3)
        assert off.lookup("b", hashes, len(prompt), allow_defer=True) is None
        now[0] += deadline - 0.5
        assert off.lookup("b", hashes, len(prompt), allow_defer=True) is None
        now[0] += 0.5
        assert off.lookup("b", hashes, len(prompt), allow_defer=True) == 3 * BS
        assert off.statistics().scheduler.deferrals_bounded == 1
        off.release("b")
        off.finish("b")
        stuck_probe.set()
        await settle(off)
        check(off)
