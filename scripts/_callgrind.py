"""Count the instructions a Python child program runs, under valgrind's callgrind.

The child (``python -c PROGRAM ARGS...``) sets itself up, prints ``ready``, waits for a
line on its standard input and then runs the work to be measured: instrumentation is
switched on only between the two (``callgrind_control -i on``), so imports and set-up are
not counted. Used by ``scheduler_instructions.py``, ``handle_instructions.py`` and
``pool_vs_vllm_instructions.py``.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile

__all__ = ["count_after_ready", "have_callgrind", "run_after_ready"]


def have_callgrind() -> bool:
    """Whether ``valgrind`` and ``callgrind_control`` are on the ``PATH``."""
    return shutil.which("valgrind") is not None and shutil.which("callgrind_control") is not None


def count_after_ready(program: str, args: list[str]) -> int:
    """Instructions ``python -c program *args`` runs after it printed ``ready``
    (``PYTHONHASHSEED=0``, run in a temporary directory)."""
    return run_after_ready(program, args)[0]


def run_after_ready(
    program: str, args: list[str], *, python: str = sys.executable
) -> tuple[int, str]:
    """`count_after_ready` with another interpreter; also returns what the program wrote
    to its standard output after ``ready``."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            "valgrind",
            "--tool=callgrind",
            "--instr-atstart=no",
            f"--callgrind-out-file={tmp}/cg.out",
            python,
            "-c",
            program,
            *args,
        ]
        env = {**os.environ, "PYTHONHASHSEED": "0"}
        with subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=tmp,
        ) as proc:
            assert proc.stdin is not None
            assert proc.stdout is not None
            line = proc.stdout.readline()
            if line.strip() != "ready":
                _, err = proc.communicate()
                raise RuntimeError(f"the stage did not start: {line!r}\n{err[-2000:]}")
            subprocess.run(
                ["callgrind_control", "-i", "on", str(proc.pid)], check=True, capture_output=True
            )
            proc.stdin.write("go\n")
            proc.stdin.flush()
            out, err = proc.communicate()
    found = re.search(r"Collected : (\d+)", err)
    if proc.returncode != 0 or found is None:
        raise RuntimeError(f"no instruction count in valgrind's output:\n{err[-2000:]}")
    return int(found.group(1)), out
