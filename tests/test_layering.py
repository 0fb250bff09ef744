"""The import graph of kvoffload/ has no circle and no import from a lower layer to a higher one;
no class of kvoffload/ grows past the size alarm (600 lines).

The layers are the table under ``## Layers`` in ``docs/design.md``. The graph is read with
`ast` from every module under ``kvoffload/``, nothing is imported:

- every ``import kvoffload...`` and ``from kvoffload... import ...`` counts, at the top of
  a module, inside a function, and under ``if TYPE_CHECKING:`` (a type is a dependency of
  the design even where Python does not run the import; the circle of ``config.py``,
  ``hashing.py`` and the policies ran through one such import);
- ``from package import name`` is an edge to the submodule ``package.name`` when there is
  one, else to the package;
- importing ``kvoffload.x.y`` runs ``kvoffload/x/__init__.py`` first, so it is an edge to
  ``kvoffload.x`` too, unless the importer is inside ``kvoffload.x`` already (Python has
  that package in hand by then); ``kvoffload/__init__.py`` itself, which every import
  runs, is no edge;
- ``importlib.import_module`` and ``__import__`` are not followed (``kvoffload.bench``
  picks its own submodules by name that way).
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kvoffload"
DESIGN = ROOT / "docs" / "design.md"


@dataclass(frozen=True)
class Import:
    """One edge: ``importer`` needs ``target``, at ``line`` of the importer's file."""

    importer: str
    target: str
    line: int

    def where(self) -> str:
        return f"{module_path(self.importer)}:{self.line}"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def module_path(name: str) -> str:
    return str(MODULES[name].relative_to(ROOT))


def _modules(package: Path) -> dict[str, Path]:
    return {module_name(p): p for p in sorted(package.rglob("*.py"))}


MODULES = _modules(PACKAGE)


def _is_package(name: str, modules: Mapping[str, Path]) -> bool:
    return name in modules and modules[name].name == "__init__.py"


def _targets(name: str, importer: str, modules: Mapping[str, Path]) -> Iterator[str]:
    """The modules that importing ``name`` from ``importer`` runs: the module itself and
    each package above it that is not the root and not a package of the importer."""
    if name != "kvoffload" and name not in modules:
        raise AssertionError(f"{importer} imports {name}, which is no module")
    yield name
    parts = name.split(".")
    for i in range(len(parts) - 1, 1, -1):
        package = ".".join(parts[:i])
        if importer == package or importer.startswith(package + "."):
            break
        yield package


def _resolve(node: ast.ImportFrom, importer: str, modules: Mapping[str, Path]) -> str:
    if not node.level:
        return node.module or ""
    base = importer.split(".")
    if not _is_package(importer, modules):
        base.pop()
    base = base[: len(base) - node.level + 1]
    return ".".join([*base, node.module] if node.module else base)


