"""Reading Mooncake-format request traces (one JSON object a line)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

__all__ = ["TraceRequest", "read_trace"]


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace.

    Attributes:
        timestamp_ms: arrival time in milliseconds.
        input_length: prompt tokens.
        output_length: generated tokens.
        hash_ids: one id per prompt block, in prefix order; equal prefixes share ids.
    """

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def read_trace(path: str | Path, *, limit: int | None = None) -> Iterator[TraceRequest]:
    """Yield the requests of a Mooncake-format trace file.

    Raises:
        ValueError: a line is not valid JSON or lacks a field; the message names the line.
    """
    with Path(path).open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if limit is not None and lineno > limit:
                return
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                yield TraceRequest(
                    timestamp_ms=float(rec["timestamp"]),
                    input_length=int(rec["input_length"]),
                    output_length=int(rec["output_length"]),
                    hash_ids=tuple(int(h) for h in rec["hash_ids"]),
                )
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{lineno}: not a trace record ({exc!r})") from exc
