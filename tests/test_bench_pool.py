from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kvoffload.bench import pool as bench
from kvoffload.bench.__main__ import main as bench_main
from kvoffload.hashing import BlockHash
from kvoffload.pool.block_pool import CpuBlockPool


def write_trace(path: Path, requests: list[list[int]]) -> Path:
    lines = [
        json.dumps(
            {
                "timestamp": i * 10,
                "input_length": 512 * len(ids),
                "output_length": 8,
                "hash_ids": ids,
            }
        )
        for i, ids in enumerate(requests)
    ]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def keys(*ids: int) -> list[BlockHash]:
    return [BlockHash(i.to_bytes(16, "little", signed=True)) for i in ids]


def test_replay_counts_hits_and_block_ops() -> None:
    requests = [keys(0, 1, 2), keys(0, 1, 3), keys(0, 1, 2, 4)]
    counts = bench.replay(CpuBlockPool(10), requests)
    # r1: 0 hits; r2: hits 0,1; r3: hits 0,1,2
    assert counts.total_blocks == 10
    assert counts.hit_blocks == 5
    assert counts.skipped_blocks == 0
    # r1: lookup 1, alloc/publish/free 3 each -> 10
    # r2: lookup 3, touch 2, alloc/publish 1 each, free 3 -> 10
    # r3: lookup 4, touch 3, alloc/publish 1 each, free 4 -> 13
    assert counts.block_ops == 33
    assert counts.hit_rate == 0.5


def test_replay_skips_what_does_not_fit() -> None:
    counts = bench.replay(CpuBlockPool(2), [keys(0, 1, 2, 3), keys(0, 1, 2, 3)])
    assert counts.skipped_blocks == 4
    assert counts.hit_blocks == 2
    assert counts.hit_rate == 0.25


@pytest.mark.parametrize("capacity", [1, 3, 5, 50])
def test_baseline_has_the_same_semantics(capacity: int) -> None:
    requests = [keys(*range(s, s + n)) for s, n in [(0, 4), (0, 6), (2, 3), (0, 2), (0, 7)]]
    ours = bench.replay(CpuBlockPool(capacity), requests)
    base = bench.replay_baseline(bench.BaselinePool(capacity), requests)
    assert ours == base


def test_baseline_pool_double_free() -> None:
    pool = bench.BaselinePool(2)
    (b,) = pool.allocate(1)
    pool.free([b])
    with pytest.raises(ValueError, match="double free"):
        pool.free([b])
    with pytest.raises(ValueError, match="cannot allocate 3"):
        pool.allocate(3)


def test_cli_on_a_tiny_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = write_trace(tmp_path / "tiny.jsonl", [[0, 1, 2], [0, 1, 3], [0, 1, 2, 4], [9]])
    out_json = tmp_path / "figures.json"
    code = bench.main(
        [
            "--trace",
            str(trace),
            "--capacity",
            "2,100",
            "--runs",
            "1",
            "--no-progress",
            "--json",
            str(out_json),
        ]
    )
    assert code == 0
    out, err = capsys.readouterr()
    assert err == ""  # --no-progress
    assert "block-ops = blocks passed through pool calls" in out
    assert "LRU ref" not in out  # not the synthetic trace
    rows = {
        line.split()[0]: line.split() for line in out.splitlines() if line.strip()[:1].isdigit()
    }
    assert set(rows) == {"2", "100"}
    assert rows["100"][1] == f"{5 / 11:.4f}"
    figures = json.loads(out_json.read_text())
    assert figures["requests"] == 4
    assert figures["blocks"] == 11
    by_capacity = {r["capacity"]: r for r in figures["results"]}
    assert by_capacity[100]["hit_rate"] == pytest.approx(5 / 11)
    assert by_capacity[100]["lru_reference"] is None
    for result in figures["results"]:
        assert result["block_ops"] > 0
        assert result["block_ops_per_s"] > 0
        assert result["ratio"] == pytest.approx(
            result["block_ops_per_s"] / result["baseline_block_ops_per_s"]
        )


def test_cli_shows_progress_on_stderr(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = write_trace(tmp_path / "tiny.jsonl", [[0, 1], [0, 2]])
    assert bench.main(["--trace", str(trace), "--capacity", "4", "--runs", "2"]) == 0
    _, err = capsys.readouterr()
    assert "pool replay" in err


@pytest.mark.parametrize(
    "argv",
    [
        ["--capacity", "0"],
        ["--capacity", "ten"],
        ["--runs", "0"],
        ["--policy", "mru"],
    ],
)
def test_cli_rejects_bad_arguments(
    tmp_path: Path, argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    trace = write_trace(tmp_path / "tiny.jsonl", [[0]])
    with pytest.raises(SystemExit) as info:
        bench.main(["--trace", str(trace), *argv])
    assert info.value.code == 2
    assert "error" in capsys.readouterr().err


def test_cli_replays_with_another_policy(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--policy``: the pool under test changes, the textbook LRU pool stays the reference
    (their hit rates may then differ: only LRU's must equal the baseline's)."""
    trace = write_trace(tmp_path / "tiny.jsonl", [[0, 1, 2], [5, 6], [0, 1, 2], [7, 8], [0, 1]])
    out_json = tmp_path / "figures.json"
    argv = ["--trace", str(trace), "--capacity", "4", "--runs", "1", "--no-progress"]
    assert bench.main([*argv, "--policy", "Adaptive", "--json", str(out_json)]) == 0
    out, _ = capsys.readouterr()
    assert "eviction policy: adaptive" in out
    figures = json.loads(out_json.read_text())
    assert figures["policy"] == "adaptive"
    (result,) = figures["results"]
    expected = bench.replay(
        CpuBlockPool(4, policy="adaptive"),
        [keys(*r) for r in [[0, 1, 2], [5, 6], [0, 1, 2], [7, 8], [0, 1]]],
    )
    assert result["hit_rate"] == pytest.approx(expected.hit_rate)


def test_cli_names_a_bad_trace_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "bad.jsonl"
    trace.write_text('{"timestamp": 0}\n', encoding="utf-8")
    assert bench.main(["--trace", str(trace), "--no-progress"]) == 1
    assert "bad.jsonl:1: field 'input_length': missing" in capsys.readouterr().err


@pytest.mark.trace
def test_hit_rates_match_the_trace_readme(
    trace_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_json = tmp_path / "figures.json"
    code = bench.main(
        ["--trace", str(trace_path), "--runs", "1", "--no-progress", "--json", str(out_json)]
    )
    assert code == 0
    out = capsys.readouterr().out
    assert "LRU ref" in out
    results = json.loads(out_json.read_text())["results"]
    assert [r["capacity"] for r in results] == [1000, 6000, 20000]
    for r in results:
        assert r["lru_reference"] == bench.LRU_REFERENCE[r["capacity"]]
        assert abs(r["hit_rate"] - r["lru_reference"]) <= 0.005, r


def test_module_entry_point_runs_pool(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = write_trace(tmp_path / "tiny.jsonl", [[0, 1, 2], [0, 1, 3]])
    argv = ["pool", "--trace", str(trace), "--capacity", "8", "--runs", "1", "--no-progress"]
    assert bench_main(argv) == 0
    out = capsys.readouterr().out
    assert re.search(r"^\s+8\s+0\.3333\s", out, re.MULTILINE), out


def test_help_defines_block_ops(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        bench.main(["--help"])
    assert info.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "Block-ops* count the blocks passed through pool calls" in out
