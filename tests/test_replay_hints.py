"""The replay honours retention hints in trace time, and ``--explain`` splits the misses.

On an agent-like trace (sessions whose context grows each turn, tool pauses that evict it
under LRU) the hints raise the hit rate and never lower it; hints that are never given
change nothing, on the agent trace with its hints removed and on the Mooncake trace.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvoffload.bench.tracegen import generate_agent, write_trace
from kvoffload.cli import cli
from kvoffload.replay import MissSplit, Trace, load_trace, replay_pool, run_replay

CAPACITIES = [300, 600, 1200, 2400]


@pytest.fixture(scope="module")
def agent_trace(tmp_path_factory: pytest.TempPathFactory) -> Trace:
    agent = generate_agent(1500, seed=1)
    path = tmp_path_factory.mktemp("agent") / "agent.jsonl"
    write_trace(path, agent.requests, agent=agent)
    return load_trace(path)


def test_the_agent_trace_has_sessions_pauses_growing_contexts_and_hints(
    agent_trace: Trace,
) -> None:
    hints = agent_trace.hints
    assert len(hints) == len(agent_trace.requests)
    stamps = [h[0] for h in hints]
    assert stamps == sorted(stamps)
    by_session: dict[str, list[int]] = {}
    for i, (_, session, _) in enumerate(hints):
        if session is not None:
            by_session.setdefault(session, []).append(i)
    assert len(by_session) > 50
    # A session's last turn keeps nothing (sessions cut off by the trace's end aside).
    assert sum(hints[t[-1]][2] is None for t in by_session.values()) > 10
    for turns in by_session.values():
        for a, b in itertools.pairwise(turns):  # each turn extends the last
            prev, nxt = agent_trace.requests[a], agent_trace.requests[b]
            assert len(nxt) > len(prev)
            assert nxt[: len(prev)] == prev
            assert hints[a][2] is not None  # a turn followed by another gives a hint
            assert hints[b][0] - hints[a][0] > 1.0  # a tool pause between them


def test_hints_raise_the_hit_rate_where_pauses_evict_and_never_lower_it(
    agent_trace: Trace,
) -> None:
    report = run_replay(agent_trace, CAPACITIES, ["lru"])
    gains = []
    for row in report.rows:
        (plain,), (hinted,) = row.results, row.hinted
        assert not plain.hinted
        assert hinted.hinted
        assert hinted.hit_rate >= plain.hit_rate, row.capacity
        gains.append(hinted.hit_rate - plain.hit_rate)
    assert max(gains) > 0.01  # pauses evicted conversations at these capacities


def test_hints_never_given_change_nothing(agent_trace: Trace) -> None:
    unhinted = tuple((t, s, None) for t, s, _ in agent_trace.hints)
    for capacity in CAPACITIES[:2]:
        plain = replay_pool(agent_trace, capacity, "lru", explain=True)
        none_given = replay_pool(agent_trace, capacity, "lru", hints=unhinted, explain=True)
        assert replace(none_given, hinted=False) == plain


def test_explain_splits_every_miss_once(agent_trace: Trace) -> None:
    total = agent_trace.num_blocks
    unique = agent_trace.num_unique
    report = run_replay(agent_trace, CAPACITIES[:2], ["lru", "arc"], explain=True)
    for row in report.rows:
        for r in (*row.results, *row.hinted):
            assert isinstance(r.misses, MissSplit)
            assert r.misses.cold == unique  # every block's first use, and only that
            assert r.misses.cold + r.misses.capacity + r.misses.other == total - r.hit_blocks
    small, large = (row.results[0].misses for row in report.rows)
    assert small is not None
    assert large is not None
    assert large.capacity < small.capacity  # a larger pool evicts less


@pytest.mark.trace
def test_on_the_mooncake_trace_hints_never_given_change_nothing(trace_path: Path) -> None:
    trace = load_trace(trace_path)
    assert trace.hints == ()  # the trace gives none: one replay per policy, as before
    keys_trace = Trace(trace.path, trace.requests[:4000])
    unhinted = tuple((i * 0.1, f"s{i % 7}", None) for i in range(len(keys_trace.requests)))
    for capacity in (1000, 6000):
        plain = replay_pool(keys_trace, capacity, "lru")
        none_given = replay_pool(keys_trace, capacity, "lru", hints=unhinted)
        assert replace(none_given, hinted=False) == plain
    report = run_replay(keys_trace, [1000], ["lru"])
    assert report.rows[0].hinted == ()


def test_the_cli_writes_an_agent_trace_and_replays_it_with_explain(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    runner = CliRunner()
    out = tmp_path / "agent.jsonl"
    made = runner.invoke(cli, ["synth-trace", "agent", str(out), "--requests", "300"])
    assert made.exit_code == 0, made.output
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert any({"timestamp", "hash_ids", "session", "retain_for_s"} <= set(x) for x in lines)
    plot = tmp_path / "hits.png"
    args = ["replay", str(out), "--capacity", "200,800", "--policy", "lru", "--explain"]
    result = runner.invoke(cli, [*args, "--plot", str(plot)])
    assert result.exit_code == 0, result.output
    assert "without and with retention hints" in result.output
    assert "missed blocks by cause" in result.output
    assert plot.is_file()
    assert (tmp_path / "hits-misses.png").is_file()
    data = json.loads(runner.invoke(cli, [*args, "--json", "-"]).output)
    row = data["rows"][0]
    assert row["hinted"][0]["hinted"] is True
    assert set(row["results"][0]["misses"]) == {"cold", "capacity", "other"}
