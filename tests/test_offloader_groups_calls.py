"""Every `KVOffloader` step call on every model shape: with several KV cache groups,
``lookup`` (also with ``allow_defer``), ``load`` and ``update`` take one table and one hash
list per group name and mean what the handle's calls mean (the handle makes every call
through them); ``miss_reason()`` and ``tier_hit_tokens()`` answer for one group and several; a
request's prompt tokens count once per admission whatever the shape."""

from __future__ import annotations

import pytest
from test_offloader_groups import BS, Model, Tables, config, groups_of, serve

from kvoffload import KVOffloader, MissReason
from kvoffload.errors import InputTypeError, InvalidInputError
from kvoffload.groups import KVCacheGroup
from kvoffload.hashing import BlockHasher

pytestmark = pytest.mark.anyio

TURN1 = list(range(1, 19))  # 18 tokens: store points 8, 16 and the finish at 16
TURN2 = [*TURN1, 50, 51, 52]


def group_hashes(off: KVOffloader, groups: tuple[KVCacheGroup, ...], tokens: list[int]) -> dict:
    """Per cacheable group, the prompt's block hashes in that group's namespace."""
    cfg = off.config
    out = {}
    for g in groups:
        if g.cacheable:
            h = BlockHasher(g.namespace(model_id=cfg.model_id, salt=cfg.hash_salt).root, BS)
            h.extend(tokens)
            out[g.name] = list(h.block_hashes)
    return out


@pytest.mark.parametrize("kind", ["sliding", "recurrent"])
async def test_the_offloaders_own_calls_serve_a_hybrid_model_as_the_handle_does(
    kind: str,
) -> None:
    model = Model(groups_of(kind))
    alloc = Tables(model)
    async with KVOffloader(config(), model.kv, groups=model.groups) as off:
        await serve(off, model, alloc, "a", TURN1)
        model.wipe()
        hashes = group_hashes(off, model.groups, TURN2)
        # the façade's lookup finds what a handle's finds
        hit = off.lookup("b", hashes, len(TURN2))
        assert hit == 16
        assert off.miss_reason("b") is not MissReason.NOT_READ
        assert off.tier_hit_tokens("b") == {}
        tables = alloc.new(-(-len(TURN2) // BS))
        task = off.load("b", tables, hit)
        assert task is not None
        await task
        model.check(tables, TURN2, hit)  # bytes exact in every group
        model.fill(tables, TURN2)
        off.update("b", tables, hashes, len(TURN2))
        off.store()
        off.finish("b")
        await off.drain()
        off.check_invariants()
        with off.request("c", TURN2) as req:
            assert req.lookup() == 20  # what "b" stored through the façade
            assert req.miss_reason == off.miss_reason("c")
        # allow_defer and no_read, as with one group
        assert off.lookup("d", hashes, len(TURN2), allow_defer=True) == 20
        off.release("d")
        assert off.lookup("e", hashes, len(TURN2), no_read=True) == 0
        assert off.miss_reason("e") is MissReason.NOT_READ
        off.release("e")


async def test_one_group_takes_one_list_and_names_a_mapping() -> None:
    model = Model(groups_of("sliding")[:1])
    async with KVOffloader(config(checkpoint=None), model.kv["full"]) as off:
        hashes = off.hash_prompt(TURN1)
        with pytest.raises(InvalidInputError, match=r"'x'.*one KV cache group.*\['full'\]"):
            off.lookup("x", {"full": hashes}, len(TURN1))
        with pytest.raises(InvalidInputError, match=r"'x'.*one KV cache group"):
            off.load("x", {"full": [0, 1]}, 0)
        with pytest.raises(InputTypeError, match=r"one KV cache group"):
            off.store(gpu_cache={"full": object()})  # type: ignore[dict-item]
        assert off.lookup("x", hashes, len(TURN1)) == 0
        assert off.miss_reason("x") is MissReason.NEVER_STORED
        assert off.tier_hit_tokens("x") == {}


@pytest.mark.parametrize("kind", ["one", "sliding", "recurrent"])
async def test_a_prompt_counts_once_per_admission_on_every_shape(kind: str) -> None:
    """Looked up twice (the engine asked again), a prompt's tokens count once in
    ``prompt_tokens``; again after a preemption (a re-admission), as with one group."""
    if kind == "one":
        model = Model(groups_of("sliding")[:1])
        off = KVOffloader(config(checkpoint=None), model.kv["full"])
    else:
        model = Model(groups_of(kind))
        off = KVOffloader(config(), model.kv, groups=model.groups)
    async with off:
        with off.request("a", TURN1) as req:
            for _ in range(3):
                assert req.lookup() == 0
            assert off.statistics().scheduler.prompt_tokens == len(TURN1)
            req.preempt()
            req.lookup()
            assert off.statistics().scheduler.prompt_tokens == 2 * len(TURN1)
