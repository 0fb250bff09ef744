"""Argument types and errors shared by the benchmark commands.

Bad arguments are argparse usage errors (exit 2, one line); bad data found while running
(an unreadable trace, an output file that cannot be written) is a `CommandError` (exit 1,
one line), which ``python -m kvoffload.bench`` and ``kvoffload bench`` print without a
traceback.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

__all__ = [
    "CommandError",
    "int_list",
    "output_path",
    "parse_int_list",
    "positive_int",
    "write_output",
]


class CommandError(Exception):
    """A benchmark cannot run on what it was given; the message says why, in one line."""


def positive_int(text: str) -> int:
    """An integer >= 1 (argparse type)."""
    try:
        value = int(text.replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def parse_int_list(text: str) -> list[int]:
    """A comma-separated list of integers >= 1 (``_`` may group digits: ``6_000``).

    Every item must be one: an empty item (``1,,2``, a trailing comma), ``0``, a negative
    or a fractional number is refused, never skipped.

    Raises:
        ValueError: the message names the first bad item and the whole value.
    """
    parts = [part.strip() for part in text.split(",")]
    for part in parts:
        if not part:
            raise ValueError(f"empty item in {text!r}: expected integers >= 1, comma separated")
        try:
            value = int(part.replace("_", ""))
        except ValueError:
            raise ValueError(
                f"{part!r} in {text!r} is not an integer: expected integers >= 1, comma separated"
            ) from None
        if value < 1:
            raise ValueError(f"{part!r} in {text!r} is not >= 1: expected integers >= 1")
    return [int(part.replace("_", "")) for part in parts]


def int_list(text: str) -> list[int]:
    """A comma-separated list of integers >= 1 (argparse type; see `parse_int_list`)."""
    try:
        return parse_int_list(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def output_path(text: str) -> Path:
    """A file that can be written: its folder exists and it is not a folder (argparse type)."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a directory, not a file")
    if not path.parent.is_dir():
        raise argparse.ArgumentTypeError(
            f"cannot write {text!r}: {str(path.parent)!r} is not a directory"
        )
    if not os.access(path.parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: permission denied")
    return path


def write_output(path: Path, text: str) -> None:
    """Write ``text`` to ``path``.

    Raises:
        CommandError: the file cannot be written.
    """
    try:
        path.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise CommandError(f"cannot write {str(path)!r}: {exc.strerror or exc}") from None
