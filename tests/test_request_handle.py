"""OffloadRequest: incremental hashing, the step calls it makes, and the context manager."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import anyio
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvoffload.hashing as hashing_module
from kvoffload import (
    HashNamespace,
    InputTypeError,
    InvalidInputError,
    KVCacheGroup,
    KVLayout,
    KVOffloader,
    KvOffloadError,
    OffloadConfig,
    OffloadRequest,
    PinnerError,
    RequestStateError,
    hash_prompt,
)
from kvoffload.request import HandleState, blocks_for, table_slice
from kvoffload.testing import ControllableCopyEngine

pytestmark = pytest.mark.anyio

BS = 4
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_size=4, dtype="float32", block_size=BS)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def make_kv(num_blocks: int = 32) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(LAYOUT.tensor_shape(num_blocks), generator=gen) for _ in range(2)]


def offloader(kv: Sequence[torch.Tensor]) -> KVOffloader:
    return KVOffloader(OffloadConfig(block_size=BS, num_cpu_blocks=32, model_id="m"), kv)


def test_block_table_helpers() -> None:
    assert [blocks_for(n, 4) for n in (0, 1, 4, 5, 8)] == [0, 1, 1, 2, 2]
    table = [10, 11, 12, 13]
    assert list(table_slice(table, 0, 4, 4)) == [10]
    assert list(table_slice(table, 3, 9, 4)) == [10, 11, 12]
    assert list(table_slice(table, 8, 16, 4)) == [12, 13]
    assert list(table_slice(table, 5, 5, 4)) == []
    with pytest.raises(ValueError, match=r"need 5 blocks; the block table has 4"):
        table_slice(table, 0, 17, 4)
    with pytest.raises(ValueError, match="start_token"):
        table_slice(table, 3, 2, 4)
    with pytest.raises(ValueError, match="num_tokens"):
        blocks_for(-1, 4)


async def test_the_handle_has_no_public_constructor() -> None:
    async with offloader(make_kv()) as off:
        with pytest.raises(TypeError, match="no public constructor"):
            OffloadRequest(off, "r", [1, 2, 3], 0)


@settings(max_examples=30, deadline=None)
@given(
    st.lists(st.integers(0, 1000), max_size=30),
    st.lists(st.lists(st.integers(0, 1000), max_size=9), max_size=6),
)
def test_incremental_hashes_equal_hashing_everything(
    prompt: list[int], chunks: list[list[int]]
) -> None:
    async def run() -> None:
        async with offloader(make_kv()) as off:
            with off.request("r", prompt) as req:
                tokens = list(prompt)
                for chunk in chunks:
                    req.extend(chunk)
                    tokens += chunk
                    assert list(req.block_hashes) == hash_prompt(tokens, BS, off.namespace)
                    assert list(req.token_ids) == tokens
                    assert req.num_tokens == len(tokens)
                    assert req.num_full_blocks == len(tokens) // BS

    anyio.run(run)


async def test_extend_hashes_each_new_block_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []  # the token bytes each block hash covered
    real = hashing_module._sha256

    class Counting:
        def __init__(self, parent: bytes) -> None:
            self._h = real(parent)
            calls.append(0)

        def update(self, data: bytes) -> None:
            if len(data) != 16:  # not the two length fields
                calls[-1] += len(data) // 8
            self._h.update(data)

        def digest(self) -> bytes:
            return self._h.digest()

    monkeypatch.setattr(hashing_module, "_sha256", Counting)
    async with offloader(make_kv()) as off:
        with off.request("r", list(range(10))) as req:
            assert len(calls) == 2  # the prompt's two full blocks
            for t in range(14):  # one generated token at a time
                req.extend([100 + t])
            assert len(calls) == 6  # 24 tokens: four more blocks, each hashed once
            assert calls == [BS] * 6
            assert list(req.block_hashes) == hash_prompt(
                [*range(10), *range(100, 114)], BS, off.namespace
            )


async def test_a_bad_token_appends_nothing() -> None:
    async with offloader(make_kv()) as off:
        with off.request("r", [1, 2, 3]) as req:
            with pytest.raises(ValueError, match="64-bit int"):
                req.extend([4, 5, 1 << 70, 6, 7])
            assert list(req.token_ids) == [1, 2, 3]
            assert req.num_full_blocks == 0
            req.extend([4])
            assert list(req.block_hashes) == hash_prompt([1, 2, 3, 4], BS, off.namespace)


async def test_advance_reports_exactly_the_full_computed_blocks() -> None:
    kv = make_kv()
    async with offloader(kv) as off:
        with off.request("r", list(range(10))) as req:
            table = [5, 6, 7]
            req.advance(table, 6)  # one full block computed
            state = off.scheduler.request_state("r")
            assert state.block_hashes == list(req.block_hashes[:1])
            req.advance(table, 10)  # two full blocks computed, half of a third
            assert state.block_hashes == list(req.block_hashes[:2])
            req.extend([10, 11])  # block 2 is full but its last two tokens are not computed
            assert req.num_full_blocks == 3
            req.advance(table, 10)
            assert len(state.block_hashes) == 2
            req.advance(table, 12)
            assert state.block_hashes == list(req.block_hashes)
            assert req.num_computed_tokens == 12
            with pytest.raises(ValueError, match="exceeds its 12 tokens"):
                req.advance(table, 13)


async def test_generated_tokens_are_stored_and_hit_by_the_next_turn() -> None:
    """The trap of hashing the prompt once: the handle stores the generated blocks too."""
    kv = make_kv()
    prompt = list(range(100, 110))  # 2 full blocks + 2 tokens
    async with offloader(kv) as off:
        with off.request("turn1", prompt) as req:
            assert req.lookup() == 0
            table = [0, 1, 2]
            req.advance(table, len(prompt))
            off.store()
            for t in range(6):  # decode 6 tokens: the request reaches 16 tokens
                req.extend([500 + t])
                table += [3 + len(table)] * req.blocks_needed(have=len(table))
                req.advance(table, req.num_tokens - 1)  # the newest token has no KV yet
                off.store()
            assert req.num_tokens == 16
        await off.drain()
        turn2 = [*prompt, *range(500, 506), 7, 8, 9]
        with off.request("turn2", turn2) as req2:
            # All four full blocks of turn 1 (two of them generated) are on the CPU, but
            # the last one was full only after the last step: three computed blocks.
            assert req2.lookup() == 3 * BS
            assert req2.hit_tokens == 12
    assert off.statistics().scheduler.live_requests == 0


async def test_load_and_release() -> None:
    kv = make_kv()
    prompt = list(range(17))
    async with offloader(kv) as off:
        with off.request("a", prompt) as a:
            a.lookup()
            a.advance(list(range(5)), 17)
            off.store()
        await off.drain()
        want = [kv[0][b].clone() for b in range(4)]
        with off.request("b", prompt) as b:
            assert b.lookup() == 16
            task = b.load([20, 21, 22, 23, 24], num_tokens=8)
            assert task is not None
            await task
            assert b.hit_tokens == 8
            assert torch.equal(kv[0][20], want[0])
            assert torch.equal(kv[0][21], want[1])
        with off.request("c", prompt) as c:
            assert c.lookup() == 16
            assert off.pool.num_free == off.pool.num_blocks - 4  # the pin
            c.release()
            assert c.hit_tokens == 0
            assert off.pool.num_free == off.pool.num_blocks
            assert c.load([0] * 5) is None  # nothing pinned any more
        await off.drain()
        assert off.pool.statistics().num_free == off.pool.num_blocks


async def test_leaving_the_block_finishes_on_an_exception() -> None:
    kv = make_kv()
    async with offloader(kv) as off:
        with off.request("a", list(range(9))) as a:
            a.advance([0, 1, 2], 9)
            off.store()
        await off.drain()
        handles: list[OffloadRequest] = []

        def serve() -> None:
            with off.request("b", list(range(9))) as b:
                handles.append(b)
                assert b.lookup() == 8  # pins two CPU blocks
                raise RuntimeError("engine failed")

        with pytest.raises(RuntimeError, match="engine failed"):
            serve()
        (b,) = handles
        assert b.finished
        assert not off.scheduler.has_request("b")
        assert off.pool.statistics().num_free == off.pool.num_blocks
        off.scheduler.check_invariants()


async def test_leaving_the_block_finishes_on_a_cancellation() -> None:
    kv = make_kv()
    async with offloader(kv) as off:
        with off.request("a", list(range(9))) as a:
            a.advance([0, 1, 2], 9)
            off.store()
        await off.drain()
        handles: list[OffloadRequest] = []
        with anyio.move_on_after(0.01):
            with off.request("b", list(range(9))) as b:
                handles.append(b)
                assert b.lookup() == 8
                await anyio.sleep_forever()
        assert handles[0].finished
        assert off.statistics().scheduler.live_requests == 0
        assert off.pool.statistics().num_free == off.pool.num_blocks


async def test_a_request_id_in_use_is_refused_and_finish_twice_raises() -> None:
    async with offloader(make_kv()) as off:
        with off.request("a", [1, 2, 3, 4, 5]) as a:
            a.lookup()
            with pytest.raises(RequestStateError, match="request id 'a' is in use"):
                off.request("a", [1])
            a.finish()
            with pytest.raises(RequestStateError, match="already finished"):
                a.finish()
            with pytest.raises(RequestStateError, match="finished"):
                a.extend([6])
        with pytest.raises(RequestStateError, match="not reused"):
            off.request("a", [1])  # a finished id is never reused
        with off.request("b", [1]) as other:
            assert other.lookup() == 0


async def test_bad_engine_prefix_is_refused() -> None:
    async with offloader(make_kv()) as off:
        with pytest.raises(ValueError, match="multiple of block_size=4"):
            off.request("a", list(range(9)), num_computed_tokens=3)
        with pytest.raises(ValueError, match="exceeds the prompt's 9 tokens"):
            off.request("a", list(range(9)), num_computed_tokens=12)


async def test_preempt_and_resume() -> None:
    kv = make_kv()
    async with offloader(kv) as off:
        with off.request("a", list(range(13))) as a:
            a.lookup()
            a.advance([0, 1, 2, 3], 13)
            off.store()
            await off.drain()
            a.preempt()
            assert a.num_computed_tokens == 0
            assert a.hit_tokens == 0
            assert off.scheduler.request_state("a").preempted
            # Re-admission: the blocks it stored before are on the CPU now.
            assert a.lookup() == 12
            a.release()
            # The engine recomputes instead: fewer tokens than before the preemption.
            a.advance([9, 10, 11, 12], 4)
            assert a.num_computed_tokens == 4
            assert a.lookup(num_computed_tokens=4) == 8
            task = a.load([9, 10, 11, 12])
            assert task is not None
            await task
            assert torch.equal(kv[0][10], kv[0][1])  # block 1 loaded where the table says
            a.advance([9, 10, 11, 12], 13)
            assert not off.scheduler.request_state("a").preempted
        await off.drain()
        assert off.pool.statistics().num_free == off.pool.num_blocks


async def test_a_closed_offloader_lets_the_handle_go_quietly() -> None:
    off = offloader(make_kv())
    async with off:
        req = off.request("a", list(range(9)))
        req.lookup()
    req.__exit__(None, None, None)
    assert req.finished


async def test_namespace_is_the_offloaders() -> None:
    kv = make_kv()
    async with offloader(kv) as off:
        with off.request("a", list(range(8))) as a:
            other = HashNamespace(model_id="other")
            assert list(a.block_hashes) == hash_prompt(list(range(8)), BS, off.namespace)
            assert list(a.block_hashes) != hash_prompt(list(range(8)), BS, other)
            assert "OffloadRequest('a', live" in repr(a)


# -- one id, one handle; a finished handle takes no call ------------------------------------


async def test_a_second_handle_for_an_id_is_refused_before_either_calls() -> None:
    """A client's retry makes a second handle for the id before the first made a call: it
    must be refused, or both drive one scheduler request (one's lookup replaces the other's
    pin, and a load copies one prompt's prefix into the other's table)."""
    async with offloader(make_kv()) as off:
        first = off.request("a", list(range(9)))
        with pytest.raises(RequestStateError, match=r"request id 'a' is in use"):
            off.request("a", list(range(100, 109)))
        assert off.scheduler.has_request("a")  # reserved by the first handle
        assert first.lookup() == 0  # the first handle is unharmed
        first.finish()
        assert not off.scheduler.has_request("a")
        with pytest.raises(RequestStateError, match=r"'a' is finished \(request ids are not"):
            off.request("a", [1])


CALLS_AFTER_FINISH = {
    "lookup": lambda r: r.lookup(),
    "lookup(allow_defer)": lambda r: r.lookup(allow_defer=True),
    "load": lambda r: r.load([0, 1, 2], 4),
    "advance": lambda r: r.advance([0, 1, 2], 8),
    "extend": lambda r: r.extend([1]),
    "release": lambda r: r.release(),
    "preempt": lambda r: r.preempt(),
    "finish": lambda r: r.finish(),
}


@pytest.mark.parametrize("call", sorted(CALLS_AFTER_FINISH))
@pytest.mark.parametrize("first_call", [False, True])
async def test_every_call_on_a_finished_handle_is_refused(call: str, first_call: bool) -> None:
    """Also on a handle finished before its first call: such a handle was forgotten, and a
    later lookup() re-registered the id and pinned CPU blocks nothing released."""
    kv = make_kv()
    async with offloader(kv) as off:
        prompt = list(range(13))
        with off.request("seed", prompt) as seed:  # put the prompt's blocks on the CPU
            seed.advance([20, 21, 22, 23], 13)
            off.store()
            await off.drain()
        req = off.request("a", prompt)
        if first_call:
            assert req.lookup() == 12
        req.finish()
        with pytest.raises(
            RequestStateError,
            match=rf"request 'a' is already finished: {call.split('(', maxsplit=1)[0]}\(\)",
        ):
            CALLS_AFTER_FINISH[call](req)
        assert req.finished
        assert req.state is HandleState.FINISHED
        assert not off.scheduler.has_request("a")
        assert off.scheduler.was_finished("a")
        assert off.pool.num_free == off.pool.num_blocks  # no pin left behind
        off.scheduler.check_invariants()
        req.__exit__(None, None, None)  # leaving 'with' after finish() stays quiet


class FailingUnpin:
    """A pinner whose unpin raises while ``fail`` is set."""

    def __init__(self) -> None:
        self.fail = False
        self.pins: list[tuple[int, ...]] = []

    def pin(self, ids: Sequence[int]) -> None:
        self.pins.append(tuple(ids))

    def unpin(self, ids: Sequence[int]) -> None:
        if self.fail:
            raise RuntimeError("unpin broke")


@pytest.mark.parametrize("hold", [False, True])
async def test_finish_that_surfaces_a_pinner_error_leaves_nothing_behind(hold: bool) -> None:
    """The once-only PinnerError of an earlier unpin surfaced in finish(): the handle was
    marked finished, the request stayed registered with its pin, and a retry was refused."""
    pinner = FailingUnpin()
    config = OffloadConfig(
        block_size=BS, num_cpu_blocks=32, model_id="m", hold_blocks_on_finish=hold
    )
    async with KVOffloader(config, make_kv(), pinner=pinner) as off:
        prompt = list(range(13))
        with off.request("seed", prompt) as seed:
            seed.advance([20, 21, 22, 23], 13)
            off.store()
            await off.drain()
        req = off.request("a", prompt)
        assert req.lookup() == 12  # pins three CPU blocks
        pinner.fail = True
        with off.request("other", list(range(100, 109))) as other:
            other.advance([10, 11, 12], 9)
            off.store()
            await off.drain()  # its completion's unpin raises: PinnerError is pending
            pinner.fail = False
            with pytest.raises(PinnerError, match="unpin raised"):
                req.finish()
        assert req.finished
        assert not off.scheduler.has_request("a")
        assert off.scheduler.was_finished("a")
        assert off.pool.num_free == off.pool.num_blocks  # the lookup pin was released once
        off.scheduler.check_invariants()
        with pytest.raises(RequestStateError, match="already finished"):
            req.finish()  # the finish is complete: nothing to retry
        assert off.lookup("b", off.hash_prompt(prompt), 13) == 12  # the error was raised once
        off.finish("b")
        assert off.statistics().scheduler.live_requests == 0


# -- the handle's errors are in the documented tree ----------------------------------------


def _bad_calls(off: KVOffloader) -> dict[str, tuple[Callable[[], object], str]]:
    def live() -> OffloadRequest:
        return off.request(f"r{len(made)}", list(range(9)))

    made: list[OffloadRequest] = []

    def with_live(f: Callable[[OffloadRequest], object]) -> Callable[[], object]:
        def call() -> object:
            req = live()
            made.append(req)
            return f(req)

        return call

    return {
        "request: a token too big": (
            lambda: off.request("t", [1, 1 << 64]),
            r"request 't': token_ids\[1\]=18446744073709551616 is not a 64-bit int",
        ),
        "request: a token not an int": (
            lambda: off.request("t", [1, "x"]),  # type: ignore[list-item]
            r"request 't': token_ids\[1\]='x' is not a 64-bit int",
        ),
        "extend: a bad token": (
            with_live(lambda r: r.extend([2.5])),  # type: ignore[list-item]
            r"request 'r0': token_ids\[0\]=2.5 is not a 64-bit int",
        ),
        "request: unaligned prefix": (
            lambda: off.request("u", list(range(9)), num_computed_tokens=3),
            r"request 'u': num_computed_tokens=3 must be >= 0 and a multiple of block_size=4",
        ),
        "request: prefix past the prompt": (
            lambda: off.request("u", list(range(9)), num_computed_tokens=12),
            r"request 'u': num_computed_tokens=12 exceeds the prompt's 9 tokens",
        ),
        "advance past the tokens": (
            with_live(lambda r: r.advance([0, 1, 2], 10)),
            r"request 'r0': num_computed_tokens=10 exceeds its 9 tokens",
        ),
        "blocks_for": (
            with_live(lambda r: r.blocks_for(-1)),
            r"request 'r0': need num_tokens >= 0 and block_size >= 1, got num_tokens=-1",
        ),
        "blocks_needed": (
            with_live(lambda r: r.blocks_needed(-5)),
            r"request 'r0': need num_tokens >= 0 .* num_tokens=-5",
        ),
        "table_slice: bad range": (
            with_live(lambda r: r.table_slice([0, 1], 5, 2)),
            r"request 'r0': need 0 <= start_token \(5\) <= end_token \(2\)",
        ),
        "table_slice: table too short": (
            with_live(lambda r: r.table_slice([0, 1], 0, 9)),
            r"request 'r0': tokens \[0, 9\) need 3 blocks; the block table has 2",
        ),
        "blocks_for()": (lambda: blocks_for(3, 0), r"got num_tokens=3 and block_size=0"),
        "table_slice()": (lambda: table_slice([0], 0, 9, 4), r"need 3 blocks; the block table"),
    }


BAD_CALLS = [
    "request: a token too big",
    "request: a token not an int",
    "extend: a bad token",
    "request: unaligned prefix",
    "request: prefix past the prompt",
    "advance past the tokens",
    "blocks_for",
    "blocks_needed",
    "table_slice: bad range",
    "table_slice: table too short",
    "blocks_for()",
    "table_slice()",
]


@pytest.mark.parametrize("case", BAD_CALLS)
async def test_a_bad_argument_raises_in_the_error_tree(case: str) -> None:
    """Each raised a bare ValueError before; now an InvalidInputError (still a ValueError)
    naming the request and the values. A refused call registers and reserves nothing."""
    async with offloader(make_kv()) as off:
        call, message = _bad_calls(off)[case]
        with pytest.raises(InvalidInputError, match=message) as info:
            call()
        assert isinstance(info.value, KvOffloadError)
        assert isinstance(info.value, ValueError)
        for rid in ("t", "u"):
            assert not off.scheduler.has_request(rid)  # a refused request() reserved nothing
        assert off.pool.num_free == off.pool.num_blocks


# -- a count that is not an int: one check for one group and several -----------------------


def grouped_offloader() -> KVOffloader:
    """A full-attention and a sliding-window group, tensors of the handle tests' layout."""
    groups = (
        KVCacheGroup.from_layout(LAYOUT, name="full"),
        KVCacheGroup.from_layout(LAYOUT, name="swa", kind="sliding_window", window=9),
    )
    kv = {g.name: make_kv() for g in groups}
    config = OffloadConfig(block_size=BS, num_cpu_blocks=32, model_id="m", checkpoint_tokens=8)
    return KVOffloader(config, kv, groups=groups)


