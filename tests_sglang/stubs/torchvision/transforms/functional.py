"""Stub of torchvision.transforms.functional: the names SGLang imports at module level."""

from __future__ import annotations

import enum
from typing import Any

from torchvision._unavailable import unavailable


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    NEAREST_EXACT = "nearest-exact"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


def __getattr__(name: str) -> Any:
    return unavailable("torchvision.transforms.functional", name)
