"""examples/hf_chat.py, quick size: identical tokens every way, loads, a mismatch fails."""

from __future__ import annotations

import re
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from example_loader import load_example

pytest.importorskip("transformers")


@pytest.fixture
def example(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.setenv("KVOFFLOAD_EXAMPLE_QUICK", "1")  # read when the module is loaded
    return load_example("hf_chat")


def test_chat_runs_both_ways_with_identical_tokens(
    example: ModuleType, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    png = tmp_path / "ttft.png"
    assert example.main(["--no-progress", "--profile", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "tokens identical with offload, GPU cache only and full recompute: 9 requests" in out
    rows = re.findall(r"^\s+(\d) +(\d+) +(\d+) +(\d+) +(\d+) ", out, re.MULTILINE)
    assert [int(r[0]) for r in rows] == [1, 2, 3]
    for _, prompt, computed, gpu, loaded in rows:
        assert int(computed) + int(gpu) + int(loaded) == int(prompt)
    assert int(rows[2][4]) > 0  # turn 3 loads from the CPU pool
    stored = re.search(r"offloader: stored (\d+) blocks, loaded (\d+),", out)
    assert stored
    assert int(stored.group(1)) > 0
    assert int(stored.group(2)) > 0
    assert re.search(r"^median TTFT ratio, turns >= 3: \d+\.\dx$", out, re.MULTILINE)
    assert png.stat().st_size > 0
    for way in ("with offload", "full recompute"):
        line = re.search(
            rf"^  {way} +TTFT +([\d.]+) = forward +([\d.]+) \(attention +([\d.]+)", out, re.M
        )
        assert line, out
        ttft, forward, attention = (float(x) for x in line.groups())
        assert 0 < attention < forward <= ttft


def test_a_token_difference_fails_the_run(
    example: ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real = example.run_once
    calls = 0

    async def tampered(*args: Any) -> Any:
        nonlocal calls
        calls += 1
        result = await real(*args)
        if calls == 6:  # the full recompute of the second request
            result.output_token_ids[-1] += 1
        return result

    monkeypatch.setattr(example, "run_once", tampered)
    assert example.main(["--no-progress"]) == 1
    assert "TOKEN MISMATCH: c1-t1" in capsys.readouterr().err


def test_a_local_checkpoint_loads_by_path(
    example: ModuleType, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    model = example.random_llama(example.SIZES["quick"], seed=3)
    model.save_pretrained(tmp_path / "ckpt")
    argv = ["--no-progress", "--model", str(tmp_path / "ckpt"), "--turns", "2"]
    assert example.main(argv) == 0
    assert "tokens identical with offload, GPU cache only and full recompute: 6 requests" in (
        capsys.readouterr().out
    )


@pytest.mark.parametrize("family", ["gemma3", "qwen3_next"])
def test_each_hybrid_family_runs_with_identical_tokens(
    example: ModuleType, capsys: pytest.CaptureFixture[str], family: str
) -> None:
    argv = ["--no-progress", "--model", family, "--turns", "2", "--conversations", "3"]
    assert example.main(argv) == 0
    out = capsys.readouterr().out
    assert "tokens identical with offload, GPU cache only and full recompute: 6 requests" in out
    stored = re.search(r"offloader: stored (\d+) blocks, loaded (\d+),", out)
    assert stored is not None
    assert int(stored.group(1)) > 0
    assert int(stored.group(2)) > 0  # the second turns load every group from CPU