def _table(off: KVOffloader) -> object:
    table = [0, 1, 2]
    return table if off.groups is None else {g.name: table for g in off.groups}


COUNT_CALLS: dict[str, tuple[Callable[[OffloadRequest, object], object], str]] = {
    "lookup": (lambda r, v: r.lookup(num_computed_tokens=v), "num_computed_tokens"),  # type: ignore[arg-type]
    "lookup(allow_defer=True)": (
        lambda r, v: r.lookup(num_computed_tokens=v, allow_defer=True),  # type: ignore[arg-type]
        "num_computed_tokens",
    ),
    "advance": (lambda r, v: r.advance(_table(r._off), v), "num_computed_tokens"),  # type: ignore[arg-type]
    "load": (lambda r, v: r.load(_table(r._off), v), "num_tokens"),  # type: ignore[arg-type]
    "blocks_for": (lambda r, v: r.blocks_for(v), "num_tokens"),  # type: ignore[arg-type]
    "blocks_for(group=)": (
        lambda r, v: r.blocks_for(v, group="full" if r._lanes else None),  # type: ignore[arg-type]
        "num_tokens",
    ),
    "blocks_needed": (lambda r, v: r.blocks_needed(v), "num_tokens"),  # type: ignore[arg-type]
    "blocks_needed(have=)": (lambda r, v: r.blocks_needed(4, have=v), "have"),  # type: ignore[arg-type]
    "table_slice": (lambda r, v: r.table_slice([0, 1, 2], v, 4), "start_token"),  # type: ignore[arg-type]
}


