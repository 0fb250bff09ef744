"""The copy and scheduler benchmarks run end to end and print what they promise.

Speeds are never asserted here (benchmarks check those); these tests check that each
command runs, prints its table and keeps its own consistency checks.
"""

from __future__ import annotations

import re

import pytest

from kvoffload.bench.__main__ import main
from kvoffload.bench.scheduler import run_scheduler_bench


def test_copy_bench_prints_ratios_and_wakeup_latency(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        [
            "copy",
            "--engine",
            "thread",
            "--layout",
            "small-pieces",
            "--blocks",
            "1,3",
            "--reps",
            "1",
            "--latency-samples",
            "3",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    rows = [line.split() for line in out.splitlines() if re.match(r"\s+[13]\s+\d", line)]
    assert [row[0] for row in rows] == ["1", "3"]
    for row in rows:
        ratios = [float(x) for x in (row[4], row[5], row[8], row[9])]
        assert all(r > 0 for r in ratios)
    assert re.search(r"wake-up latency .* over 3 copies: median \d+ us", out)


def test_scheduler_bench_stores_every_block_once() -> None:
    res = run_scheduler_bench(requests=8, blocks_per_request=12, chunk_blocks=5, reps=1)
    # 8 requests x 12 blocks, each stored exactly once by both planners (checked inside).
    assert res.stored_blocks == 96
    assert res.us_per_block > 0
    assert res.baseline_us_per_block > 0


def test_scheduler_bench_cli(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        [
            "scheduler",
            "--requests",
            "4",
            "--blocks-per-request",
            "6",
            "--chunk-blocks",
            "2,6",
            "--reps",
            "1",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "rescan baseline" in out
    assert re.search(r"target <= 2 us per block: (met|NOT met)", out)
