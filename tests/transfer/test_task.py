"""TransferTask and TransferStatus semantics, driven synchronously (no event loop)."""

from __future__ import annotations

import pytest
from transfer_helpers import load_plan, store_plan

from kvoffload.errors import (
    InvariantError,
    LoadAbandonedError,
    TransferError,
    TransferNotFinishedError,
)
from kvoffload.testing import ControllableCopyEngine
from kvoffload.transfer import TransferResult, TransferStatus, TransferTask


def test_no_public_constructor() -> None:
    with pytest.raises(TypeError, match="no public constructor"):
        TransferTask(store_plan([0], [0]))


@pytest.mark.parametrize(
    ("source", "target", "ok"),
    [
        (TransferStatus.PENDING, TransferStatus.RUNNING, True),
        (TransferStatus.PENDING, TransferStatus.FAILED, True),
        (TransferStatus.RUNNING, TransferStatus.DONE, True),
        (TransferStatus.RUNNING, TransferStatus.ABANDONED, True),
        (TransferStatus.RUNNING, TransferStatus.PENDING, False),
        (TransferStatus.DONE, TransferStatus.FAILED, False),
        (TransferStatus.ABANDONED, TransferStatus.DONE, False),
        (TransferStatus.PENDING, TransferStatus.DONE, False),
    ],
)
def test_status_transitions(source, target, ok) -> None:
    if ok:
        assert source.advance(target) is target
    else:
        with pytest.raises(InvariantError, match=f"from {source.name} to {target.name}"):
            source.advance(target)


def test_result_is_frozen_and_slotted() -> None:
    result = TransferResult(kind="store", num_blocks=1, nbytes=8, seconds=0.1)
    assert not hasattr(result, "__dict__")
    with pytest.raises(AttributeError):
        result.nbytes = 3  # type: ignore[misc]


def test_pending_task_attributes_and_not_finished() -> None:
    engine = ControllableCopyEngine(num_gpu_blocks=8, num_cpu_blocks=8)
    plan = store_plan([3, 1], [0, 7], request="req-a")
    task = engine.submit(plan)
    assert task.plan is plan
    assert (task.kind, task.request_ids) == ("store", ("req-a",))
    assert (task.gpu_block_ids, task.cpu_block_ids) == ((3, 1), (0, 7))
    assert task.status is TransferStatus.RUNNING
    assert not task.done()
    with pytest.raises(TransferNotFinishedError):
        task.result()
    with pytest.raises(TransferNotFinishedError):
        task.exception()
    assert engine.pending == [task]


def test_inline_completion_calls_back_once_then_finishes() -> None:
    calls: list[tuple[TransferTask, TransferStatus]] = []
    engine = ControllableCopyEngine(on_complete=lambda t: calls.append((t, t.status)))
    a = engine.submit(store_plan([0], [0]))
    b = engine.submit(load_plan([1], [1]))
    engine.complete(1)
    engine.fail(a, RuntimeError("dma error"))
    assert calls == [(b, TransferStatus.DONE), (a, TransferStatus.FAILED)]
    assert b.result().num_blocks == 1
    assert b.exception() is None
    err = a.exception()
    assert isinstance(err, TransferError)
    assert isinstance(err.__cause__, RuntimeError)
    with pytest.raises(TransferError) as info:
        a.result()
    assert "dma error" in str(info.value.__cause__)
    assert engine.pending == []
    with pytest.raises(InvariantError, match="not pending"):
        engine.complete(a)


def test_launch_failure_is_failed_at_submit_and_delivered_once() -> None:
    calls: list[TransferTask] = []
    engine = ControllableCopyEngine(on_complete=calls.append, launch_failures={0})
    task = engine.submit(store_plan([0], [0]))
    assert task.status is TransferStatus.FAILED
    assert task.done()
    assert calls == [task]
    assert isinstance(task.exception(), TransferError)
    assert isinstance(task.exception().__cause__, RuntimeError)  # type: ignore[union-attr]
    assert engine.pending == []


