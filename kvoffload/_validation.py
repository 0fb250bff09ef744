"""How kvoffload's pydantic models refuse a value: shared by `KVLayout` and `OffloadConfig`.

Both turn pydantic's `ValidationError` into a `ConfigError` whose message names each field,
its environment variable (for settings) and the value it got.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from kvoffload.errors import ConfigError

__all__ = [
    "constructor_refusal",
    "describe",
    "frozen_setattr",
    "not_bool",
    "validate_or_refuse",
]

_T = TypeVar("_T")


def not_bool(value: object) -> object:
    """Refuse ``True``/``False`` where a count is expected (pydantic would take 1/0)."""
    if isinstance(value, bool):
        # pydantic turns only ValueError into a validation error
        raise ValueError(f"a count must be an int, not a bool ({value!r})")  # noqa: TRY004
    return value


def frozen_setattr(model: BaseModel, name: str, value: object) -> None:
    """Refuse setting an attribute of a frozen model, naming the field and the value."""
    cls = type(model).__name__
    raise ConfigError(
        f"{cls} is frozen: cannot set {name}={value!r}; build a new {cls} with the value "
        "(it is validated again)"
    )


def _as_is(value: object) -> object:
    return value


def describe(
    exc: ValidationError,
    fields: Collection[str],
    env_prefix: str | None,
    shown: Callable[[object], object] = _as_is,
) -> str:
    """One line per error of ``exc``: where (with the environment variable of a field when
    ``env_prefix`` is given), pydantic's message and the input as ``shown`` masks it."""
    parts = []
    for err in exc.errors():
        loc = err["loc"]
        if not loc:  # a cross-field check: its message names the fields
            parts.append(err["msg"].removeprefix("Value error, "))
            continue
        where = ".".join(str(p) for p in loc)
        if env_prefix is not None and loc[0] in fields:
            where += f" (env {env_prefix}{str(loc[0]).upper()})"
        parts.append(f"{where}: {err['msg']} (got {shown(err.get('input'))!r})")
    return "; ".join(parts)


def constructor_refusal(exc: ValidationError) -> ConfigError | None:
    """The `ConfigError` a model's own constructor raised inside pydantic's validation
    (``model_validate()`` of a dict runs it), so that ``model_validate()`` raises that one
    error, not pydantic's around it; ``None`` when the validation failed elsewhere."""
    errors = exc.errors()
    if len(errors) != 1:
        return None
    inner = errors[0].get("ctx", {}).get("error")
    return inner if isinstance(inner, ConfigError) else None


def validate_or_refuse(
    validate: Callable[[], _T], refused: Callable[[ValidationError], ConfigError]
) -> _T:
    """``validate()`` (a model's ``model_validate``), refusing as its constructor does:
    with the constructor's own `ConfigError` (`constructor_refusal()`), else with
    ``refused(exc)``, never with pydantic's `ValidationError`."""
    try:
        return validate()
    except ValidationError as exc:
        refusal = constructor_refusal(exc)
        if refusal is not None:
            raise refusal  # noqa: B904 - it keeps the cause the constructor gave it
        raise refused(exc) from exc
