"""The package's public surface: re-exports only, sorted, typed, slotted records."""

from __future__ import annotations

import dataclasses
import importlib.resources

import pytest

import kvoffload
from kvoffload.scheduler.group_state import GroupedRequest


def test_all_is_sorted_and_resolves() -> None:
    assert list(kvoffload.__all__) == sorted(kvoffload.__all__)
    for name in kvoffload.__all__:
        assert hasattr(kvoffload, name), name


def test_lazy_names_match_the_type_checking_imports() -> None:
    """Every public name is imported lazily from the module its typed import names."""
    import ast  # noqa: PLC0415

    tree = ast.parse(importlib.resources.files("kvoffload").joinpath("__init__.py").read_text())
    guarded = next(n for n in tree.body if isinstance(n, ast.If))
    typed = {
        alias.asname or alias.name: node.module
        for node in guarded.body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }
    where = kvoffload._WHERE
    assert typed == where
    assert set(where) == set(kvoffload.__all__) - {"__version__"}
    for name, module in where.items():
        assert getattr(kvoffload, name) is getattr(importlib.import_module(module), name)


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no_such_name"):
        kvoffload.no_such_name


def test_py_typed_ships() -> None:
    assert importlib.resources.files("kvoffload").joinpath("py.typed").is_file()


@pytest.mark.parametrize(
    "record",
    [
        kvoffload.RequestOffloadState(GroupedRequest("r", {}), 16),
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
