"""A lookup that a secondary tier could not serve says why (`MissReason`), through the
public API (`KVOffloader` with a disk tier), with one KV cache group and with several: a
tier that lacks the block (the pool remembers evicting it: ``evicted``), a tier that
timed out on it, a tier that is unhealthy, a block that failed its check (all
``tier_failed``). Each scenario can produce only its reason, and the statistics count
what the test tallied."""

from __future__ import annotations

import errno
from collections import Counter
from pathlib import Path
from typing import NoReturn

import anyio
import pytest
import torch
from test_offloader_groups import Model, Tables, groups_of, serve
from tier_helpers import (
    BS,
    compute_and_store,
    config,
    make_kv,
    patch_file,
    settle,
    tier_stats,
    tokens,
    wait_until,
)

from kvoffload import KVOffloader, MissReason, OffloadConfig
from kvoffload.hashing import BlockHash, BlockHasher
from kvoffload.tiers.base import SecondaryTier

pytestmark = pytest.mark.anyio

R = MissReason


def disk(path: Path, **kw: object) -> dict[str, object]:
    return {"kind": "disk", "name": "d", "path": str(path), "capacity_bytes": "4MiB", **kw}


class Tally:
    """Looks prompts up through the handle and counts each reason as the test sees it."""

    def __init__(self, off: KVOffloader) -> None:
        self.off = off
        self.lookups: Counter[MissReason] = Counter()
        self.seen: list[MissReason] = []

    def lookup(self, rid: str, prompt: list[int]) -> MissReason:
        with self.off.request(rid, prompt) as req:
            req.lookup()
            reason = req.miss_reason
            assert reason is not None
        if reason is not R.NONE:
            self.lookups[reason] += 1
        self.seen.append(reason)
        self.off.check_invariants()
        return reason

    def check(self) -> None:
        stats = self.off.statistics()
        assert dict(stats.scheduler.lookup_misses) == dict(self.lookups)


def the_tier(off: KVOffloader) -> SecondaryTier:
    assert off.tiers is not None
    return off.tiers.tiers[0]


async def stored_and_written(
    off: KVOffloader, kv: list[torch.Tensor]
) -> tuple[list[int], list[BlockHash]]:
    prompt = tokens(5, 4)
    hashes = await compute_and_store(off, kv, "a", prompt, range(4))
    await settle(off)
    assert await the_tier(off).exists(hashes) == 4
    return prompt, hashes


async def scan(off: KVOffloader, kv: list[torch.Tensor]) -> None:
    """Other prompts that evict everything else from the 16-block CPU pool."""
    for i in range(6):
        await compute_and_store(off, kv, f"scan{i}", tokens(100 + i, 4), range(20, 24))
    await settle(off)


async def test_a_tier_that_lacks_an_evicted_block_reads_evicted(tmp_path: Path) -> None:
    kv = make_kv()
    async with KVOffloader(config([disk(tmp_path / "kv.bin")]), kv) as off:
        t = Tally(off)
        prompt, hashes = await stored_and_written(off, kv)
        await the_tier(off).delete(hashes)  # the tier lost it (its own eviction)
        await scan(off, kv)
        assert not off.pool.is_cached(hashes[0])
        assert t.lookup("b", prompt) is R.IN_FLIGHT  # the tier is asked
        await settle(off)
        assert t.lookup("c", prompt) is R.EVICTED  # it did not have it
        assert tier_stats(off).errors == 0
        assert tier_stats(off).failed_checks == 0
        t.check()


async def test_a_tier_that_timed_out_reads_tier_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    kv = make_kv()
    cfg = config([disk(tmp_path / "kv.bin", op_timeout_s=0.05, retry_initial_s=20)])
    async with KVOffloader(cfg, kv) as off:
        t = Tally(off)
        prompt, _ = await stored_and_written(off, kv)
        tier = the_tier(off)

        async def stuck(*args: object) -> int:
            await anyio.sleep(30)
            return 0

        monkeypatch.setattr(tier, "exists", stuck)
        assert await off.reset()
        assert t.lookup("b", prompt) is R.IN_FLIGHT
        await settle(off)
        assert "Timeout" in tier_stats(off).last_error
        assert t.lookup("c", prompt) is R.TIER_FAILED
        t.check()


async def test_an_unhealthy_tier_reads_tier_failed(tmp_path: Path) -> None:
    path = tmp_path / "kv.bin"
    kv = make_kv()
    async with KVOffloader(config([disk(path, retry_initial_s=20)]), kv) as off:
        t = Tally(off)
        prompt, _ = await stored_and_written(off, kv)
        path.unlink()
        path.mkdir()  # the next write-down fails: the tier is unhealthy, and stays so
        await compute_and_store(off, kv, "x", tokens(7, 2), range(8, 10))
        await settle(off)
        assert not tier_stats(off).healthy
        assert await off.reset()
        # No tier read is tried for it (nothing failed on this block): the tier is down.
        assert t.lookup("b", prompt) is R.TIER_FAILED
        assert tier_stats(off).blocks_read == 0
        t.check()


