"""The docs cannot drift from the code: config fields, the error tree, runnable examples."""

from __future__ import annotations

import inspect
import os
import re
from pathlib import Path

import annotated_types
import pytest

import kvoffload.errors
from kvoffload.config import KVLayout, OffloadConfig

DOCS = Path(__file__).resolve().parents[1] / "docs"

# A ```python block directly after this marker line is executed by test_quickstart_runs.
RUN_MARKER = "<!-- run -->"
_RUNNABLE = re.compile(r"^<!-- run -->\n```python\n(.*?)^```$", re.MULTILINE | re.DOTALL)


def _read(name: str) -> str:
    return (DOCS / name).read_text(encoding="utf-8")


def _config_section(heading: str) -> str:
    """The part of configuration.md under ``## heading``, up to the next ``## `` heading."""
    text = _read("configuration.md")
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def _table_row(text: str, name: str) -> str:
    """The one markdown table row whose first cell is `` `name` ``."""
    rows = [line for line in text.splitlines() if line.startswith(f"| `{name}` |")]
    assert len(rows) == 1, f"expected one table row for `{name}`, found {len(rows)}"
    return rows[0]


def _bounds(metadata: list[object]) -> list[int | float]:
    values: list[int | float] = []
    for item in metadata:
        for attr in ("ge", "gt", "le", "lt", "max_length"):
            value = getattr(item, attr, None)
            if isinstance(value, int | float):
                values.append(value)
    return values


@pytest.mark.parametrize("name", sorted(OffloadConfig.model_fields))
def test_configuration_page_lists_offload_config_field(name: str) -> None:
    row = _table_row(_config_section("OffloadConfig"), name)
    field = OffloadConfig.model_fields[name]
    assert f"`KVOFFLOAD_{name.upper()}`" in row
    assert f"`{field.default!r}`" in row, f"default {field.default!r} of {name} not in: {row}"
    for bound in _bounds(field.metadata):
        assert str(bound) in row, f"bound {bound} of {name} not in: {row}"


@pytest.mark.parametrize("name", sorted(KVLayout.model_fields))
def test_configuration_page_lists_layout_field(name: str) -> None:
    row = _table_row(_config_section("KVLayout"), name)
    field = KVLayout.model_fields[name]
    if field.is_required():
        assert "required" in row
    else:
        assert f"`{field.default!r}`" in row
    for bound in _bounds(field.metadata):
        assert str(bound) in row, f"bound {bound} of {name} not in: {row}"


@pytest.mark.parametrize("model", [OffloadConfig, KVLayout], ids=lambda m: m.__name__)
def test_configuration_page_lists_no_unknown_field(model: type[OffloadConfig | KVLayout]) -> None:
    rows = re.findall(r"^\| `(\w+)` \|", _config_section(model.__name__), re.MULTILINE)
    assert sorted(rows) == sorted(model.model_fields)


def test_bound_helper_reads_pydantic_metadata() -> None:
    assert _bounds([annotated_types.Ge(1), annotated_types.Le(8)]) == [1, 8]


def _error_classes() -> list[type[BaseException]]:
    classes = [getattr(kvoffload.errors, name) for name in kvoffload.errors.__all__]
    return [c for c in classes if inspect.isclass(c) and issubclass(c, BaseException)]


def test_errors_module_exports_errors() -> None:
    assert kvoffload.errors.KvOffloadError in _error_classes()
    assert len(_error_classes()) == len(kvoffload.errors.__all__)


@pytest.mark.parametrize("cls", _error_classes(), ids=lambda c: c.__name__)
def test_errors_page_documents_error(cls: type[BaseException]) -> None:
    text = _read("errors.md")
    assert re.search(rf"^## `{cls.__name__}`$", text, re.MULTILINE), f"no section for {cls}"
    tree = text.split("```text\n", 1)[1].split("```", 1)[0]
    builtins = [b.__name__ for b in cls.__bases__ if b.__module__ == "builtins"]
    builtins = [b for b in builtins if b != "Exception"]
    suffix = f" ({', '.join(builtins)})" if builtins else ""
    assert f"{cls.__name__}{suffix} " in tree or tree.startswith(cls.__name__), (
        f"{cls.__name__}{suffix} is not drawn in the error tree"
    )


def test_quickstart_has_runnable_blocks() -> None:
    text = _read("quickstart.md")
    assert len(_RUNNABLE.findall(text)) == text.count(RUN_MARKER) >= 3


def test_quickstart_runs(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The blocks build OffloadConfig objects, which read KVOFFLOAD_* variables.
    for var in [v for v in os.environ if v.startswith("KVOFFLOAD_")]:
        monkeypatch.delenv(var)
    text = _read("quickstart.md")
    namespace: dict[str, object] = {"__name__": "quickstart"}
    for match in _RUNNABLE.finditer(text):
        line = text.count("\n", 0, match.start(1)) + 1
        code = compile(match.group(1), f"{DOCS / 'quickstart.md'}:{line}", "exec")
        exec(code, namespace)
    out = capsys.readouterr().out
    assert "32768 128" in out


_TEST_REF = re.compile(r"`(tests/[\w/]+\.py)::(\w+)`")


def _defines(source: str, name: str) -> bool:
    """Whether a test module defines ``name``: a function, a class, or an assignment."""
    return bool(
        re.search(
            rf"^\s*(?:async\s+)?def {name}\(|^class {name}\b|^{name}\s*=",
            source,
            re.MULTILINE,
        )
    )


def test_failure_modes_page_lists_every_failure_mode() -> None:
    rows = re.findall(r"^\| (FM-\d\d) \|", _read("failure-modes.md"), re.MULTILINE)
    assert rows == [f"FM-{i:02d}" for i in range(1, 55)]


def test_failure_modes_page_names_existing_tests() -> None:
    root = DOCS.parent
    refs = _TEST_REF.findall(_read("failure-modes.md"))
    assert len(refs) >= 54
    missing = []
    for path, name in refs:
        file = root / path
        if not file.is_file() or not _defines(file.read_text(encoding="utf-8"), name):
            missing.append(f"{path}::{name}")
    assert not missing, f"failure-modes.md names tests that do not exist: {missing}"


def test_test_reference_check_can_fail() -> None:
    source = "def test_a() -> None:\n    pass\nTestMachine = Machine.TestCase\n"
    assert _defines(source, "test_a")
    assert _defines(source, "TestMachine")
    assert not _defines(source, "test_b")
    assert not _defines(source, "test")


def test_the_server_figures_follow_the_command_that_produces_them() -> None:
    """docs/server.md's "What you will see" figures are those of ``--gpu-blocks 128``: the
    last server command before them must be that one (it was the plain default)."""
    text = _read("server.md")
    before = text[: text.index("**What you will see**")]
    commands = re.findall(r"^python examples/server/app\.py .*$", before, re.MULTILINE)
    assert commands, "no server command before the figures"
    assert "--gpu-blocks 128" in commands[-1]
