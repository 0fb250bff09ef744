"""`KVOffloader` and `OffloadRequest` with several KV cache groups never serve KV they
were not given, through real `ThreadCopyEngine`s with every loaded byte checked: a
preempted request stores nothing from the GPU blocks its engine reuses, table entries
below a loaded window are never published, and a table naming one GPU block twice is
refused by the handle."""

from __future__ import annotations

import threading

import pytest

from kvoffload import KVOffloader
from kvoffload.errors import BlockTableError
from kvoffload.testing import CopyFaults
from tests.test_offloader_groups import Model, Tables, config, engines_for, groups_of, serve

pytestmark = pytest.mark.anyio


async def test_preempt_stores_nothing_from_the_blocks_the_engine_reuses() -> None:
    model = Model(groups_of("sliding"))
    alloc = Tables(model)
    gate = threading.Event()
    gate.set()
    faults = {g.name: CopyFaults(gate=gate) for g in model.groups}
    engines, hosts = engines_for(model, faults, 32)
    try:
        async with KVOffloader(
            config(checkpoint=16), model.kv, groups=model.groups, copy_engine=engines
        ) as off:
            tokens = list(range(1, 26))  # point 16 is stored while it runs; 24 is its last
            with off.request("a", tokens) as req:
                req.lookup()
                tables = alloc.new(req.blocks_for(len(tokens)))
                model.fill(tables, tokens)
                req.advance(tables, len(tokens))
                off.store()
                await off.drain()
                stored = off.statistics().scheduler.stored_blocks
                gate.clear()  # a copy started from here on waits for the engine's reuse
                req.preempt()
                # the engine hands a's blocks to another request, which computes into them
                model.fill(tables, [t + 500 for t in tokens])
                gate.set()
                await off.drain()
                assert off.statistics().scheduler.stored_blocks == stored
            await off.drain()
            assert off.statistics().scheduler.stored_blocks == stored
            hit, _ = await serve(off, model, alloc, "b", [*tokens, 9])  # bytes checked
            assert hit == 16  # what was stored before the preemption
            off.check_invariants()
    finally:
        for host in hosts.values():
            host.close()


async def test_entries_below_a_loaded_window_are_never_published() -> None:
    model = Model(groups_of("sliding"))  # a hit at N needs the window's blocks N/4-2, N/4-1
    alloc = Tables(model)
    async with KVOffloader(config(checkpoint=16), model.kv, groups=model.groups) as off:
        first = list(range(1, 34))
        with off.request("a", first) as req:
            assert req.lookup() == 0
            tables = alloc.new(req.blocks_for(len(first)))
            tables["swa"][:6] = [None] * 6  # its engine frees what left the window
            model.fill(tables, first)
            req.advance(tables, len(first))  # points 16 (nothing held) and 32 stored
            off.store()
        await off.drain()
        model.wipe()
        second = [*first, 7, 7, 7, 7]
        with off.request("b", second) as req:
            assert req.lookup() == 32
            tables = alloc.new(req.blocks_for(len(second)))  # names blocks it never wrote
            task = req.load(tables)
            assert task is not None
            await task
            model.check(tables, second, 32)
            computed = {
                n: [b if i >= 8 else None for i, b in enumerate(t)] for n, t in tables.items()
            }
            model.fill(computed, second)  # the engine computes from the hit on
            req.advance(tables, len(second))  # point 16 needs window blocks 2, 3
            off.store()
        await off.drain()
        # a third request whose hit at 16 would need window blocks 2, 3 gets no wrong byte
        hit, _ = await serve(off, model, alloc, "c", first[:17])
        assert hit == 0
        stats = off.statistics().groups
        assert stats is not None
        assert stats["swa"].skipped_null_blocks >= 4  # a's 2 None entries, b's 2 unwritten
        off.check_invariants()


async def test_a_group_table_naming_one_gpu_block_twice_is_refused_by_the_handle() -> None:
    model = Model(groups_of("sliding"))
    alloc = Tables(model)
    async with KVOffloader(config(), model.kv, groups=model.groups) as off:
        tokens = list(range(1, 19))
        await serve(off, model, alloc, "a", tokens)
        model.wipe()
        with off.request("b", [*tokens, 5]) as req:
            assert req.lookup() == 16
            tables = alloc.new(5)
            bad = {"full": [tables["full"][0], *tables["full"][:4]], "swa": tables["swa"]}
            with pytest.raises(
                BlockTableError,
                match=rf"request 'b': GPU block {tables['full'][0]} appears twice in the "
                r"block table of group 'full', at positions 0 and 1",
            ):
                req.load(bad)
            task = req.load(tables)  # nothing changed: the hit is still pinned
            assert task is not None
            await task
            model.check(tables, tokens, 16)
            swa = tables["swa"]
            twice = {"full": tables["full"], "swa": [None, None, swa[2], swa[3], swa[3]]}
            with pytest.raises(BlockTableError, match=r"'b': GPU block .* group 'swa'.* 3 and 4"):
                req.advance(twice, 19)
            req.advance({"full": tables["full"], "swa": [None, None, *swa[2:]]}, 19)
            off.store()
        await off.drain()
        off.check_invariants()
