"""The package's public surface: re-exports only, sorted, typed, slotted records."""

from __future__ import annotations

import dataclasses
import importlib.resources

import pytest

import kvoffload


def test_all_is_sorted_and_resolves() -> None:
    assert list(kvoffload.__all__) == sorted(kvoffload.__all__)
    for name in kvoffload.__all__:
        assert hasattr(kvoffload, name), name


def test_py_typed_ships() -> None:
    assert importlib.resources.files("kvoffload").joinpath("py.typed").is_file()


@pytest.mark.parametrize(
    "record",
    [
        kvoffload.RequestOffloadState("r"),
        kvoffload.CpuBlock(kvoffload.BlockId(0)),
        kvoffload.PoolStatistics(1, 1, 0, 0, 0, 0),
    ],
)
def test_per_block_and_per_request_records_have_no_dict(record: object) -> None:
    assert not hasattr(record, "__dict__")


def test_statistics_are_frozen() -> None:
    stats = kvoffload.CpuBlockPool(2).statistics()
    with pytest.raises(dataclasses.FrozenInstanceError):
        stats.num_free = 0  # type: ignore[misc]


def test_transfer_task_has_no_public_constructor() -> None:
    with pytest.raises(TypeError, match="no public constructor"):
        kvoffload.TransferTask()
