"""A stand-in for torchvision in the SGLang test environment (never in the package).

SGLang imports torchvision unconditionally (its multimodal helpers, through its model
configs), while the torchvision wheels on the index are built against CUDA torch and do not
load on the CPU build. The HiCache storage tests need no image code: this stub only lets the
imports succeed, and any use of it fails loudly.
"""

from __future__ import annotations

from typing import Any

from torchvision._unavailable import unavailable

__version__ = "0.0.0+kvoffload-test-stub"


def __getattr__(name: str) -> Any:
    return unavailable("torchvision", name)