async def test_a_block_that_failed_its_check_reads_tier_failed(tmp_path: Path) -> None:
    path = tmp_path / "kv.bin"
    kv = make_kv()
    async with KVOffloader(config([disk(path)]), kv) as off:
        t = Tally(off)
        prompt, hashes = await stored_and_written(off, kv)
        tier = the_tier(off)
        slot = tier._index[hashes[0]]  # type: ignore[attr-defined]
        offset = tier._offset(slot) + 77  # type: ignore[attr-defined]
        patch_file(path, offset, lambda old: bytes([old[0] ^ 0x01]))  # one payload bit
        assert await off.reset()
        assert t.lookup("b", prompt) is R.IN_FLIGHT
        await settle(off)
        assert tier_stats(off).failed_checks == 1
        assert tier_stats(off).healthy
        # The bad block was deleted from the tier: one more probe finds it absent.
        assert t.lookup("c", prompt) is R.IN_FLIGHT
        await settle(off)
        assert t.lookup("d", prompt) is R.TIER_FAILED
        t.check()


# -- several KV cache groups ---------------------------------------------------------------

TURN1 = list(range(1, 19))  # 18 tokens: store points 8, 16 and the finish at 16
TURN2 = [*TURN1, 50, 51, 52]


def grouped_config(path: Path, **disk_kw: object) -> OffloadConfig:
    tier = disk(path, **disk_kw)
    return OffloadConfig(num_cpu_blocks=32, block_size=BS, checkpoint_tokens=8, tiers=[tier])


def group_tier(off: KVOffloader, group: str) -> SecondaryTier:
    session = off._life.front
    assert session is not None
    assert session.tiers is not None
    return session.tiers.managers[group].tiers[0]


class GroupTally:
    """`Tally` for a grouped offloader: the reason of each lookup, and per group."""

    def __init__(self, off: KVOffloader) -> None:
        self.off = off
        self.lookups: Counter[MissReason] = Counter()
        self.blamed: dict[str, Counter[MissReason]] = {}

    def lookup(self, rid: str, prompt: list[int], blamed: str) -> MissReason:
        """Look ``prompt`` up; the test says which group it expects to be blamed."""
        with self.off.request(rid, prompt) as req:
            req.lookup()
            reason = req.miss_reason
            assert reason is not None
        if reason is not R.NONE:
            self.lookups[reason] += 1
            self.blamed.setdefault(blamed, Counter())[reason] += 1
        self.off.check_invariants()
        return reason

    def start(self) -> None:
        """Count from here on (the set-up's own lookups are not the scenario's)."""
        stats = self.off.statistics()
        groups = stats.groups
        assert groups is not None
        self.before = Counter(stats.scheduler.lookup_misses)
        self.before_groups = {n: Counter(g.lookup_misses) for n, g in groups.items()}

    def check(self) -> None:
        stats = self.off.statistics()
        assert Counter(stats.scheduler.lookup_misses) - self.before == self.lookups
        groups = stats.groups
        assert groups is not None
        for name, g in groups.items():
            added = Counter(g.lookup_misses) - self.before_groups[name]
            assert added == self.blamed.get(name, Counter()), name


async def grouped_stored(off: KVOffloader, model: Model, alloc: Tables) -> None:
    """TURN1 served, stored in every group's pool and written down to its tier."""
    await serve(off, model, alloc, "a", TURN1)
    await grouped_settle(off)


async def grouped_settle(off: KVOffloader) -> None:
    await off.drain()

    def quiet() -> bool:
        tiers = off.statistics().tiers
        assert tiers is not None
        return tiers.refs_held == 0 and not tiers.promotions_in_flight

    await wait_until(quiet)
    off.check_invariants()


async def test_groups_a_tier_that_lacks_a_group_s_blocks_reads_group_missing(
    tmp_path: Path,
) -> None:
    model = Model(groups_of("recurrent"))
    async with KVOffloader(
        grouped_config(tmp_path / "kv.bin"), model.kv, groups=model.groups
    ) as off:
        t = GroupTally(off)
        await grouped_stored(off, model, Tables(model))
        await group_tier(off, "rec").delete(group_hashes(off, "rec"))  # the tier lost them
        assert await off.reset()
        t.start()
        assert t.lookup("b", TURN2, "full") is R.IN_FLIGHT  # both groups' tiers are asked
        await grouped_settle(off)
        # The full group's blocks came back; the recurrent group's tier had nothing.
        assert t.lookup("c", TURN2, "rec") is R.GROUP_MISSING
        t.check()


