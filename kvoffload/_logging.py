"""The one place loggers come from.

kvoffload never configures logging. Its loggers wrap ``logging.getLogger("kvoffload.<name>")``
through structlog, and the ``kvoffload`` logger carries a ``NullHandler``, so the library is
silent until the application configures the standard library's logging (or structlog on
top of it). Events are snake_case past-tense facts with key=value context, rendered as
logfmt: ``event=store_deferred request_id=r1 needed=4 free=0``.
"""

from __future__ import annotations

import logging
from typing import Any

import structlog

__all__ = ["get_logger"]

logging.getLogger("kvoffload").addHandler(logging.NullHandler())

_PROCESSORS: list[Any] = [
    structlog.stdlib.filter_by_level,
    structlog.processors.LogfmtRenderer(key_order=["event"], bool_as_flag=False),
]


def get_logger(name: str) -> structlog.stdlib.BoundLogger:
    """Return the structlog logger for ``kvoffload.<name>``.

    Args:
        name: the module's short name, e.g. ``"scheduler"``.
    """
    stdlib_logger = logging.getLogger(f"kvoffload.{name}")
    logger: structlog.stdlib.BoundLogger = structlog.wrap_logger(
        stdlib_logger,
        processors=_PROCESSORS,
        wrapper_class=structlog.stdlib.BoundLogger,
    )
    return logger
