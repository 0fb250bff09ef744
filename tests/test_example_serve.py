"""The serving demo, examples/serve_multiturn.py: runs, hits, verifies, and can fail."""

from __future__ import annotations

import re
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from example_loader import load_example


@pytest.fixture
def example(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.setenv("KVOFFLOAD_EXAMPLE_QUICK", "1")  # read when the module is loaded
    return load_example("serve_multiturn")


def _number(pattern: str, out: str) -> float:
    match = re.search(pattern, out, re.MULTILINE)
    assert match, out
    return float(match.group(1).replace(",", ""))


def test_multiturn_run_hits_and_verifies_bit_exact(
    example: ModuleType, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    png = tmp_path / "ttft.png"
    argv = ["--conversations", "4", "--turns", "3", "--verify-every", "1", "--no-progress"]
    assert example.main([*argv, "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert _number(r"^requests served: (\d+)$", out) == 12
    assert _number(r"^prefix hit rate: (\d\.\d+) ", out) > 0
    assert _number(r"^KV verified: (\d+) blocks bit-exact", out) > 0
    loaded = _number(r"\+ ([\d,]+) loaded", out)
    assert loaded > 0
    assert _number(r"^offloader: stored (\d+) blocks", out) > 0
    assert _number(r"loaded (\d+), deferred", out) * 16 == loaded
    assert png.stat().st_size > 0


def test_trace_replay(
    example: ModuleType, capsys: pytest.CaptureFixture[str], trace_path: Path
) -> None:
    # The trace's first shared prefix is at request 49.
    argv = ["--trace", str(trace_path), "--limit", "50", "--trace-block-tokens", "8"]
    assert example.main([*argv, "--verify-every", "1", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert _number(r"^requests served: (\d+)$", out) == 50
    assert _number(r"^prefix hit rate: (\d\.\d+) ", out) > 0
    assert _number(r"^KV verified: (\d+) blocks bit-exact", out) > 0


def test_verification_detects_a_single_flipped_bit(example: ModuleType) -> None:
    engine = example.ToyEngine(16)
    tokens = list(range(1000, 1000 + 3 * 16 + 5))  # 3 full blocks and a partial one
    table = [9, 2, 14, 5]
    engine.compute(table, tokens, 0, 32)
    engine.compute(table, tokens, 32, len(tokens))  # in two chunks, as prefill does
    expected = engine.recompute(tokens)
    assert example.find_mismatches(engine.kv, table, expected) == []
    block = engine.kv[2][table[1]]
    block.view(torch.int16)[1, 3, 0, 7] ^= 1  # the lowest mantissa bit of one value
    assert example.find_mismatches(engine.kv, table, expected) == [1]


def test_a_corrupted_load_fails_the_run(
    example: ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    verify = example.Server.verify

    async def corrupt_then_verify(self: Any, rid: str, table: list[int], *args: Any) -> None:
        self.engine.kv[0][table[0]].view(torch.int16)[0, 0, 0, 0] ^= 1  # the first loaded block
        await verify(self, rid, table, *args)

    monkeypatch.setattr(example.Server, "verify", corrupt_then_verify)
    argv = ["--conversations", "2", "--turns", "2", "--verify-every", "1", "--no-progress"]
    assert example.main(argv) == 1
    captured = capsys.readouterr()
    assert re.search(r"KV MISMATCH: req-\d+: blocks \[0\] differ", captured.err)
    assert "bit-exact" not in captured.out
