"""A finished request's id is never reused, whatever the model's shape: `FinishedIds`
(one owner of the rule) serves one group's `RequestTable` and a `GroupedScheduler`'s
requests alike; `KVOffloader` refuses a finished id with one group and with several with
the same error and message."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

import pytest
from groups_helpers import Rig, group
from test_offloader_groups import Model, Tables, config, groups_of

import kvoffload.scheduler.requests as requests_module
from kvoffload import KVOffloader, OffloadConfig
from kvoffload.errors import RequestStateError, UnknownRequestError
from kvoffload.hashing import BlockHasher, HashNamespace
from kvoffload.pool.block_pool import CpuBlockPool
from kvoffload.scheduler import OffloadScheduler
from kvoffload.scheduler.requests import FinishedIds

REUSED = "request 'a' is finished (request ids are not reused)"


def two_groups(**kw: object) -> Rig:
    return Rig([group("f", "full", 4), group("w", "sliding_window", 4, window=8)], **kw)  # type: ignore[arg-type]


def run_to_the_end(rig: Rig, rid: str, n_tokens: int, first_block: int) -> None:
    """``rid`` computes ``n_tokens`` tokens, finishes, and its copies complete."""
    n = n_tokens // 4
    tables = {"f": list(range(first_block, first_block + n)), "w": list(range(n))}
    rig.sched.update(rid, tables, rig.hashes(list(range(n_tokens))), n_tokens)
    for plan in (rig.sched.finish(rid), rig.sched.plan_stores()):
        if plan is not None:
            rig.sched.complete_all(plan, True)
    assert not rig.sched.has_request(rid)


def test_finished_ids_remember_the_last_ones_and_refuse_them() -> None:
    ids = FinishedIds(limit=2)
    ids.remember("a")
    ids.remember("b")
    with pytest.raises(RequestStateError, match=r"^request 'a' is finished \(request ids"):
        ids.refuse("a")
    ids.remember("c")  # pushes "a" out
    assert not ids.was_finished("a")
    ids.refuse("a")
    assert ids.was_finished("b")
    assert ids.was_finished("c")
    assert len(ids) == 2


def test_a_grouped_finished_id_is_refused_after_its_copies_drained() -> None:
    rig = two_groups()
    run_to_the_end(rig, "a", 16, 0)
    sched = rig.sched
    assert sched.was_finished("a")
    h = rig.hashes(list(range(16)))
    tables = {"f": [20, 21, 22, 23], "w": [4, 5, 6, 7]}
    calls: list[Callable[[], object]] = [
        lambda: sched.update("a", tables, h, 16),
        lambda: sched.lookup("a", h, 16),
        lambda: sched.lookup("a", h, 16, allow_defer=True),
        lambda: sched.set_priority("a", 3),
        lambda: sched.plan_load("a", tables, 0),
        lambda: sched.finish("a"),
        lambda: sched.preempt("a"),
        lambda: sched.abandon_load("a"),
        lambda: sched.miss_reason("a"),
        lambda: sched.request_table.reserve("a"),
        lambda: sched.release("a"),
    ]
    for call in calls:
        with pytest.raises(RequestStateError, match="^" + re.escape(REUSED)):
            call()
    assert not sched.has_request("a")
    sched.check_invariants()
    # an id never seen is unknown, as with one group
    with pytest.raises(UnknownRequestError, match="unknown request id 'zz'"):
        sched.finish("zz")


def one_group_scheduler() -> OffloadScheduler:
    return OffloadScheduler(OffloadConfig(num_cpu_blocks=16, block_size=4), CpuBlockPool(16))


def one_group_hashes(n_tokens: int) -> list[bytes]:
    hasher = BlockHasher(HashNamespace(model_id="t").root, 4)
    hasher.extend(list(range(n_tokens)))
    return list(hasher.block_hashes)


@pytest.mark.parametrize("shape", ["one group", "two groups"])
def test_an_id_pushed_out_of_the_memory_is_accepted_again(
    shape: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(requests_module, "FINISHED_IDS_REMEMBERED", 2)
    if shape == "one group":
        sched = one_group_scheduler()
        h = one_group_hashes(8)

        def finish(rid: str) -> None:
            sched.update(rid, [0, 1], h, 8)
            sched.finish(rid)

        def reuse() -> None:
            sched.update("a", [0, 1], h, 8)

        check = sched.check_invariants
    else:
        rig = two_groups()
        g_hashes = rig.hashes(list(range(8)))

        def finish(rid: str) -> None:
            run_to_the_end(rig, rid, 8, 0)

        def reuse() -> None:
            rig.sched.update("a", {"f": [0, 1], "w": [0, 1]}, g_hashes, 8)

        check = rig.sched.check_invariants
    finish("a")
    finish("b")
    with pytest.raises(RequestStateError, match="not reused"):
        reuse()
    finish("c")  # the memory holds two ids: "a" is forgotten
    reuse()
    check()


def offloader_error(shape: str, call: Callable[[KVOffloader], object]) -> Callable[..., object]:
    """The error ``call`` raises on an offloader of ``shape`` after requests "a" (served)
    and "n" (a handle that made no call) finished."""

    async def run() -> BaseException | None:
        kind_groups: Sequence = groups_of("sliding")
        model = Model(tuple(kind_groups[:1]) if shape == "one group" else tuple(kind_groups))
        alloc = Tables(model)
        if shape == "one group":
            off = KVOffloader(config(checkpoint=None), model.kv["full"])
        else:
            off = KVOffloader(config(), model.kv, groups=model.groups)
        async with off:
            tokens = list(range(1, 19))
            with off.request("a", tokens) as req:
                req.lookup()
                tables = alloc.new(req.blocks_for(len(tokens)))
                model.fill(tables, tokens)
                req.advance(tables["full"] if shape == "one group" else tables, len(tokens))
                off.store()
            with off.request("n", [1, 2, 3]):
                pass
            await off.drain()
            assert not off.has_request("a")
            try:
                call(off)
            except Exception as e:
                return e
            return None

    return run


@pytest.mark.anyio
@pytest.mark.parametrize(
    "call",
    [
        pytest.param(lambda off: off.request("a", [1, 2, 3]), id="request"),
        pytest.param(lambda off: off.request("n", [1, 2, 3]), id="request-no-call"),
        pytest.param(lambda off: off.finish("a"), id="finish"),
        pytest.param(lambda off: off.finish("n"), id="finish-no-call"),
        pytest.param(lambda off: off.finish("never"), id="finish-unknown"),
        pytest.param(lambda off: off.preempt("a"), id="preempt"),
        pytest.param(lambda off: off.preempt("never"), id="preempt-unknown"),
        pytest.param(lambda off: off.release("a"), id="release"),
        pytest.param(lambda off: off.release("never"), id="release-unknown"),
        pytest.param(lambda off: off.abandon_load("a"), id="abandon_load"),
        pytest.param(lambda off: off.miss_reason("a"), id="miss_reason"),
    ],
)
async def test_one_group_and_two_refuse_a_finished_id_alike(
    call: Callable[[KVOffloader], object],
) -> None:
    one = await offloader_error("one group", call)()
    two = await offloader_error("two groups", call)()
    assert one is not None
    assert two is not None
    assert type(one) is type(two)
    assert str(one) == str(two)
    assert isinstance(one, (RequestStateError, UnknownRequestError))
