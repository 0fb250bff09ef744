"""``python -m kvoffload.bench tier`` runs end to end and prints both columns and the ratio.

Speeds are not asserted (the benchmark reports them); the runs check their own bytes.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvoffload.bench.__main__ import main


def rows(out: str) -> list[list[str]]:
    return [line.split() for line in out.splitlines() if line.startswith(("disk ", "redis "))]


@pytest.mark.parametrize("direct_io", ["auto", "never"])
def test_disk_bench(capsys: pytest.CaptureFixture[str], tmp_path: Path, direct_io: str) -> None:
    argv = ["tier", "--kind", "disk", "--block-kib", "64,8", "--total-mib", "1", "--reps", "1"]
    code = main([*argv, "--path", str(tmp_path), "--direct-io", direct_io])
    out = capsys.readouterr().out
    assert code == 0
    table = rows(out)
    assert [(r[1], r[2]) for r in table] == [
        ("64Ki", "store"),
        ("64Ki", "load"),
        ("8Ki", "store"),
        ("8Ki", "load"),
    ]
    for row in table:
        ours, base, ratio = (float(x) for x in row[3:6])
        assert ours >= 0
        assert base >= 0
        assert ratio > 0
    assert list(tmp_path.iterdir()) == []  # its files are removed


def test_redis_bench(capsys: pytest.CaptureFixture[str], redis_url: str) -> None:
    argv = ["tier", "--kind", "redis", "--url", redis_url, "--block-kib", "64"]
    code = main([*argv, "--total-mib", "1", "--reps", "1"])
    out = capsys.readouterr().out
    assert code == 0
    assert [(r[1], r[2]) for r in rows(out)] == [("64Ki", "store"), ("64Ki", "load")]
