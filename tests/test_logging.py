from __future__ import annotations

import logging
import subprocess
import sys
import textwrap

import pytest

from kvoffload._logging import get_logger

_EMIT = textwrap.dedent(
    """
    import logging
    import sys
    from kvoffload._logging import get_logger

    if sys.argv[1] == "configured":
        logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
    log = get_logger("scheduler")
    log.warning("store_deferred", request_id="r1", needed=4, free=0)
    log.info("store_planned", request_id="r2", blocks=3)
    log.debug("hot_path_detail", n=1)
    """
)


def _run(mode: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _EMIT, mode],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )


def test_silent_until_the_application_configures_logging() -> None:
    result = _run("unconfigured")
    # without the library's NullHandler, logging's last-resort handler would print the
    # warning to stderr
    assert result.stdout == ""
    assert result.stderr == ""


def test_logfmt_event_with_context_once_configured() -> None:
    result = _run("configured")
    lines = result.stderr.splitlines()
    assert lines == [
        "kvoffload.scheduler WARNING event=store_deferred request_id=r1 needed=4 free=0",
        "kvoffload.scheduler INFO event=store_planned request_id=r2 blocks=3",
    ]
    assert result.stdout == ""


def test_logger_name_and_levels(caplog: pytest.LogCaptureFixture) -> None:
    log = get_logger("pool")
    with caplog.at_level(logging.WARNING, logger="kvoffload"):
        log.info("ignored_event", a=1)
        log.warning("block_evicted", block_id=3, reason="lru")
    assert [(r.name, r.levelno, r.getMessage()) for r in caplog.records] == [
        ("kvoffload.pool", logging.WARNING, "event=block_evicted block_id=3 reason=lru")
    ]


def test_library_adds_only_a_null_handler() -> None:
    handlers = logging.getLogger("kvoffload").handlers
    assert handlers
    assert all(isinstance(h, logging.NullHandler) for h in handlers)
    assert logging.getLogger("kvoffload").propagate
