"""examples/engine_step_loop.py, the integration guide's code, runs and checks itself."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "engine_step_loop.py"


def test_engine_step_loop_example_runs() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVOFFLOAD_")}
    env["KVOFFLOAD_EXAMPLE_QUICK"] = "1"
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # The example asserts its own results; these lines show it got to the end.
    assert "[b] hit 20 of 26 prompt tokens; loaded KV is bit-exact" in proc.stdout
    assert "a new lookup hits nothing" in proc.stdout
