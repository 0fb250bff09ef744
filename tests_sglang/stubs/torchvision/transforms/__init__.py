"""Stub of torchvision.transforms (see the package docstring)."""

from __future__ import annotations

from typing import Any

from torchvision._unavailable import unavailable
from torchvision.transforms.functional import InterpolationMode

__all__ = ["InterpolationMode"]


def __getattr__(name: str) -> Any:
    return unavailable("torchvision.transforms", name)
