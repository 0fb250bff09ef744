"""The test command's scripts change nothing on the system unless asked to.

Without ``CI=true`` or ``KVOFFLOAD_INSTALL_SYSTEM_PACKAGES=1``, a missing ``redis-server``
or ``valkey-server`` makes ``scripts/with_redis.sh`` and ``scripts/test.sh`` stop with a
message naming what is missing and how to get it, and apt-get is never called (a fake one
on ``PATH`` records any call).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]


def _run(
    script: str, tmp_path: Path, *args: str, **env: str
) -> tuple[subprocess.CompletedProcess[str], Path]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "apt-calls"
    for tool in ("apt-get", "apt-cache"):
        fake = bin_dir / tool
        fake.write_text(f'#!/bin/sh\necho "{tool} $*" >> {calls}\n')
        fake.chmod(0o755)
    for tool in ("dirname", "id", "cat"):  # what the scripts run before they give up
        found = shutil.which(tool)
        assert found is not None
        (bin_dir / tool).symlink_to(found)
    bash = shutil.which("bash")
    assert bash is not None
    base = {
        k: v for k, v in os.environ.items() if k not in {"CI", "KVOFFLOAD_INSTALL_SYSTEM_PACKAGES"}
    }
    done = subprocess.run(
        [bash, str(ROOT / "scripts" / script), "true"]
        if script == "with_redis.sh"
        else [bash, str(ROOT / "scripts" / script), *args],
        check=False,
        env={**base, "PATH": str(bin_dir), **env},
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    return done, calls


@pytest.mark.parametrize("server", ["redis-server", "valkey-server"])
def test_with_redis_says_what_is_missing_and_installs_nothing(tmp_path: Path, server: str) -> None:
    done, calls = _run("with_redis.sh", tmp_path, KVOFFLOAD_TEST_REDIS_SERVER=server)
    assert done.returncode == 1
    assert f"{server} is not installed" in done.stderr
    assert "KVOFFLOAD_INSTALL_SYSTEM_PACKAGES=1" in done.stderr
    assert "--install-system-packages" in done.stderr
    assert f"apt-get install --no-install-recommends {server}" in done.stderr
    assert not calls.exists(), calls.read_text()


def test_test_sh_names_every_missing_server_before_running_anything(tmp_path: Path) -> None:
    done, calls = _run("test.sh", tmp_path, CI="false")
    assert done.returncode == 1
    assert "redis-server is not installed" in done.stderr
    assert "valkey-server is not installed" in done.stderr
    assert "==> stage" not in done.stdout  # stopped before the first check
    assert not calls.exists(), calls.read_text()


STAGES = [
    "pytest (next to a throwaway redis-server)",
    "pytest: the Redis tier against Valkey",
    "pytest: the Redis Cluster tier",
    "ruff check",
    "ruff format --check",
    "mypy --strict",
    "mkdocs build --strict",
    "examples",
    "vLLM integration tests",
    "SGLang HiCache backend tests",
]


@pytest.mark.parametrize("fast", [False, True])
def test_test_sh_numbers_its_stages_and_fast_skips_only_the_engines(
    tmp_path: Path, fast: bool
) -> None:
    """``--list`` prints the stages a run announces ("stage N of M") and runs nothing (no
    redis-server on PATH, no environment set up); ``--fast`` drops the two engine stages
    (vLLM, SGLang) alone and says that they are skipped."""
    done, calls = _run("test.sh", tmp_path, "--list", *(["--fast"] if fast else []), CI="false")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    expected = STAGES[:-2] if fast else STAGES
    for n, (line, stage) in enumerate(zip(lines, expected, strict=False), start=1):
        assert line.startswith(f"stage {n} of {len(expected)}: {stage}"), line
    if fast:
        assert len(lines) == len(expected) + 1
        assert lines[-1].startswith("skipped (--fast): vLLM integration tests")
        assert "and SGLang HiCache backend tests" in lines[-1]
    else:
        assert len(lines) == len(expected)
    assert not calls.exists()


def test_test_sh_says_how_long_it_takes_and_how_to_run_the_fast_part(tmp_path: Path) -> None:
    script = (ROOT / "scripts" / "test.sh").read_text(encoding="utf-8")
    # Every stage announces itself with its number and the time elapsed, from one list.
    assert "==> stage %d of %d (%s): %s" in script
    assert "${stages[i]%%|*}" in script
    readme = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    for text in (script, readme):
        flat = " ".join(text.replace("#", " ").split())
        assert "about 10 minutes on a quiet 2-core machine" in flat
        assert "40 minutes or more on a loaded one" in flat
        assert "--fast" in flat
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert "exec bash scripts/test.sh </dev/null" in ci  # CI runs every stage


def test_install_valkey_refuses_without_the_flag(tmp_path: Path) -> None:
    done, calls = _run("install_valkey.sh", tmp_path)
    assert done.returncode == 1
    assert "valkey-server is not installed" in done.stderr
    assert not calls.exists(), calls.read_text()


def _pyproject() -> dict[str, Any]:
    with (ROOT / "pyproject.toml").open("rb") as f:
        return tomllib.load(f)


def _extra_requirements(extra: str, extras: dict[str, list[str]]) -> set[str]:
    """The requirement names of an extra, through ``kvoffload[...]`` references."""
    names: set[str] = set()
    for requirement in extras[extra]:
        name = re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower()
        if name == "kvoffload":
            for inner in re.findall(r"\[(.*)\]", requirement)[0].split(","):
                names |= _extra_requirements(inner.strip(), extras)
        else:
            names.add(name)
    return names


def test_the_demo_environment_has_numpy() -> None:
    """Without numpy, the demo's first line was torch's "Failed to initialize NumPy"."""
    script = (ROOT / "scripts" / "demo.sh").read_text(encoding="utf-8")
    found = re.search(r'^source ".*/_env\.sh" (\S+)$', script, re.M)
    assert found, "demo.sh does not source _env.sh with an extras argument"
    extras = found.group(1).strip('"').split(",")
    assert extras != [""]
    table = _pyproject()["project"]["optional-dependencies"]
    assert "numpy" in set().union(*(_extra_requirements(e, table) for e in extras))


def test_the_package_metadata_builds_without_a_deprecation_warning() -> None:
    """``project.license`` is an SPDX string (a TOML table is deprecated by setuptools 77),
    and the build asks for a setuptools that reads it."""
    project = _pyproject()
    assert project["project"]["license"] == "Apache-2.0"
    assert not [c for c in project["project"]["classifiers"] if c.startswith("License ::")]
    assert "setuptools>=77" in project["build-system"]["requires"]
    pytest.importorskip("setuptools")
    code = (
        "from setuptools.config.pyprojecttoml import apply_configuration\n"
        "from setuptools.dist import Distribution\n"
        "dist = apply_configuration(Distribution(), 'pyproject.toml')\n"
        "print(dist.metadata.license_expression)\n"
    )
    done = subprocess.run(
        [sys.executable, "-W", "error", "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "Apache-2.0"
    assert "Deprecat" not in done.stderr
