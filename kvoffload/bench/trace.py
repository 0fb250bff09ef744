"""Reading Mooncake-format request traces (one JSON object a line).

The reader is strict: a line that is not a JSON object with the four fields, a number that
is not finite (``NaN``, ``Infinity``), a count that is not a non-negative integer, or a
hash id outside the signed 128-bit range that block keys hold, or an optional ``priority``
that is not an integer in [0, 65536], is refused with a
`TraceFormatError` naming the file, the line and the field. `useful_capacity()` says the
largest pool a replay of a trace can use (`kvoffload.replay` and the pool benchmark both
cap their pools with it).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

__all__ = [
    "HASH_ID_MAX",
    "HASH_ID_MIN",
    "TraceFormatError",
    "TraceRequest",
    "read_trace",
    "useful_capacity",
]

HASH_ID_MIN = -(1 << 127)
"""The smallest hash id a trace may hold (block keys are 16-byte signed integers)."""
HASH_ID_MAX = (1 << 127) - 1
"""The largest hash id a trace may hold."""
PRIORITY_MAX = 1 << 16
"""The largest ``priority`` a trace line may carry (`kvoffload.pool.priority.MAX_PRIORITY`)."""


class TraceFormatError(ValueError):
    """A trace line is not a trace record; the message names the file, line and field.

    Attributes:
        path: the trace file.
        lineno: the line, from 1.
        field: the field at fault (``None`` when the line as a whole is).
    """

    def __init__(self, path: str, lineno: int, field: str | None, problem: str) -> None:
        where = f"{path}:{lineno}" + (f": field {field!r}" if field is not None else "")
        super().__init__(f"{where}: {problem}")
        self.path = path
        self.lineno = lineno
        self.field = field


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace.

    Attributes:
        timestamp_ms: arrival time in milliseconds.
        input_length: prompt tokens.
        output_length: generated tokens.
        hash_ids: one id per prompt block, in prefix order; equal prefixes share ids.
        priority: the request's retention priority (optional field, 0 when absent).
        session: the session (an agent's conversation) it belongs to (optional field).
        retain_for_s: a session hint: keep this request's blocks for that many seconds
            of trace time after it (optional field; docs/hints.md).
    """

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    priority: int = 0
    session: str | None = None
    retain_for_s: float | None = None


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class _Line:
    def __init__(self, path: str, lineno: int) -> None:
        self.path = path
        self.lineno = lineno

    def fail(self, field: str | None, problem: str) -> NoReturn:
        raise TraceFormatError(self.path, self.lineno, field, problem)

    def count(self, rec: dict[str, Any], field: str) -> int:
        value = self.get(rec, field)
        if type(value) is not int or value < 0:
            self.fail(field, f"expected an integer >= 0, got {_shown(value)}")
        return value

    def get(self, rec: dict[str, Any], field: str) -> Any:
        if field not in rec:
            self.fail(field, "missing")
        return rec[field]


def _record(line: _Line, rec: Any) -> TraceRequest:
    if not isinstance(rec, dict):
        line.fail(None, f"expected a JSON object, got {type(rec).__name__} {_shown(rec)}")
    ts = line.get(rec, "timestamp")
    if type(ts) not in (int, float) or not math.isfinite(ts):
        line.fail("timestamp", f"expected a finite number, got {_shown(ts)}")
    input_length = line.count(rec, "input_length")
    output_length = line.count(rec, "output_length")
    raw = line.get(rec, "hash_ids")
    if not isinstance(raw, list):
        line.fail("hash_ids", f"expected a list of integers, got {_shown(raw)}")
    for i, h in enumerate(raw):
        if type(h) is not int:
            line.fail(f"hash_ids[{i}]", f"expected an integer, got {_shown(h)}")
        if not HASH_ID_MIN <= h <= HASH_ID_MAX:
            line.fail(f"hash_ids[{i}]", f"{h} is outside the signed 128-bit range of block keys")
    priority = rec.get("priority", 0)
    if type(priority) is not int or not 0 <= priority <= PRIORITY_MAX:
        line.fail("priority", f"expected an integer in [0, {PRIORITY_MAX}], got {_shown(priority)}")
    session = rec.get("session")
    if session is not None and type(session) is not str:
        line.fail("session", f"expected a string, got {_shown(session)}")
    hint = rec.get("retain_for_s")
    if hint is not None and (
        type(hint) not in (int, float) or not math.isfinite(hint) or hint <= 0
    ):
        line.fail("retain_for_s", f"expected a number of seconds > 0, got {_shown(hint)}")
    return TraceRequest(
        float(ts),
        input_length,
        output_length,
        tuple(raw),
        priority,
        session,
        float(hint) if hint is not None else None,
    )


def read_trace(path: str | Path, *, limit: int | None = None) -> Iterator[TraceRequest]:
    """Yield the requests of a Mooncake-format trace file.

    Raises:
        TraceFormatError: a line is not a trace record (a ``ValueError``); the message names
            the file, the line and the field.
        OSError: the file cannot be read.
    """
    name = str(path)
    with Path(path).open("rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            if limit is not None and lineno > limit:
                return
            line = _Line(name, lineno)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                line.fail(None, f"not UTF-8 text ({exc.reason} at byte {exc.start})")
            if not text.strip():
                continue
            try:
                rec = json.loads(text)  # NaN and Infinity parse; the field checks refuse them
            except (ValueError, RecursionError) as exc:
                line.fail(None, f"not JSON: {exc}")
            yield _record(line, rec)


def useful_capacity(requests: Iterable[Sequence[Any]]) -> int:
    """The largest pool a replay of ``requests`` can use: a larger one gives the same result.

    A pool of the trace's distinct blocks plus its longest request never evicts (the
    published blocks are distinct, and one request allocates at most its length more), nor
    does one of as many blocks as the trace accesses; the smaller of the two is returned,
    at least 1.
    """
    seen: set[Any] = set()
    accesses = longest = 0
    for request in requests:
        accesses += len(request)
        longest = max(longest, len(request))
        seen.update(request)
    return max(1, min(accesses, len(seen) + longest))
