"""The stand-in for every torchvision name the stub does not define."""

from __future__ import annotations

from typing import Any, NoReturn


def unavailable(module: str, name: str) -> Any:
    """A callable named ``module.name`` that fails when used (dunders stay missing)."""
    if name.startswith("__"):
        raise AttributeError(name)

    def stub(*args: object, **kwargs: object) -> NoReturn:
        raise RuntimeError(f"{module}.{name}: the kvoffload SGLang test stub has no image code")

    stub.__name__ = stub.__qualname__ = name
    return stub
