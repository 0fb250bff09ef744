"""A lookup that does not defer takes what is in CPU now; its promotion lands harmlessly.

The request goes on with the CPU hit (loads it, computes the rest, finishes) while the
promotion of the blocks after the hit is still reading from the tier. When it lands, it
publishes those blocks, bit-exact, for the next lookup, and touches nothing of the request
that went on: not its GPU blocks, not its stores, not a reference.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from tier_helpers import (
    BS,
    block_kv,
    check,
    compute_and_store,
    config,
    expected_block,
    lookup_load,
    make_kv,
    settle,
    tier_stats,
    tokens,
)

from kvoffload.offloader import KVOffloader
from kvoffload.tiers.promote import Promoter

pytestmark = pytest.mark.anyio


def disk(path: Path) -> dict[str, object]:
    return {"kind": "disk", "path": str(path), "capacity_bytes": "4MiB"}


async def test_a_promotion_landing_after_the_request_went_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    kv = make_kv()
    held = anyio.Event()
    reading = anyio.Event()
    real_read_into = Promoter._read_into

    async def held_read_into(self: Promoter, *args: Any) -> list[bool]:
        reading.set()
        await held.wait()  # the tier read takes "too long"
        return await real_read_into(self, *args)

    monkeypatch.setattr(Promoter, "_read_into", held_read_into)
    async with KVOffloader(config([disk(tmp_path / "kv.bin")]), kv) as off:
        prompt = tokens(5, 6)
        hashes = await compute_and_store(off, kv, "a", prompt, range(6))
        await settle(off)
        assert tier_stats(off).blocks_written == 6
        # Blocks 3..5 leave the CPU pool; the tier still has them.
        for block_hash in hashes[3:]:
            block = off.pool.get_cached(block_hash)
            assert block is not None
            off.pool.unpublish(block)
        # The request wants its hit now: 3 blocks from CPU, and a promotion starts.
        assert off.lookup("b", hashes, len(prompt) + 1) == 3 * BS
        with anyio.fail_after(10):
            await reading.wait()
        assert off.tiers is not None
        assert all(off.tiers.is_promoting(h) for h in hashes[3:])
        check(off)
        # b goes on: loads its hit, computes blocks 3..5 itself, stores and finishes.
        gpu = [10, 11, 12, 13, 14, 15]
        for t in kv:
            t[gpu] = float("nan")
        task = off.load("b", gpu, 3 * BS)
        assert task is not None
        await task
        for i in range(3, 6):
            want = expected_block(hashes[i], kv)
            for layer, t in enumerate(kv):
                t[gpu[i]] = want[layer]
        off.update("b", gpu, hashes, 6 * BS)
        for store in off.store():  # the blocks being promoted are not stored again
            await store
        off.finish("b")
        await off.drain()
        assert not any(off.pool.is_cached(h) for h in hashes[3:])  # not before it lands
        b_kv = [block_kv(kv, g).clone() for g in gpu]
        check(off)
        held.set()  # the promotion lands, after b finished
        await settle(off)
        assert all(off.pool.is_cached(h) for h in hashes)
        assert tier_stats(off).blocks_promoted == 3
        for g, before in zip(gpu, b_kv, strict=True):
            assert torch.equal(block_kv(kv, g), before)  # b's GPU blocks untouched
        assert off.pool.num_free == off.pool.num_blocks
        check(off)
        # What it published is the right KV: the next request loads all six, bit-exact.
        assert await lookup_load(off, kv, "c", prompt + [1], range(20, 26)) == 6 * BS
        await settle(off)
        assert off.pool.num_free == off.pool.num_blocks
        check(off)


async def test_a_probe_that_missed_a_block_stored_meanwhile_does_not_hide_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A probe answered "absent" before a store of the same block published it: once the
    block leaves the CPU pool, the next lookup still promotes it from the tier (no stale
    "absent" mark)."""
    kv = make_kv()
    answered = anyio.Event()
    go_on = anyio.Event()
    real_probe = Promoter._probe

    async def late_probe(self: Promoter, hashes: Any) -> Any:
        sources = await real_probe(self, hashes)
        answered.set()
        await go_on.wait()  # the answer is delivered after the store published
        return sources

    monkeypatch.setattr(Promoter, "_probe", late_probe)
    async with KVOffloader(config([disk(tmp_path / "kv.bin")], num_cpu_blocks=4), kv) as off:
        assert off.tiers is not None
        prompt = tokens(7, 3)
        hashes = off.hash_prompt(prompt)
        assert off.lookup("a", hashes, len(prompt)) == 0  # starts a probe: nothing anywhere
        await answered.wait()
        off.release("a")
        await compute_and_store(off, kv, "a", prompt, range(3))
        assert off.pool.get_cached(hashes[0]) is not None
        go_on.set()
        monkeypatch.undo()
        await settle(off)
        assert tier_stats(off).blocks_written == 3
        await compute_and_store(off, kv, "o", tokens(8, 4), range(3, 7))  # evicts the prompt
        await settle(off)
        assert off.pool.get_cached(hashes[0]) is None
        assert off.lookup("b", hashes, len(prompt)) == 0
        assert off.tiers.is_promoting(hashes[0])
        off.release("b")
        await settle(off)
        assert await lookup_load(off, kv, "c", prompt, range(7, 10)) == 3 * BS
        check(off)
