from __future__ import annotations

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