@pytest.mark.parametrize("value", [4.0, True])
@pytest.mark.parametrize("call", sorted(COUNT_CALLS))
@pytest.mark.parametrize("groups", [False, True], ids=["one group", "several groups"])
async def test_a_count_that_is_not_an_int_is_refused_naming_it(
    groups: bool, call: str, value: object
) -> None:
    """Every count argument of the handle, with one group and with several, is checked by
    one function (`as_int`): a float or a bool raises InputTypeError naming the argument,
    the value and the request, and changes nothing. With several groups a float used to
    reach the statistics, and blocks_for(4.0) answered 1.0."""
    async with grouped_offloader() if groups else offloader(make_kv()) as off:
        with off.request("r", list(range(9))) as req:
            f, arg = COUNT_CALLS[call]
            with pytest.raises(
                InputTypeError, match=rf"request 'r': {arg}={value!r} is not an int"
            ):
                f(req, value)
            assert req.num_computed_tokens == 0
            assert req.hit_tokens == 0
            assert req.blocks_for(5) == 2
        stats = off.statistics().scheduler
        values = vars_of(stats).values()
        # the per-reason counts are mappings of ints
        assert all(type(v) is int or all(type(n) is int for n in v.values()) for v in values)


def vars_of(stats: object) -> dict[str, object]:
    return {k: getattr(stats, k) for k in stats.__dataclass_fields__}  # type: ignore[attr-defined]


