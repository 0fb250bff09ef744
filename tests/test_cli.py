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
import kvoffload.replay as replay_module
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


def test_tables_are_not_cut_when_output_is_not_a_terminal(
    tiny: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In a pipe or a log, every cell is printed whole (rich cut them at 80 columns)."""
    monkeypatch.delenv("COLUMNS", raising=False)
    code, out = invoke("replay", str(tiny), "--capacity", "2,50", "--no-progress")
    assert code == 0, out
    assert "…" not in out
    header = next(line for line in out.splitlines() if "capacity" in line)
    for column in ("lru", "arc", "s3fifo", "prefix-freq", "adaptive", "best static", "optimal"):
        assert f" {column} " in header, header
    assert re.search(r"\d\.\d{4} \((lru|arc|s3fifo|prefix-freq|adaptive)\)", out), out
    code, out = invoke("size", "--trace", str(tiny), "--layout", "llama3-70b", "--no-progress")
    assert code == 0, out
    assert "…" not in out
    assert "bytes/block" in out


def test_replay_json_to_stdout_is_only_json(tiny: Path) -> None:
    code, out = invoke("replay", str(tiny), "--capacity", "4", "--json", "-", "--no-progress")
    assert code == 0
    assert json.loads(out)["schema_version"] == 3


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


@pytest.mark.parametrize("value", ["1,,2", "1,2,", ",", "", " ", "0", "4,-3", "1.5", "2,x"])
def test_a_bad_capacity_list_is_refused_naming_the_option_and_value(tiny: Path, value: str) -> None:
    """An empty item is refused, not skipped (``1,,2`` replayed capacities 1 and 2)."""
    code, out = invoke("replay", str(tiny), "--capacity", value, "--no-progress")
    assert code == 2, out
    assert "Invalid value for '--capacity'" in out
    assert repr(value) in out
    assert "prefix hit rate" not in out  # refused before any replay


@pytest.mark.parametrize("value", ["1,,2", "16,", "0,4", "2.5"])
def test_bench_int_lists_refuse_empty_and_bad_items(
    value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvoffload.bench.__main__ import main as bench_main  # noqa: PLC0415

    with pytest.raises(SystemExit) as exited:
        bench_main(["scheduler", "--chunk-blocks", value])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "--chunk-blocks" in err
    assert repr(value) in err


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


# -- bad input: one line naming the file, line and field; exit 1 for data, 2 for usage ------

OK = {"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [1, 2]}


def _line(**fields: object) -> str:
    return json.dumps({**OK, **fields})


BAD_LINES = [
    pytest.param(_line(hash_ids=[1, 2**127]), "hash_ids[1]", id="hash-id-2**127"),
    pytest.param(_line(hash_ids=[-(2**127) - 1]), "hash_ids[0]", id="hash-id-below-range"),
    pytest.param(_line(hash_ids=[1]).replace("[1]", "[NaN]"), "hash_ids[0]", id="nan-hash"),
    pytest.param(_line(hash_ids=[1]).replace("[1]", "[Infinity]"), "hash_ids[0]", id="inf-hash"),
    pytest.param(_line(timestamp=1).replace(": 1,", ": NaN,", 1), "timestamp", id="nan-ts"),
    pytest.param(
        _line(input_length=7).replace(": 7", ": Infinity"), "input_length", id="inf-length"
    ),
    pytest.param(_line(hash_ids=[[1, 2]]), "hash_ids[0]", id="nested-list"),
    pytest.param(_line(output_length={"n": 1}), "output_length", id="nested-dict"),
    pytest.param(_line(hash_ids="123"), "hash_ids", id="string-ids"),
    pytest.param(_line(hash_ids=[1.5]), "hash_ids[0]", id="float-id"),
    pytest.param("[1, 2, 3]", None, id="line-not-an-object"),
]


@pytest.mark.parametrize(("line", "field"), BAD_LINES)
@pytest.mark.parametrize("command", ["replay", "size", "bench"])
def test_a_bad_trace_line_is_one_line_naming_file_line_and_field(
    tmp_path: Path, line: str, field: str | None, command: str
) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(OK) + "\n" + line + "\n", encoding="utf-8")
    args = {
        "replay": ["replay", str(bad), "--no-progress"],
        "size": ["size", "--trace", str(bad), "--layout", "llama3-8b", "--no-progress"],
        "bench": ["bench", "pool", "--trace", str(bad), "--runs", "1", "--no-progress"],
    }[command]
    result = CliRunner().invoke(cli, args)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    assert f"{bad}:2" in result.output
    if field is not None:
        assert f"field {field!r}" in result.output


def test_a_line_that_is_not_utf8_is_named(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(json.dumps(OK).encode() + b"\n\xff\xfe\n")
    code, out = invoke("replay", str(bad), "--no-progress")
    assert code == 1
    assert f"{bad}:2: not UTF-8" in out


@pytest.mark.parametrize("content", ["", "\n\n", json.dumps({**OK, "hash_ids": []}) + "\n"])
@pytest.mark.parametrize("command", ["replay", "size", "bench"])
def test_an_empty_trace_is_refused(tmp_path: Path, content: str, command: str) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text(content, encoding="utf-8")
    args = {
        "replay": ["replay", str(empty), "--no-progress"],
        "size": ["size", "--trace", str(empty), "--layout", "llama3-8b", "--no-progress"],
        "bench": ["bench", "pool", "--trace", str(empty), "--runs", "1", "--no-progress"],
    }[command]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 1, result.output
    assert "no request with a block" in result.output
    assert "0.0000" not in result.output


@pytest.mark.parametrize("value", ["nan", "NaN", "inf", "-0.5", "0", "1.5", "ninety"])
def test_size_refuses_a_bad_target(tiny: Path, value: str) -> None:
    code, out = invoke("size", "--trace", str(tiny), "--layout", "llama3-8b", "--target", value)
    assert code == 2
    assert "--target" in out


def _unwritable(tmp_path: Path) -> list[str]:
    return [str(tmp_path / "absent" / "out.json"), str(tmp_path)]


@pytest.mark.parametrize("which", [0, 1], ids=["missing-folder", "a-directory"])
@pytest.mark.parametrize(
    "args",
    [
        ["replay", "{trace}", "--no-progress", "--json", "{out}"],
        ["replay", "{trace}", "--no-progress", "--plot", "{out}"],
        ["size", "--trace", "{trace}", "--layout", "llama3-8b", "--no-progress", "--json", "{out}"],
        ["synth-trace", "chat", "{out}", "--requests", "2"],
        ["synth-trace", "chat", "{trace}.new", "--requests", "2", "--json", "{out}"],
    ],
    ids=["replay-json", "replay-plot", "size-json", "synth-trace-out", "synth-trace-json"],
)
def test_an_unwritable_output_is_a_usage_error(
    tiny: Path, tmp_path: Path, args: list[str], which: int
) -> None:
    out = _unwritable(tmp_path)[which]
    argv = [a.format(trace=tiny, out=out) for a in args]
    result = CliRunner().invoke(cli, argv)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert out in result.output


def test_a_plot_suffix_matplotlib_cannot_write_is_refused_before_the_replay(
    tiny: Path, tmp_path: Path
) -> None:
    pytest.importorskip("matplotlib")
    code, out = invoke("replay", str(tiny), "--plot", str(tmp_path / "p.foo"), "--no-progress")
    assert code == 2
    assert "'foo'" in out
    assert "png" in out
    assert "capacity" not in out  # no table: nothing ran


def test_a_write_that_fails_late_is_one_line(
    tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "r.json"

    def full(*_args: object, **_kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_text", full)
    code, text = invoke("replay", str(tiny), "--no-progress", "--json", str(out))
    assert code == 1
    assert "No space left on device" in text
    assert str(out) in text


def test_a_capacity_beyond_the_trace_is_capped_and_said(
    tiny: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    built: list[int] = []
    real = replay_module.CpuBlockPool  # type: ignore[attr-defined]

    def spy(num_blocks: int, **kwargs: object) -> object:
        built.append(num_blocks)
        return real(num_blocks, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(replay_module, "CpuBlockPool", spy)
    code, out = invoke(
        "replay", str(tiny), "--capacity", "3,100000000", "--json", "-", "--no-progress"
    )
    assert code == 0, out
    data = json.loads(out)
    # 7 distinct blocks + the longest request (4) = 11 < 15 accesses
    assert data["useful_capacity"] == 11
    assert max(built) == 11
    assert [row["pool_blocks"] for row in data["rows"]] == [3, 11]
    assert all(r["hit_blocks"] == 8 for r in data["rows"][1]["results"])  # the ceiling
    code, out = invoke("replay", str(tiny), "--capacity", "100000000", "--no-progress")
    assert code == 0
    assert "replayed with 11 blocks, the most this trace can use" in out


def test_bench_handle_runs_with_its_default_geometry() -> None:
    """The default prompt (2000 tokens) and steps (200) once ran off the GPU table."""
    assert main(["bench", "handle", "--requests", "1", "--reps", "1"]) == 0


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["tier", "--kind", "disk", "--path", "{file}"], "is not a directory"),
        (["tier", "--kind", "disk", "--path", "{missing}"], "does not exist"),
        (["tier", "--kind", "disk", "--block-kib", "abc"], "not an integer"),
        (["tier", "--kind", "disk", "--batch", "0"], "must be >= 1"),
        (["scheduler", "--reps", "0"], "must be >= 1"),
        (["scheduler", "--requests", "0"], "must be >= 1"),
        (["handle", "--reps", "0"], "must be >= 1"),
        (["copy", "--blocks", "a"], "not an integer"),
        (["copy", "--reps", "0"], "must be >= 1"),
        (["copy", "--dtype", "nonsense"], "invalid choice"),
        (["pool", "--trace", "{file}", "--json", "{missing}/x.json"], "is not a directory"),
    ],
)
def test_bench_usage_errors_are_one_line(
    tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], needle: str
) -> None:
    args = [a.format(file=tiny, missing=tmp_path / "missing") for a in argv]
    assert main(["bench", *args]) == 2
    err = capsys.readouterr().err
    assert needle in err
    assert "Traceback" not in err


def test_bench_pool_missing_trace_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "pool", "--trace", str(tmp_path / "absent.jsonl")]) == 1
    err = capsys.readouterr().err
    assert "absent.jsonl" in err
    assert "No such file" in err


@pytest.mark.parametrize(
    "argv",
    [["kvoffload.cli", "--version"], ["kvoffload.cli", "--help"], ["kvoffload.bench", "--help"]],
)
def test_start_up_does_not_import_torch(argv: list[str]) -> None:
    code = (
        "import runpy, sys\n"
        f"sys.argv = {argv!r}\n"
        "try:\n"
        f"    runpy.run_module({argv[0]!r}, run_name='__main__', alter_sys=True)\n"
        "except SystemExit as exc:\n"
        "    assert not exc.code, exc.code\n"
        "heavy = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
        "print('TORCH' if heavy else 'LIGHT')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "LIGHT", proc.stdout
