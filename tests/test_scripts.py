"""The test command's scripts change nothing on the system unless asked to.

Without ``CI=true`` or ``KVOFFLOAD_INSTALL_SYSTEM_PACKAGES=1``, a missing ``redis-server``
or ``valkey-server`` makes ``scripts/with_redis.sh`` and ``scripts/test.sh`` stop with a
message naming what is missing and how to get it, and apt-get is never called (a fake one
on ``PATH`` records any call).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(script: str, tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess[str], Path]:
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
        else [bash, str(ROOT / "scripts" / script)],
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
    assert "==> pytest" not in done.stdout  # stopped before the first check
    assert not calls.exists(), calls.read_text()


def test_install_valkey_refuses_without_the_flag(tmp_path: Path) -> None:
    done, calls = _run("install_valkey.sh", tmp_path)
    assert done.returncode == 1
    assert "valkey-server is not installed" in done.stderr
    assert not calls.exists(), calls.read_text()
