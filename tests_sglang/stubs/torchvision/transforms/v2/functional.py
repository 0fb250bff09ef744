"""Stub of torchvision.transforms.v2.functional (see the package docstring)."""

from __future__ import annotations

from typing import Any

from torchvision._unavailable import unavailable


def __getattr__(name: str) -> Any:
    return unavailable("torchvision.transforms.v2.functional", name)
