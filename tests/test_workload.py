from __future__ import annotations

import itertools
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from types import ModuleType

import pytest
from example_loader import load_example

from kvoffload.bench.workload import WorkloadRequest, WorkloadSpec, generate_workload
from kvoffload.hashing import HashNamespace, hash_prompt

SMALL = WorkloadSpec(
    num_sessions=12,
    turns=(2, 4),
    num_system_prompts=3,
    system_prompt_tokens=64,
    user_tokens=(4, 20),
    answer_tokens=(4, 30),
    max_active_sessions=4,
    seed=7,
)


def by_session(requests: list[WorkloadRequest]) -> dict[int, list[WorkloadRequest]]:
    sessions: dict[int, list[WorkloadRequest]] = defaultdict(list)
    for r in requests:
        sessions[r.session_id].append(r)
    return sessions


def test_same_seed_same_workload() -> None:
    a = list(generate_workload(SMALL, block_size=8))
    b = list(generate_workload(SMALL, block_size=8))
    assert a == b
    other = WorkloadSpec(**{**_fields(SMALL), "seed": 8})
    c = list(generate_workload(other, block_size=8))
    assert [r.token_ids for r in c] != [r.token_ids for r in a]


def _fields(spec: WorkloadSpec) -> dict[str, object]:
    return {name: getattr(spec, name) for name in spec.__dataclass_fields__}


def test_same_seed_same_hashes_in_another_process() -> None:
    code = (
        "from kvoffload.bench.workload import WorkloadSpec, generate_workload\n"
        "spec = WorkloadSpec(num_sessions=5, system_prompt_tokens=32, seed=3)\n"
        "print(generate_workload(spec, block_size=16).__next__().block_hashes[-1].hex())\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
        env={"PYTHONHASHSEED": "123", "PATH": ""},
    ).stdout.strip()
    spec = WorkloadSpec(num_sessions=5, system_prompt_tokens=32, seed=3)
    first = next(generate_workload(spec, block_size=16))
    assert out == first.block_hashes[-1].hex()


def test_every_session_runs_its_turns_in_order() -> None:
    requests = list(generate_workload(SMALL))
    sessions = by_session(requests)
    assert sorted(sessions) == list(range(12))
    for turns in sessions.values():
        assert [r.turn for r in turns] == list(range(len(turns)))
        assert 2 <= len(turns) <= 4
        assert len({r.system_prompt_id for r in turns}) == 1


def test_prompts_grow_by_answer_and_user_message() -> None:
    sessions = by_session(list(generate_workload(SMALL)))
    for turns in sessions.values():
        for prev, cur in itertools.pairwise(turns):
            assert cur.token_ids[: len(prev.token_ids)] == prev.token_ids
            grown = len(cur.token_ids) - len(prev.token_ids)
            assert grown >= prev.output_length + SMALL.user_tokens[0]
            assert grown <= prev.output_length + SMALL.user_tokens[1]


def test_sessions_share_system_prompts() -> None:
    requests = list(generate_workload(SMALL))
    first_turns = [r for r in requests if r.turn == 0]
    by_prompt: dict[int, set[tuple[int, ...]]] = defaultdict(set)
    for r in first_turns:
        by_prompt[r.system_prompt_id].add(r.token_ids[: SMALL.system_prompt_tokens])
    assert set(by_prompt) <= {0, 1, 2}
    assert any(len([r for r in first_turns if r.system_prompt_id == p]) > 1 for p in by_prompt)
    for prefixes in by_prompt.values():
        assert len(prefixes) == 1  # one system prompt, shared verbatim
    assert len({next(iter(p)) for p in by_prompt.values()}) == len(by_prompt)


def test_sessions_interleave() -> None:
    order = [r.session_id for r in generate_workload(SMALL)]
    switches = sum(1 for a, b in itertools.pairwise(order) if a != b)
    assert switches > len(set(order))  # not one session after another
    # never more than max_active_sessions open at once
    first = {s: order.index(s) for s in set(order)}
    last = {s: len(order) - 1 - order[::-1].index(s) for s in set(order)}
    for i in range(len(order)):
        assert sum(1 for s in first if first[s] <= i <= last[s]) <= SMALL.max_active_sessions


def test_token_ids_in_vocabulary() -> None:
    spec = WorkloadSpec(num_sessions=3, vocab_size=50, system_prompt_tokens=10, seed=1)
    for r in generate_workload(spec):
        assert all(0 <= t < 50 for t in r.token_ids)


