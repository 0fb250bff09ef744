"""Session hints: a prefix retained for a pause (``retain_for_s``), released early, and let
go by itself once its time is up, on a clock the test drives (no test sleeps)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from scheduler_helpers import BS, tokens

from kvoffload import InputTypeError, InvalidInputError, KVLayout, KVOffloader, OffloadConfig
from kvoffload.pool.block import CpuBlock
from kvoffload.pool.block_pool import CpuBlockPool
from kvoffload.pool.hints import HintOwner, RetentionHints, leading_runs
from kvoffload.pool.policies.arc import ArcPolicy

pytestmark = pytest.mark.anyio

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_size=4, dtype="float32", block_size=BS)
GPU_BLOCKS = 16


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def offloader(clock: Clock, **overrides: object) -> KVOffloader:
    config = OffloadConfig(block_size=BS, num_cpu_blocks=16, model_id="m", **overrides)  # type: ignore[arg-type]
    gen = torch.Generator().manual_seed(0)
    kv = [torch.randn(LAYOUT.tensor_shape(GPU_BLOCKS), generator=gen) for _ in range(2)]
    off = KVOffloader(config, kv)
    off.hints.clock = clock
    return off


async def run(
    off: KVOffloader, rid: str, prompt: Sequence[int], retain_for_s: float | None = None
) -> int:
    """One request through the handle: look up, compute the rest, store; its hit."""
    with off.request(rid, prompt) as req:
        hit = req.lookup()
        table = list(range(req.blocks_for(req.num_tokens)))
        if hit and (task := req.load(table)) is not None:
            await task
        req.advance(table, req.num_tokens)
        off.store()
        await off.drain()
        req.finish(retain_for_s=retain_for_s, session="agent")
    off.check_invariants()
    return hit


async def scan(off: KVOffloader, first: int) -> None:
    """40 distinct blocks through a pool of 16: evicts everything not retained."""
    for seed in range(first, first + 10):
        await run(off, f"scan{seed}", tokens(seed, 4, 1))


@pytest.mark.parametrize("hinted", [True, False])
async def test_a_hinted_prefix_survives_a_scan_for_as_long_as_its_hint_and_not_longer(
    hinted: bool,
) -> None:
    clock = Clock()
    context = tokens(1, 3)
    async with offloader(clock, max_retained_fraction=0.25) as off:
        await run(off, "turn1", [*context, 7], retain_for_s=30.0 if hinted else None)
        assert off.pool.num_retained == (3 if hinted else 0)
        clock.now += 29.0  # the tool call runs; other traffic scans the pool
        await scan(off, 10)
        hit = await run(off, "turn2", [*context, 8])
        assert hit == (3 * BS if hinted else 0)
        clock.now += 1.0  # the hint's deadline: it ends at the next store()
        await scan(off, 30)
        assert off.pool.num_retained == 0
        assert off.hints.sessions == ()
        assert await run(off, "turn3", [*context, 9]) == 0


async def test_retain_for_and_release_hint_end_a_hint_early() -> None:
    clock = Clock()
    async with offloader(clock, max_retained_fraction=0.5) as off:
        await run(off, "a", [*tokens(1, 3), 7])
        assert off.hints.retain_for(tokens(1, 3), 60, session="s") == 3
        assert off.hints.release("s") == 3
        assert off.hints.release("s") == 0  # nothing live: no error, nothing released
        assert off.pool.num_retained == 0
        await scan(off, 10)
        assert await run(off, "b", [*tokens(1, 3), 8]) == 0
        assert off.hints.release("never") == 0


async def test_a_later_hint_of_the_session_replaces_the_earlier_one() -> None:
    clock = Clock()
    async with offloader(clock, max_retained_fraction=0.5) as off:
        await run(off, "a", [*tokens(1, 3), 7])
        assert off.hints.retain_for(tokens(1, 3), 10, session="s") == 3
        assert off.hints.retain_for(tokens(1, 2), 100, session="s") == 2  # shorter, longer-lived
        assert off.pool.num_retained == 2
        clock.now += 50
        assert off.hints.retain_for(tokens(1, 1), 1, session="other") == 1  # expiry runs first
        assert off.pool.num_retained == 2  # the replaced hint's deadline did nothing
        clock.now += 51
        off.store()
        assert off.pool.num_retained == 0
        off.check_invariants()


async def test_a_hint_is_cut_to_the_retention_bound_never_refused() -> None:
    clock = Clock()
    async with offloader(clock, max_retained_fraction=0.25) as off:  # at most 4 blocks
        await run(off, "a", [*tokens(1, 6), 7])
        assert off.retain_prefix(tokens(1, 1), owner="sys") == 1
        assert off.hints.retain_for(tokens(1, 6), 10, session="s") == 4  # block 0 is shared
        assert off.pool.num_retained == 4
        assert off.release_retained("sys") == 1  # the owners are apart
        assert off.pool.num_retained == 4
        off.check_invariants()


async def test_blocks_stored_after_the_hint_are_retained_at_a_later_store() -> None:
    clock = Clock()
    async with offloader(clock, max_retained_fraction=0.5) as off:
        await run(off, "a", [*tokens(1, 2), 7])
        assert off.hints.retain_for(tokens(1, 4), 10, session="s") == 2  # blocks 2, 3 not stored
        await run(off, "b", [*tokens(1, 4), 7])  # stores them; the next store() retains
        off.store()
        assert off.pool.num_retained == 4
        off.check_invariants()


BAD_HINTS = [0, -1.0, float("nan"), float("inf"), "10", True, None]


@pytest.mark.parametrize("value", BAD_HINTS)
async def test_a_bad_retain_for_s_is_refused_naming_it(value: object) -> None:
    clock = Clock()
    async with offloader(clock, max_retained_fraction=0.5) as off:
        await run(off, "a", [*tokens(1, 3), 7])
        with pytest.raises(InvalidInputError, match="retain_for_s must be"):
            off.hints.retain_for(tokens(1, 3), value, session="s")  # type: ignore[arg-type]
        if value is not None:
            with off.request("q", tokens(1, 3)) as req:
                with pytest.raises(InvalidInputError, match="request 'q': retain_for_s"):
                    req.finish(retain_for_s=value)  # type: ignore[arg-type]
                assert not req.finished
        with pytest.raises(InputTypeError, match=r"session=\[1\] must be hashable"):
            off.hints.retain_for(tokens(1, 3), 5, session=[1])
        assert off.pool.num_retained == 0
        off.check_invariants()


async def test_finish_gives_the_hint_for_the_request_id_by_default() -> None:
    clock = Clock()
    async with offloader(clock, max_retained_fraction=0.5) as off:
        with off.request("a", [*tokens(1, 3), 7]) as req:
            req.advance(list(range(req.blocks_for(req.num_tokens))), req.num_tokens)
            off.store()
            await off.drain()
            with pytest.raises(InputTypeError, match=r"session=\{\} must be hashable"):
                req.finish(retain_for_s=5, session={})
            assert not req.finished
            req.finish(retain_for_s=50)
        assert off.hints.deadline("a") == clock.now + 50
        assert off.pool.num_retained == 3
        assert off.hints.release("a") == 3


async def test_reset_ends_every_hint() -> None:
    clock = Clock()
    async with offloader(clock, max_retained_fraction=0.5) as off:
        await run(off, "a", [*tokens(1, 3), 7], retain_for_s=10)
        assert await off.reset()
        assert off.hints.sessions == ()
        assert off.hints.release("agent") == 0
        off.check_invariants()


async def test_close_releases_the_blocks_hints_and_retain_prefix_hold() -> None:
    clock = Clock()
    off = offloader(clock, max_retained_fraction=0.5)
    async with off:
        await run(off, "a", [*tokens(1, 3), 7], retain_for_s=60)
        off.hints.retain_prefix(tokens(1, 2), owner="system")
        assert off.pool.num_retained == 3
        assert off.pool.num_free < off.pool.num_blocks
    # Every reference is released on close (invariant 6), the retained ones too.
    assert off.pool.num_free == off.pool.num_blocks
    assert off.pool.num_retained == 0
    assert off.pool.retained_owners == ()


def test_hints_on_a_bare_pool_expire_lazily_on_their_clock() -> None:
    """The replay drives `RetentionHints` over a `CpuBlockPool` in trace time."""
    from kvoffload.hashing import BlockHash  # noqa: PLC0415

    pool = CpuBlockPool(8, max_retained_blocks=4)
    keys = [BlockHash(bytes([i]) * 16) for i in range(3)]
    blocks = pool.allocate(3)
    for block, key in zip(blocks, keys, strict=True):
        pool.publish(block, key)
    pool.free(blocks)
    hints = RetentionHints(
        leading_runs(lambda h, o, fit: pool.retain(h, owner=o, fit=fit)),
        pool.release_retained,
        clock=lambda: 0,
    )
    assert not hints
    assert hints.hint("s", keys, 5.0, now=0.0) == 3
    assert pool.retained_owners == (HintOwner("s"),)
    assert hints.expire(4.9) == 0
    assert hints.expire(5.0) == 1
    assert not hints
    assert pool.num_retained == 0
    pool.check_invariants()


class _Uses(ArcPolicy):
    """ARC that records which blocks the pool touches and frees."""

    __slots__ = ("freed", "touched")

    def __init__(self) -> None:
        super().__init__()
        self.touched: list[int] = []
        self.freed: list[int] = []

    def on_touch(self, block: CpuBlock) -> None:
        self.touched.append(block.block_id)
        super().on_touch(block)

    def on_free(self, blocks: Sequence[CpuBlock]) -> None:
        self.freed.extend(b.block_id for b in blocks)
        super().on_free(blocks)


def test_a_hints_retain_keeps_what_it_holds_untouched_and_releases_only_the_rest() -> None:
    """A hint's retain (``fit``) leaves its owner holding exactly the new run: a use-counting
    policy sees no use of a block it keeps, and the blocks it no longer names are released
    (a retry, and a hint of several groups whose prefix moved on, go through this)."""
    from kvoffload.hashing import BlockHash  # noqa: PLC0415

    policy = _Uses()
    pool = CpuBlockPool(8, policy=policy, max_retained_blocks=3)
    keys = [BlockHash(bytes([i]) * 16) for i in range(5)]
    blocks = pool.allocate(5)
    for block, key in zip(blocks, keys, strict=True):
        pool.publish(block, key)
    pool.free(blocks)
    ids = [b.block_id for b in blocks]
    owner = HintOwner("s")
    assert len(pool.retain(keys[:2], owner=owner, fit=True)) == 2
    policy.touched.clear()
    policy.freed.clear()
    assert len(pool.retain(keys[:3], owner=owner, fit=True)) == 3  # a retry: one more
    assert (policy.touched, policy.freed) == ([ids[2]], [])
    policy.touched.clear()
    # Another run at the bound: what the owner held outside it is room, released tail first.
    assert len(pool.retain(keys[2:5], owner=owner, fit=True)) == 3
    assert (policy.touched, policy.freed) == ([ids[3], ids[4]], [ids[1], ids[0]])
    assert [b.block_id for b in pool._retained.held(owner)] == ids[2:5]
    assert pool.retainable(keys[:2], owner) == 2  # fit: its own blocks count as room
    assert pool.retainable(keys[:2], owner, fit=False) == 0  # added to them: no room
    policy.freed.clear()
    assert pool.retain([], owner=owner, fit=True) == []
    assert policy.freed == [ids[4], ids[3], ids[2]]
    assert pool.retained_owners == ()
    assert pool.num_free == pool.num_blocks
    pool.check_invariants()


@pytest.mark.anyio(False)
def test_the_worked_example_in_docs_hints_runs(capsys: pytest.CaptureFixture[str]) -> None:
    import re  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415

    text = (Path(__file__).resolve().parents[1] / "docs" / "hints.md").read_text()
    (block,) = re.findall(r"^<!-- run -->\n```python\n(.*?)^```$", text, re.MULTILINE | re.DOTALL)
    exec(compile(block, "docs/hints.md", "exec"), {"__name__": "docs_hints"})
    assert "turn-2 loaded 12 tokens" in capsys.readouterr().out
