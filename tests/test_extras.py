"""Every module behind an optional extra names the extra, and how to install it from a clone.

kvoffload is not on a public index, so ``pip install 'kvoffload[redis]'`` fails for a user;
the messages say ``pip install '.[redis]'`` from a kvoffload clone instead. Each case runs in
a fresh interpreter with the extra's package hidden (a ``None`` entry in ``sys.modules`` is
what Python's import system treats as "not installed").
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvoffload._extras import install_command, needs_extra

ROOT = Path(__file__).resolve().parents[1]

CASES = [
    # (module, the package it needs, the extra)
    ("kvoffload.integrations.transformers", "transformers", "transformers"),
    ("kvoffload.integrations.vllm", "vllm", "vllm"),
    ("kvoffload.integrations.sglang", "sglang", "sglang"),
    ("kvoffload.tiers.redis", "redis", "redis"),
    ("kvoffload.metrics", "prometheus_client", "prometheus"),
    ("kvoffload.cli", "click", "cli"),
]


def test_the_message_names_the_extra_and_the_command() -> None:
    assert install_command("redis") == "pip install '.[redis]'"
    assert needs_extra("kvoffload.tiers.redis", "redis") == (
        "kvoffload.tiers.redis needs the `redis` extra: from a kvoffload clone, "
        "pip install '.[redis]'"
    )


@pytest.mark.parametrize(("module", "package", "extra"), CASES, ids=[c[0] for c in CASES])
def test_import_without_the_extra_names_it(module: str, package: str, extra: str) -> None:
    code = (
        f"import sys; sys.modules[{package!r}] = None\n"
        "import kvoffload\n"
        "try:\n"
        f"    import {module}\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
        "else:\n"
        "    raise SystemExit('imported without its extra')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
        cwd=ROOT,
    )
    message = done.stdout.strip()
    assert message.startswith(f"{module} needs the `{extra}` extra") or (
        module == "kvoffload.cli" and "the kvoffload command line needs the `cli` extra" in message
    ), message
    assert f"from a kvoffload clone, pip install '.[{extra}]'" in message


def test_no_message_in_the_package_names_a_package_index_install() -> None:
    """No module, doc page or example tells a user to ``pip install 'kvoffload[...]'``."""
    by_name = re.compile(r"pip install (-\S+ )*['\"]?kvoffload\[")
    paths = [ROOT / "README.md"]
    for base in ("kvoffload", "docs", "examples"):
        paths += [p for p in (ROOT / base).rglob("*") if p.suffix in {".py", ".md"}]
    offenders = [
        str(path.relative_to(ROOT)) for path in paths if by_name.search(path.read_text("utf-8"))
    ]
    assert offenders == []
