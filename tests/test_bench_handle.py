"""The handle benchmark runs both ways on the same offloader and prints its figures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvoffload.bench.__main__ import main
from kvoffload.bench.handle import run_handle_bench


def test_handle_bench_measures_both_ways() -> None:
    res = run_handle_bench(requests=4, prompt_tokens=40, steps=30, reps=2)
    assert res.low_level_us > 0
    assert res.handle_us > 0
    assert res.overhead_us == pytest.approx(res.handle_us - res.low_level_us)


def test_handle_bench_cli(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out_json = tmp_path / "handle.json"
    argv = ["handle", "--requests", "3", "--prompt-tokens", "20", "--steps", "20"]
    assert main([*argv, "--reps", "1", "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert "overhead us" in out
    assert json.loads(out_json.read_text())["requests"] == 3