def test_abandoned_task_finishes_abandoned_and_is_still_delivered() -> None:
    calls: list[TransferStatus] = []
    engine = ControllableCopyEngine(on_complete=lambda t: calls.append(t.status))
    ok = engine.submit(store_plan([0], [0]))
    bad = engine.submit(store_plan([1], [1]))
    ok._abandon()
    bad._abandon()
    assert ok.status is TransferStatus.RUNNING  # the copy runs on
    engine.complete(ok)
    engine.fail(bad)
    assert calls == [TransferStatus.ABANDONED, TransferStatus.ABANDONED]
    with pytest.raises(TransferError, match="abandoned"):
        ok.result()
    assert isinstance(bad.exception().__cause__, RuntimeError)  # type: ignore[union-attr]


def test_abandon_after_finish_changes_nothing() -> None:
    engine = ControllableCopyEngine(on_complete=lambda t: None)
    task = engine.submit(store_plan([0], [0]))
    engine.complete(task)
    task._abandon()
    assert task.status is TransferStatus.DONE


def test_a_given_up_load_resolves_now_and_is_delivered_when_its_copy_ends() -> None:
    delivered: list[tuple[TransferStatus, bool]] = []
    engine = ControllableCopyEngine(on_complete=lambda t: delivered.append((t.status, t._copy_ok)))
    ok = engine.submit(load_plan([0], [0]))
    bad = engine.submit(load_plan([1], [1]))
    for task in (ok, bad):
        assert task._give_up()
        assert task.done()  # resolved before its copy ended
        assert task.status is TransferStatus.ABANDONED
        with pytest.raises(LoadAbandonedError, match="abandoned"):
            task.result()
        assert isinstance(task.exception(), TransferError)
        assert not task._give_up()  # once
    assert delivered == []
    assert engine.pending == [ok, bad]  # the copies run on, still watched
    engine.complete(ok)
    engine.fail(bad)
    # Delivered once each, still abandoned; whether the copy itself ended well is kept.
    assert delivered == [(TransferStatus.ABANDONED, True), (TransferStatus.ABANDONED, False)]
    with pytest.raises(LoadAbandonedError):
        ok.result()


def test_giving_up_a_finished_task_changes_nothing() -> None:
    engine = ControllableCopyEngine(on_complete=lambda t: None)
    task = engine.submit(load_plan([0], [0]))
    engine.complete(task)
    assert not task._give_up()
    assert task.status is TransferStatus.DONE


def test_callback_error_does_not_lose_the_completion() -> None:
    def boom(task: TransferTask) -> None:
        raise ValueError("callback bug")

    engine = ControllableCopyEngine(on_complete=boom)
    task = engine.submit(store_plan([0], [0]))
    engine.complete(task)
    assert task.status is TransferStatus.DONE
    assert [type(e) for e in engine.callback_errors] == [ValueError]


@pytest.mark.parametrize(
    ("gpu", "cpu", "match"),
    [
        ([0, 1], [0], "2 gpu_block_ids but 1 cpu_block_ids"),
        ([0, 9], [0, 1], r"gpu_block_ids\[1\]=9 out of range"),
        ([0, 1], [-1, 1], r"cpu_block_ids\[0\]=-1 out of range"),
        ([0, 1], [2, 2], r"cpu_block_ids\[1\]=2 names a destination block twice"),
    ],
)
def test_store_plan_validation(gpu, cpu, match) -> None:
    engine = ControllableCopyEngine(num_gpu_blocks=8, num_cpu_blocks=8)
    with pytest.raises(ValueError, match=match):
        engine.submit(store_plan(gpu, cpu))
    assert engine.submitted == []


def test_load_with_duplicate_destination_is_refused() -> None:
    engine = ControllableCopyEngine(num_gpu_blocks=8, num_cpu_blocks=8)
    with pytest.raises(ValueError, match=r"gpu_block_ids\[1\]=4 names a destination"):
        engine.submit(load_plan([4, 4], [0, 1]))
    engine.submit(load_plan([4, 5], [0, 0]))  # one source read twice is fine