@pytest.mark.parametrize("block_size", [1, 7, 16])
def test_block_hashes_equal_hash_prompt(block_size: int) -> None:
    ns = HashNamespace(model_id="m", dtype="bfloat16", salt="x")
    for r in generate_workload(SMALL, block_size=block_size, namespace=ns):
        assert list(r.block_hashes) == hash_prompt(r.token_ids, block_size, ns)
        assert len(r.block_hashes) == len(r.token_ids) // block_size


def test_no_hashes_without_block_size() -> None:
    assert all(r.block_hashes == () for r in generate_workload(SMALL))


def test_system_prompts_share_block_hashes_across_sessions() -> None:
    requests = list(generate_workload(SMALL, block_size=16))
    shared_blocks = SMALL.system_prompt_tokens // 16
    heads: dict[int, set[tuple[bytes, ...]]] = defaultdict(set)
    for r in requests:
        heads[r.system_prompt_id].add(tuple(r.block_hashes[:shared_blocks]))
    assert all(len(h) == 1 for h in heads.values())


def test_request_record_is_slotted() -> None:
    r = next(generate_workload(SMALL))
    assert not hasattr(r, "__dict__")


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("num_sessions", 0),
        ("num_system_prompts", 0),
        ("max_active_sessions", 0),
        ("vocab_size", 0),
        ("system_prompt_tokens", -1),
        ("turns", (0, 2)),
        ("turns", (3, 2)),
        ("user_tokens", (0, 4)),
        ("answer_tokens", (-1, 4)),
    ],
)
def test_bad_spec(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        WorkloadSpec(**{field: value})  # type: ignore[arg-type]


def test_bad_block_size() -> None:
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        next(generate_workload(SMALL, block_size=0))


# -- the example ---------------------------------------------------------------------------


def _example() -> ModuleType:
    return load_example("multiturn_replay")


def _hit_rate(out: str) -> float:
    match = re.search(r"^hit rate: (\d\.\d{4})$", out, re.MULTILINE)
    assert match, out
    return float(match.group(1))


def test_example_prints_a_sane_hit_rate(capsys: pytest.CaptureFixture[str]) -> None:
    example = _example()
    assert example.main(["--sessions", "20", "--capacity", "300", "--no-progress"]) == 0
    out = capsys.readouterr().out
    rate = _hit_rate(out)
    assert 0.05 < rate < 0.95
    assert re.search(r"^tokens not recomputed: [\d,]+ of [\d,]+ prompt tokens", out, re.M)
    # more capacity never lowers an LRU prefix hit rate here, and a huge pool hits the most
    assert example.main(["--sessions", "20", "--capacity", "100000", "--no-progress"]) == 0
    assert _hit_rate(capsys.readouterr().out) >= rate


def test_example_tiny_pool_hits_little(capsys: pytest.CaptureFixture[str]) -> None:
    example = _example()
    assert example.main(["--sessions", "20", "--capacity", "1", "--no-progress"]) == 0
    assert _hit_rate(capsys.readouterr().out) < 0.05


def test_example_replays_a_trace_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        '{"timestamp": 0, "input_length": 1100, "output_length": 1, "hash_ids": [0, 1, 2]}\n'
        '{"timestamp": 5, "input_length": 1100, "output_length": 1, "hash_ids": [0, 1, 3]}\n',
        encoding="utf-8",
    )
    example = _example()
    assert example.main(["--trace", str(trace), "--capacity", "10", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert _hit_rate(out) == round(2 / 6, 4)
    assert "tokens not recomputed: 1,024 of 2,200 prompt tokens" in out


def test_example_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    example = _example()
    png = tmp_path / "rate.png"
    argv = ["--sessions", "10", "--plot", str(png), "--capacities", "50,500", "--no-progress"]
    assert example.main(argv) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"plot: {png}" in capsys.readouterr().out


def test_example_missing_trace_file(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as info:
        _example().main(["--trace", str(tmp_path / "absent.jsonl")])
    assert info.value.code == 2


@pytest.mark.trace
def test_example_on_the_synthetic_trace(
    trace_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    example = _example()
    assert example.main(["--trace", str(trace_path), "--capacity", "6000", "--no-progress"]) == 0
    assert abs(_hit_rate(capsys.readouterr().out) - 0.312) <= 0.005
