"""Pages that show an example's code show it verbatim, readable without the docs build."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _code_after(page: str, heading: str) -> str:
    """The first ```python block under ``heading`` in ``page``."""
    text = (ROOT / "docs" / page).read_text(encoding="utf-8")
    section = text[text.index(f"\n{heading}\n") :]
    match = re.search(r"^```python\n(.*?)^```$", section, re.MULTILINE | re.DOTALL)
    assert match, f"no python block under {heading!r} in {page}"
    return match.group(1)


@pytest.mark.parametrize(
    ("page", "heading", "example"),
    [("integration.md", "## The whole program", "examples/engine_step_loop.py")],
)
def test_page_copy_equals_the_example(page: str, heading: str, example: str) -> None:
    assert _code_after(page, heading) == (ROOT / example).read_text(encoding="utf-8"), (
        f"the copy of {example} in docs/{page} differs from the file; paste the file again"
    )


@pytest.mark.parametrize("page", ["integration.md", "quickstart.md", "examples.md"])
def test_pages_have_no_include_directives(page: str) -> None:
    text = (ROOT / "docs" / page).read_text(encoding="utf-8")
    assert "--8<--" not in text, f"docs/{page} includes a file; a code host shows the directive"


def test_the_copy_check_can_fail() -> None:
    example = (ROOT / "examples/engine_step_loop.py").read_text(encoding="utf-8")
    assert _code_after("integration.md", "## The whole program") != example + "# changed\n"
