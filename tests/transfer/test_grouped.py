"""`submit_grouped()`: one task over the parts of a grouped plan, one part per group's copy
engine, finished once every part ended and failed when any part failed."""

from __future__ import annotations

import pytest
from transfer_helpers import store_plan

from kvoffload.errors import ClosedError, TransferError
from kvoffload.testing import ControllableCopyEngine
from kvoffload.transfer import CompletionPoller, TransferStatus, TransferTask
from kvoffload.transfer.grouped import GroupedTransferPlan, submit_grouped


def setup() -> tuple[dict[str, ControllableCopyEngine], CompletionPoller, list[TransferTask]]:
    engines = {"full": ControllableCopyEngine(), "swa": ControllableCopyEngine()}
    delivered: list[TransferTask] = []
    return engines, CompletionPoller(delivered.append, poll_interval_s=0.001), delivered


def test_the_task_finishes_once_every_part_did() -> None:
    engines, poller, delivered = setup()
    parts = {"full": store_plan([0, 1], [0, 1]), "swa": store_plan([4], [2])}
    task = submit_grouped(engines, parts, plan_id=7, kind="store")
    poller.track(task)
    assert isinstance(task.plan, GroupedTransferPlan)
    assert task.plan.plan_id == 7
    assert task.plan.num_blocks == 3
    assert task.plan.parts["swa"].gpu_block_ids == (4,)
    engines["full"].complete(engines["full"].pending[0])
    poller.poll()
    assert delivered == []  # one group's part is still copying
    engines["swa"].complete(engines["swa"].pending[0])
    poller.poll()
    assert delivered == [task]
    assert task.status is TransferStatus.DONE
    assert task.result().num_blocks == 3


def test_a_failed_part_fails_the_task_after_every_part_ended() -> None:
    engines, poller, delivered = setup()
    parts = {"full": store_plan([0], [0]), "swa": store_plan([1], [1])}
    task = submit_grouped(engines, parts, plan_id=1, kind="store")
    poller.track(task)
    engines["swa"].fail(engines["swa"].pending[0], RuntimeError("swa copy broke"))
    poller.poll()
    assert delivered == []  # the full group's copy still reads its blocks
    engines["full"].complete(engines["full"].pending[0])
    poller.poll()
    assert task.status is TransferStatus.FAILED
    with pytest.raises(TransferError, match="swa copy broke"):
        task.result()


def test_a_submit_that_raises_for_a_later_part_fails_the_task() -> None:
    engines, poller, _ = setup()
    engines["swa"]._closed = True  # its submit raises ClosedError
    parts = {"full": store_plan([0], [0]), "swa": store_plan([1], [1])}
    task = submit_grouped(engines, parts, plan_id=1, kind="store")
    poller.track(task)
    engines["full"].complete(engines["full"].pending[0])
    poller.poll()
    assert task.status is TransferStatus.FAILED
    with pytest.raises(TransferError, match="closed"):
        task.result()
    engines["full"]._closed = True
    with pytest.raises(ClosedError):  # the first part: nothing started, it raises
        submit_grouped(engines, parts, plan_id=2, kind="store")
