from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

TRACE = Path(__file__).resolve().parents[1].parent / "shared" / "traces" / "synthetic_trace.jsonl"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def trace_path() -> Path:
    """The Mooncake synthetic trace in ../shared/traces (never copied into the project)."""
    if not TRACE.is_file():
        pytest.skip(f"trace not found at {TRACE}")
    return TRACE


_EXTRAS_CI_MUST_HAVE = ("transformers", "prometheus_client", "redis", "hiredis", "matplotlib")


def pytest_configure(config: pytest.Config) -> None:
    """Under CI=true refuse to run without a package some tests importorskip: CI installs
    every extra the tests use, and a skipped test there does not count as passed."""
    if os.environ.get("CI", "").lower() not in {"1", "true", "yes"}:
        return
    missing = [name for name in _EXTRAS_CI_MUST_HAVE if importlib.util.find_spec(name) is None]
    if missing:
        raise pytest.UsageError(
            f"CI=true but {', '.join(missing)} is not installed; install '.[dev]' "
            "(scripts/test.sh does) so that no test skips for a missing package"
        )