def group_hashes(off: KVOffloader, group: str) -> list[BlockHash]:
    """``group``'s block hashes of TURN2 (its tier's keys)."""
    session = off._life.front
    assert session is not None
    hasher = BlockHasher(session.namespaces[group].root, BS)
    hasher.extend(TURN2)
    return list(hasher.block_hashes)


async def test_groups_a_tier_that_timed_out_reads_tier_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = Model(groups_of("recurrent"))
    cfg = grouped_config(tmp_path / "kv.bin", op_timeout_s=0.05, retry_initial_s=20)
    async with KVOffloader(cfg, model.kv, groups=model.groups) as off:
        t = GroupTally(off)
        await grouped_stored(off, model, Tables(model))

        async def stuck(*args: object) -> int:
            await anyio.sleep(30)
            return 0

        monkeypatch.setattr(group_tier(off, "rec"), "exists", stuck)
        assert await off.reset()
        t.start()
        assert t.lookup("b", TURN2, "full") is R.IN_FLIGHT
        await grouped_settle(off)
        assert t.lookup("c", TURN2, "rec") is R.TIER_FAILED
        t.check()


async def test_groups_an_unhealthy_tier_reads_tier_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = Model(groups_of("recurrent"))
    cfg = grouped_config(tmp_path / "kv.bin", retry_initial_s=20)
    async with KVOffloader(cfg, model.kv, groups=model.groups) as off:
        t = GroupTally(off)
        alloc = Tables(model)
        await grouped_stored(off, model, alloc)
        rec = group_tier(off, "rec")

        async def broken(*args: object) -> NoReturn:
            raise OSError(errno.EIO, "Input/output error")

        for op in ("put", "ping"):  # the rec group's next write-down fails, and stays down
            monkeypatch.setattr(rec, op, broken)
        await serve(off, model, alloc, "x", list(range(300, 318)))
        await grouped_settle(off)
        stats = off.statistics().tiers
        assert stats is not None
        assert [s.healthy for s in stats.tiers] == [True, False]
        assert await off.reset()
        t.start()
        assert t.lookup("b", TURN2, "full") is R.IN_FLIGHT  # the full group's tier is read
        await grouped_settle(off)
        assert t.lookup("c", TURN2, "rec") is R.TIER_FAILED
        t.check()


async def test_groups_a_block_that_failed_its_check_reads_tier_failed(tmp_path: Path) -> None:
    model = Model(groups_of("recurrent"))
    path = tmp_path / "kv.bin"
    async with KVOffloader(grouped_config(path), model.kv, groups=model.groups) as off:
        t = GroupTally(off)
        await grouped_stored(off, model, Tables(model))
        rec = group_tier(off, "rec")
        rec_path = tmp_path / "kv.rec.bin"
        index = rec._index  # type: ignore[attr-defined]
        for slot in list(index.values()):  # one bit of each 48-byte payload
            offset = rec._offset(slot) + 1  # type: ignore[attr-defined]
            patch_file(rec_path, offset, lambda old: bytes([old[0] ^ 0x01]))
        assert await off.reset()
        t.start()
        assert t.lookup("b", TURN2, "full") is R.IN_FLIGHT
        await grouped_settle(off)
        stats = off.statistics().tiers
        assert stats is not None
        checks = {s.name: s.failed_checks for s in stats.tiers}
        assert checks["d.full"] == 0
        assert checks["d.rec"] > 0
        # The bad blocks were deleted from the tier: one more probe finds them absent.
        assert t.lookup("c", TURN2, "rec") is R.IN_FLIGHT
        await grouped_settle(off)
        assert t.lookup("d", TURN2, "rec") is R.TIER_FAILED
        t.check()


async def test_the_handle_says_which_tier_brought_a_hit_in(tmp_path: Path) -> None:
    kv = make_kv()
    async with KVOffloader(config([disk(tmp_path / "kv.bin")]), kv) as off:
        prompt, _ = await stored_and_written(off, kv)
        assert await off.reset()  # only the tier holds the prompt now
        with off.request("b", prompt) as req:
            assert req.lookup(allow_defer=True) is None  # the tier is asked
            assert req.tier_hit_tokens == {}
        await settle(off)
        with off.request("c", prompt) as req:
            assert req.lookup() == 4 * BS
            assert req.tier_hit_tokens == {"d": 4 * BS}  # promoted for this lookup
            assert req.miss_reason is R.BOUNDARY  # the one-token tail is not a block
        with off.request("d", prompt) as req:
            assert req.lookup() == 4 * BS
            assert req.tier_hit_tokens == {}  # in the CPU pool since
        # A prefetch brings it in for the next lookup, which names the tier too.
        assert await off.reset()
        assert await off.hints.prefetch(prompt) == 4
        with off.request("e", prompt[: 2 * BS + 1]) as req:
            assert req.lookup() == 2 * BS
            assert req.tier_hit_tokens == {"d": 2 * BS}
        off.check_invariants()
