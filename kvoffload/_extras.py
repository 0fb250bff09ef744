"""How to install one of kvoffload's optional extras, for every "needs the extra" message.

kvoffload is not on a public package index, so an extra comes from a clone of the
repository: ``pip install '.[redis]'`` in its root. Every import error and command-line
message that names an extra builds its text here, so that they all say the same.
"""

from __future__ import annotations

__all__ = ["install_command", "needs_extra"]


def install_command(extra: str) -> str:
    """The command that installs ``extra``, run in the root of a kvoffload clone."""
    return f"pip install '.[{extra}]'"


def needs_extra(what: str, extra: str) -> str:
    """The message for ``what`` missing its ``extra``.

    Args:
        what: the module, command or feature that cannot run, e.g. ``"kvoffload.tiers.redis"``.
        extra: the extra's name in ``pyproject.toml``, e.g. ``"redis"``.

    Returns:
        For example "kvoffload.tiers.redis needs the `redis` extra: from a kvoffload clone,
        pip install '.[redis]'".
    """
    return f"{what} needs the `{extra}` extra: from a kvoffload clone, {install_command(extra)}"