def imports_of(importer: str, modules: Mapping[str, Path] = MODULES) -> Iterator[Import]:
    """Every kvoffload module ``importer`` imports, wherever in the file."""
    tree = ast.parse(modules[importer].read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(node, importer, modules)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                names.append(sub if sub in modules else base)
        for name in names:
            if name == "kvoffload" or name.startswith("kvoffload."):
                for target in _targets(name, importer, modules):
                    if target != importer:
                        yield Import(importer, target, node.lineno)


def graph(modules: Mapping[str, Path] = MODULES) -> dict[str, list[Import]]:
    """Importer -> its imports (one entry per target: the first line that needs it)."""
    out: dict[str, list[Import]] = {}
    for importer in modules:
        first: dict[str, Import] = {}
        for edge in imports_of(importer, modules):
            first.setdefault(edge.target, edge)
        out[importer] = sorted(first.values(), key=lambda e: e.line)
    return out


def read_layers(text: str) -> dict[str, int]:
    """Module name -> layer, from the table under ``## Layers``."""
    start = text.index("\n## Layers\n")
    end = text.find("\n## ", start + 1)
    section = text[start : end if end != -1 else len(text)]
    layers: dict[str, int] = {}
    for number, cell in re.findall(r"^\| (\d+) \| (.+) \|$", section, re.MULTILINE):
        for name in re.findall(r"`([a-z_.]+)`", cell):
            assert name not in layers, f"{name} is in two layers of docs/design.md"
            layers[name] = int(number)
    assert layers, "docs/design.md has no layer table under '## Layers'"
    return layers


LAYERS = read_layers(DESIGN.read_text(encoding="utf-8"))


def layer_of(module: str, layers: Mapping[str, int] = LAYERS) -> int | None:
    """The layer of the longest listed name that is ``module`` or a package above it
    (``kvoffload``, the root, is the layer of its ``__init__.py`` alone)."""
    parts = module.split(".")
    for i in range(len(parts), 1 if module != "kvoffload" else 0, -1):
        layer = layers.get(".".join(parts[:i]))
        if layer is not None:
            return layer
    return None


def find_circle(edges: Mapping[str, list[Import]]) -> list[Import] | None:
    """One circle of imports, as its edges in order, or ``None``."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[Import] = []

    def visit(module: str) -> list[Import] | None:
        state[module] = 1
        for edge in edges.get(module, ()):
            if state.get(edge.target) == 1:
                start = next(i for i, e in enumerate(path) if e.importer == edge.target)
                return [*path[start:], edge]
            if edge.target not in state:
                path.append(edge)
                found = visit(edge.target)
                if found is not None:
                    return found
                path.pop()
        state[module] = 2
        return None

    for module in sorted(edges):
        if module not in state:
            found = visit(module)
            if found is not None:
                return found
    return None


def test_every_module_has_a_layer() -> None:
    missing = sorted(m for m in MODULES if layer_of(m) is None)
    assert not missing, (
        f"modules with no layer in docs/design.md's '## Layers' table: {missing}; add each "
        "to the lowest layer that holds everything it imports"
    )


def test_every_listed_name_is_a_module() -> None:
    stale = sorted(name for name in LAYERS if name not in MODULES)
    assert not stale, f"docs/design.md's '## Layers' table names no such module: {stale}"


def test_no_module_imports_a_higher_layer() -> None:
    upward = []
    for importer, edges in graph().items():
        own = layer_of(importer)
        for edge in edges:
            theirs = layer_of(edge.target)
            if own is not None and theirs is not None and theirs > own:
                upward.append(
                    f"{edge.where()}: {importer} (layer {own}) imports {edge.target} "
                    f"(layer {theirs})"
                )
    assert not upward, "imports that run up the layers of docs/design.md:\n" + "\n".join(upward)


def test_the_imports_have_no_circle() -> None:
    circle = find_circle(graph())
    assert circle is None, "a circle of imports:\n" + "\n".join(
        f"{edge.where()}: {edge.importer} imports {edge.target}" for edge in circle
    )


# -- the checks can fail: each one on a small package with the fault --------------------


def _fake_package(tmp_path: Path, files: Mapping[str, str]) -> dict[str, Path]:
    root = tmp_path / "kvoffload"
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    modules = {}
    for p in sorted(root.rglob("*.py")):
        parts = list(p.relative_to(tmp_path).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = p
    return modules


def _graph_of(modules: Mapping[str, Path]) -> dict[str, set[str]]:
    return {m: {e.target for e in imports_of(m, modules)} for m in modules}


def test_a_type_checking_import_and_a_function_import_count(tmp_path: Path) -> None:
    modules = _fake_package(
        tmp_path,
        {
            "kvoffload/__init__.py": "",
            "kvoffload/low.py": (
                "from typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n    from kvoffload.high import X\n"
            ),
            "kvoffload/high.py": "def f():\n    from kvoffload import low\n",
        },
    )
    edges = _graph_of(modules)
    assert edges["kvoffload.low"] == {"kvoffload.high"}
    assert edges["kvoffload.high"] == {"kvoffload.low"}
    full = {m: [Import(m, t, 1) for t in ts] for m, ts in edges.items()}
    circle = find_circle(full)
    assert circle is not None
    assert {e.importer for e in circle} == {"kvoffload.low", "kvoffload.high"}


def test_importing_a_submodule_runs_its_package(tmp_path: Path) -> None:
    """``config -> tiers.settings`` also runs ``tiers/__init__.py``: the old fault."""
    modules = _fake_package(
        tmp_path,
        {
            "kvoffload/__init__.py": "from kvoffload import config\n",
            "kvoffload/config.py": "from kvoffload.tiers.settings import S\n",
            "kvoffload/tiers/__init__.py": "from kvoffload.tiers.manager import M\n",
            "kvoffload/tiers/settings.py": "",
            "kvoffload/tiers/manager.py": "from ..config import C\nfrom . import settings\n",
        },
    )
    edges = _graph_of(modules)
    assert edges["kvoffload.config"] == {"kvoffload.tiers.settings", "kvoffload.tiers"}
    # inside the package, its own __init__ is no edge; relative imports resolve
    assert edges["kvoffload.tiers.manager"] == {"kvoffload.config", "kvoffload.tiers.settings"}
    layers = {"kvoffload.config": 1, "kvoffload.tiers": 2, "kvoffload": 3}
    assert layer_of("kvoffload.tiers.settings", layers) == 2
    upward = {
        (m, t)
        for m, ts in edges.items()
        for t in ts
        if (layer_of(t, layers) or 0) > (layer_of(m, layers) or 0)
    }
    assert upward == {
        ("kvoffload.config", "kvoffload.tiers.settings"),
        ("kvoffload.config", "kvoffload.tiers"),
    }


def test_the_layer_table_is_read_from_the_design_page() -> None:
    assert LAYERS["kvoffload.errors"] == 1
    assert LAYERS["kvoffload.layout"] < LAYERS["kvoffload.hashing"] < LAYERS["kvoffload.pool"]
    assert LAYERS["kvoffload.pool"] < LAYERS["kvoffload.config"] < LAYERS["kvoffload.scheduler"]
    assert layer_of("kvoffload.pool.policies.arc") == LAYERS["kvoffload.pool"]
    assert max(LAYERS.values()) == LAYERS["kvoffload"]
    assert layer_of("kvoffload.unlisted") is None  # the root's layer is its own alone
    with pytest.raises(ValueError, match="substring not found"):
        read_layers("# Design\n\nno table\n")


def test_importing_the_config_does_not_import_the_tiers() -> None:
    """The static graph against Python itself: ``kvoffload.config`` with a bare package
    above it (not ``kvoffload/__init__.py``, which imports everything)."""
    code = (
        "import sys, types\n"
        f"pkg = types.ModuleType('kvoffload'); pkg.__path__ = [{str(PACKAGE)!r}]\n"
        "sys.modules['kvoffload'] = pkg\n"
        "import kvoffload.config\n"
        "print(' '.join(sorted(m for m in sys.modules if m.startswith('kvoffload.'))))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True
    ).stdout.split()
    assert "kvoffload.config" in out
    assert not [m for m in out if m.startswith("kvoffload.tiers")], out
    edges = graph()
    closure: set[str] = set()
    todo = ["kvoffload.config"]
    while todo:
        module = todo.pop()
        if module not in closure:
            closure.add(module)
            todo += [e.target for e in edges[module]]
    assert set(out) <= closure, set(out) - closure


def room_of(module: str) -> str:
    """The top-level module or package a module belongs to (``kvoffload.bench.pool`` ->
    ``kvoffload.bench``): the rooms a reader of the package sees."""
    return ".".join(module.split(".")[:2])


def test_the_top_level_modules_and_packages_have_no_circle() -> None:
    """Folded to ``kvoffload.X`` (a package as one room), the imports still have no
    circle: ``kvoffload.bench.pool`` importing ``kvoffload.replay``, which imports
    ``kvoffload.bench.trace``, was one (no module circle, but the two rooms leaned on each
    other)."""
    rooms: dict[str, list[Import]] = {}
    for importer, edges in graph().items():
        mine = room_of(importer)
        for edge in edges:
            theirs = room_of(edge.target)
            if theirs != mine and mine != "kvoffload" and theirs != "kvoffload":
                rooms.setdefault(mine, []).append(Import(mine, theirs, edge.line))
    circle = find_circle(rooms)
    assert circle is None, "a circle between top-level modules and packages:\n" + "\n".join(
        f"{edge.importer} imports {edge.target}" for edge in circle
    )


# -- the class size alarm ---------------------------------------------------------------

MAX_CLASS_LINES = 600
"""The class size alarm: a class of ``kvoffload/`` spanning more lines asks "is this two
jobs?". It is no budget: a class is split where ownership splits (one owner per state, one
job per class), never where a line count runs out (STYLE.md)."""


def classes_over(limit: int, modules: Mapping[str, Path] = MODULES) -> list[tuple[str, int]]:
    """``("module:line Class", lines)`` of every class (nested ones too) spanning more than
    ``limit`` lines, from its ``class`` line to its last line, largest first."""
    found = []
    for module, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                size = (node.end_lineno or node.lineno) - node.lineno + 1
                if size > limit:
                    found.append((f"{module}:{node.lineno} {node.name}", size))
    return sorted(found, key=lambda item: -item[1])


def test_no_class_sets_off_the_size_alarm() -> None:
    """A class past the alarm is named with its size: split it where its ownership splits
    (docs/design.md names who owns what), never by squashing lines to fit."""
    over = classes_over(MAX_CLASS_LINES)
    assert not over, f"classes over {MAX_CLASS_LINES} lines: " + ", ".join(
        f"{name} ({size} lines)" for name, size in over
    )


def test_a_class_over_the_limit_is_named_with_its_size(tmp_path: Path) -> None:
    body = "".join(f"    def m{i}(self) -> int:\n        return {i}\n\n" for i in range(3))
    modules = _fake_package(
        tmp_path,
        {
            "kvoffload/__init__.py": "",
            "kvoffload/big.py": f"class Small:\n    pass\n\n\nclass Big:\n{body}",
            "kvoffload/nested.py": "def f() -> None:\n    class Inner:\n"
            + "".join(f"    {line}\n" for line in body.splitlines()),
        },
    )
    # Each class: its ``class`` line and three methods of three lines, the last blank.
    assert classes_over(5, modules) == [("kvoffload.big:5 Big", 9), ("kvoffload.nested:2 Inner", 9)]
    assert classes_over(9, modules) == []
