"""The ``kvoffload`` command line, through click's test runner."""

from __future__ import annotations

import importlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

import kvoffload.cli
from kvoffload.cli import cli, main

REQUESTS = [[0, 1, 2], [0, 1, 3], [0, 1, 2, 4], [9], [0, 1, 2, 5]]


def write_trace(path: Path, requests: list[list[int]]) -> Path:
    lines = [
        json.dumps(
            {"timestamp": i, "input_length": 512 * len(r), "output_length": 1, "hash_ids": r}
        )
        for i, r in enumerate(requests)
    ]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    return write_trace(tmp_path / "tiny.jsonl", REQUESTS)


def invoke(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, list(args), catch_exceptions=False)
    return result.exit_code, result.output


@pytest.mark.parametrize("args", [[], ["replay"], ["size"], ["bench"]])
def test_help(args: list[str]) -> None:
    code, out = invoke(*args, "--help")
    assert code == 0
    assert "Usage:" in out


def test_replay_prints_the_table_and_writes_json(tiny: Path, tmp_path: Path) -> None:
    out_json = tmp_path / "r.json"
    code, out = invoke(
        "replay",
        str(tiny),
        "--capacity",
        "2,50",
        "--policy",
        "lru,s3fifo",
        "--json",
        str(out_json),
        "--no-progress",
    )
    assert code == 0, out
    for word in ("capacity", "lru", "s3fifo", "optimal", "ceiling"):
        assert word in out
    data = json.loads(out_json.read_text())
    assert [row["capacity"] for row in data["rows"]] == [2, 50]
    assert [r["policy"] for r in data["rows"][1]["results"]] == ["lru", "s3fifo"]
    # 50 blocks hold everything: every policy reaches the ceiling (8 of 15 blocks)
    assert all(r["hit_blocks"] == 8 for r in data["rows"][1]["results"])
    assert data["ceiling_hit_rate"] == pytest.approx(8 / 15)


def test_replay_json_to_stdout_is_only_json(tiny: Path) -> None:
    code, out = invoke("replay", str(tiny), "--capacity", "4", "--json", "-", "--no-progress")
    assert code == 0
    assert json.loads(out)["schema_version"] == 1


def test_replay_plot(tiny: Path, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "p.png"
    code, out = invoke(
        "replay", str(tiny), "--capacity", "2,4,8", "--plot", str(png), "--no-progress"
    )
    assert code == 0, out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_missing_trace_file(tmp_path: Path) -> None:
    code, out = invoke("replay", str(tmp_path / "absent.jsonl"))
    assert code == 1
    assert "absent.jsonl" in out
    assert "not found" in out


def test_malformed_line_is_named(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        json.dumps({"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [1]})
        + "\n{not json\n"
    )
    code, out = invoke("replay", str(bad), "--no-progress")
    assert code == 1
    assert "bad.jsonl:2" in out


def test_unknown_policy_lists_the_known_ones(tiny: Path) -> None:
    code, out = invoke("replay", str(tiny), "--policy", "lru,mru")
    assert code == 2
    assert "mru" in out
    assert "lru, arc, s3fifo, prefix-freq" in out


@pytest.mark.parametrize(
    ("option", "value", "needle"),
    [
        ("--capacity", "0,10", "capacity"),
        ("--capacity", "ten", "integers"),
        ("--admission", "twice", "seen_twice"),
    ],
)
def test_bad_options_exit_2(tiny: Path, option: str, value: str, needle: str) -> None:
    code, out = invoke("replay", str(tiny), option, value)
    assert code == 2
    assert needle in out


def test_size_reports_blocks_and_gib(tiny: Path) -> None:
    code, out = invoke(
        "size",
        "--trace",
        str(tiny),
        "--layout",
        "llama3-8b",
        "--target",
        "1.0",
        "--json",
        "-",
        "--no-progress",
    )
    assert code == 0, out
    data = json.loads(out)
    # llama3-8b: 32 layers x 8 heads x 128 x 2 (K, V) x 2 bytes = 128 KiB per token
    assert data["bytes_per_block"] == 512 * 128 * 1024
    assert data["hit_rate"] == pytest.approx(data["ceiling_hit_rate"])
    assert data["gib"] == pytest.approx(data["capacity_blocks"] * 64 / 1024)


def test_size_with_an_explicit_layout(tiny: Path) -> None:
    code, out = invoke(
        "size",
        "--trace",
        str(tiny),
        "--layout",
        "num_layers=2,num_kv_heads=1,head_size=8",
        "--dtype",
        "float32",
        "--block-tokens",
        "16",
        "--no-progress",
    )
    assert code == 0, out
    assert "GiB" in out
    code, out = invoke("size", "--trace", str(tiny), "--layout", "num_layers=2")
    assert code == 2
    assert "head_size" in out


def test_bench_runs_under_the_one_command(tiny: Path, tmp_path: Path) -> None:
    out_json = tmp_path / "b.json"
    code = main(
        [
            "bench",
            "pool",
            "--trace",
            str(tiny),
            "--capacity",
            "4",
            "--runs",
            "1",
            "--no-progress",
            "--json",
            str(out_json),
        ]
    )
    assert code == 0
    assert json.loads(out_json.read_text())["results"][0]["capacity"] == 4
    assert main(["bench", "pool"]) == 2  # --trace is required: argparse's usage error


def test_main_returns_exit_codes(tiny: Path) -> None:
    assert main(["replay", str(tiny), "--capacity", "3", "--no-progress"]) == 0
    assert main(["replay", str(tiny), "--policy", "nope"]) == 2
    assert main(["--help"]) == 0


def test_module_alias_still_runs_the_benchmarks(tiny: Path) -> None:
    """``python -m kvoffload.bench`` is kept as an alias of ``kvoffload bench``."""
    cmd = [sys.executable, "-m", "kvoffload.bench", "pool", "--trace", str(tiny)]
    cmd += ["--capacity", "3", "--runs", "1", "--no-progress"]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"^\s+3\s+0\.\d{4}", proc.stdout, re.MULTILINE), proc.stdout


def test_copy_bench_writes_json(tmp_path: Path) -> None:
    out_json = tmp_path / "c.json"
    code = main(
        [
            "bench",
            "copy",
            "--engine",
            "thread",
            "--layout",
            "small-pieces",
            "--blocks",
            "1,2",
            "--reps",
            "2",
            "--latency-samples",
            "2",
            "--json",
            str(out_json),
        ]
    )
    assert code == 0
    data = json.loads(out_json.read_text())
    assert [r["blocks"] for r in data["results"]] == [1, 2]
    assert all(r["store_gbps"] > 0 and r["load_gbps"] > 0 for r in data["results"])
    assert data["wakeup_latency_s"]["samples"] == 2


def test_without_the_cli_extra_the_import_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "click", None)  # as if click were not installed
    with pytest.raises(ImportError, match=r"pip install '\.\[cli\]'"):
        importlib.reload(kvoffload.cli)
    monkeypatch.undo()
    importlib.reload(kvoffload.cli)