@pytest.mark.parametrize("groups", [False, True], ids=["one group", "several groups"])
async def test_a_float_engine_prefix_or_priority_is_refused_and_reserves_nothing(
    groups: bool,
) -> None:
    async with grouped_offloader() if groups else offloader(make_kv()) as off:
        with pytest.raises(InputTypeError, match=r"request 'a': num_computed_tokens=4.0 is not"):
            off.request("a", list(range(9)), num_computed_tokens=4.0)  # type: ignore[arg-type]
        with pytest.raises(InputTypeError, match=r"request 'a': priority=1.0 is not an int"):
            off.request("a", list(range(9)), priority=1.0)  # type: ignore[arg-type]
        with off.request("a", list(range(9))) as req:  # the id was not taken
            assert req.num_computed_tokens == 0


def test_the_block_table_functions_refuse_a_float() -> None:
    with pytest.raises(InputTypeError, match=r"num_tokens=4.0 is not an int"):
        blocks_for(4.0, 4)  # type: ignore[arg-type]
    with pytest.raises(InputTypeError, match=r"block_size=True is not an int"):
        blocks_for(4, True)
    with pytest.raises(InputTypeError, match=r"end_token=4.5 is not an int"):
        table_slice([0, 1], 0, 4.5, 4)  # type: ignore[arg-type]


