"""Importing the integration without vLLM names the extra to install."""

from __future__ import annotations

import subprocess
import sys


def test_import_without_vllm_names_the_extra() -> None:
    code = (
        "import sys; sys.modules['vllm'] = None\n"
        "import kvoffload\n"
        "try:\n"
        "    import kvoffload.integrations.vllm\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
        "else:\n"
        "    raise SystemExit('imported without vLLM')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert "from a kvoffload clone, pip install '.[vllm]'" in done.stdout


def test_core_does_not_import_the_integration() -> None:
    code = (
        "import sys, kvoffload, kvoffload.offloader, kvoffload.scheduler\n"
        "print(sorted(m for m in sys.modules if m.startswith(('vllm', 'kvoffload.integrations'))))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert done.stdout.strip() == "[]"