async def test_a_refused_lookup_keeps_nothing_of_its_argument() -> None:
    async with offloader(make_kv()) as off:
        prompt = list(range(13))
        with off.request("seed", prompt) as seed:
            seed.advance([20, 21, 22, 23], 13)
            off.store()
            await off.drain()
        with off.request("a", prompt) as req:
            with pytest.raises(InvalidInputError, match="num_computed_tokens=3 is not a multiple"):
                req.lookup(num_computed_tokens=3)
            assert req.num_computed_tokens == 0
            assert req.lookup() == 12  # the prefix given at creation, not the refused one
            with pytest.raises(InvalidInputError, match="num_computed_tokens"):
                req.lookup(num_computed_tokens=16)
            assert req.lookup() == 12


async def test_a_back_to_back_request_hits_only_once_the_first_store_completed() -> None:
    """What README "Usage" and docs/integration.md say: a request sharing a prefix with one
    whose store is still copying gets no hit; allow_defer=True says "ask again", and
    awaiting the first request's store task (or off.drain()) gives the hit."""
    engine = ControllableCopyEngine()
    config = OffloadConfig(block_size=BS, num_cpu_blocks=32, model_id="m")
    async with KVOffloader(config, make_kv(), copy_engine=engine) as off:
        prompt = list(range(13))
        with off.request("a", prompt) as a:
            a.advance([0, 1, 2, 3], 13)
            [store] = off.store()
        with off.request("b", prompt) as b:
            assert b.lookup() == 0  # the store is in flight: nothing is published yet
            assert b.lookup(allow_defer=True) is None  # "ask again after the store"
            engine.complete(store)
            await store  # or: await off.drain()
            assert b.lookup(allow_defer=True) == 12
            b.release()


async def test_a_handle_finished_behind_its_back_becomes_finished() -> None:
    async with offloader(make_kv()) as off:
        req = off.request("a", list(range(9)))
        off.finish("a")  # the low-level call, with the handle's id
        with pytest.raises(RequestStateError, match="'a' is finished"):
            req.finish()
        assert req.finished
        req.__exit__(None, None, None)


@pytest.mark.parametrize("groups", [False, True], ids=["one group", "several groups"])
@pytest.mark.parametrize("prompt", [None, 5, "abc", b"ab", {1: 2}, iter([1, 2])])
async def test_a_prompt_that_is_not_a_sequence_is_refused_naming_it_and_reserves_nothing(
    groups: bool, prompt: object
) -> None:
    async with grouped_offloader() if groups else offloader(make_kv()) as off:
        with pytest.raises(InputTypeError, match=r"request 'a': prompt_token_ids=.* must be a"):
            off.request("a", prompt)  # type: ignore[arg-type]
        with off.request("a", list(range(9))) as req:  # the id was not taken
            assert req.num_tokens == 9
