"""Trace replay: the Belady bound against brute force, the ceiling, the pool replay, JSON."""

from __future__ import annotations

import functools
import itertools
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffload.bench import pool as bench
from kvoffload.bench.trace import TraceFormatError
from kvoffload.hashing import BlockHash
from kvoffload.pool.block_pool import CpuBlockPool
from kvoffload.pool.policies import POLICY_NAMES
from kvoffload.replay import (
    REPLAY_SCHEMA_VERSION,
    Trace,
    ceiling_hits,
    load_trace,
    optimal_hits,
    replay_pool,
    run_replay,
    smallest_capacity,
    static_frequency_hits,
    useful_capacity,
)


def brute_force_block_hits(accesses: tuple[int, ...], capacity: int) -> int:
    """The most hits any eviction choice gets (bypass allowed), by exhaustive search."""

    @functools.cache
    def best(i: int, cache: frozenset[int]) -> int:
        if i == len(accesses):
            return 0
        b = accesses[i]
        if b in cache:
            return 1 + best(i + 1, cache)
        options = [best(i + 1, cache)]  # do not cache it
        if len(cache) < capacity:
            options.append(best(i + 1, cache | {b}))
        else:
            options.extend(best(i + 1, (cache - {v}) | {b}) for v in cache)
        return max(options)

    return best(0, frozenset())


@settings(max_examples=150, deadline=None)
@given(
    accesses=st.lists(st.integers(0, 5), max_size=14).map(tuple),
    capacity=st.integers(0, 4),
)
def test_belady_is_optimal_on_single_block_requests(
    accesses: tuple[int, ...], capacity: int
) -> None:
    requests = [(b,) for b in accesses]
    assert optimal_hits(requests, capacity) == brute_force_block_hits(accesses, capacity)


def brute_force_prefix_hits(requests: list[tuple[int, ...]], capacity: int) -> int:
    """Best prefix hits over every choice of what to keep after each request."""

    @functools.cache
    def best(i: int, cache: frozenset[int]) -> int:
        if i == len(requests):
            return 0
        req = requests[i]
        hits = 0
        for b in req:
            if b not in cache:
                break
            hits += 1
        pool = sorted(cache | set(req))
        keep = min(capacity, len(pool))
        return hits + max(best(i + 1, frozenset(c)) for c in itertools.combinations(pool, keep))

    return best(0, frozenset())


@settings(max_examples=60, deadline=None)
@given(
    requests=st.lists(
        st.lists(st.integers(0, 5), min_size=1, max_size=3, unique=True).map(tuple), max_size=6
    ),
    capacity=st.integers(1, 3),
)
def test_belady_and_pool_replays_never_beat_the_prefix_optimum(
    requests: list[tuple[int, ...]], capacity: int
) -> None:
    opt = brute_force_prefix_hits(requests, capacity)
    assert optimal_hits(requests, capacity) <= opt
    trace = Trace("", tuple(requests))
    for name in POLICY_NAMES:
        assert replay_pool(trace, capacity, name).hit_blocks <= opt
    assert ceiling_hits(requests) >= opt
    assert static_frequency_hits(requests, capacity) <= opt


def test_ceiling_counts_leading_blocks_seen_before() -> None:
    assert ceiling_hits([(1, 2, 3), (1, 2, 4), (5, 2), (1, 2, 4, 5)]) == 2 + 0 + 4


def test_belady_with_unlimited_capacity_is_the_ceiling() -> None:
    requests = [(1, 2, 3), (1, 2, 4), (5, 2), (1, 2, 4, 5), (3,)]
    assert optimal_hits(requests, 100) == ceiling_hits(requests)
    assert optimal_hits(requests, 0) == 0
    with pytest.raises(ValueError, match="capacity"):
        optimal_hits(requests, -1)


def test_static_frequency_keeps_the_most_used_blocks_forever() -> None:
    # Uses: 2 four times, 1 three times, 3, 4 and 5 twice each (first seen in that order).
    requests = [(1, 2, 3), (1, 2, 4), (5, 2), (1, 2, 4, 5), (3,)]
    assert [static_frequency_hits(requests, c) for c in range(6)] == [0, 0, 4, 5, 6, 7]
    assert static_frequency_hits(requests, 5) == ceiling_hits(requests)
    with pytest.raises(ValueError, match="capacity"):
        static_frequency_hits(requests, -1)


@settings(max_examples=60, deadline=None)
@given(
    requests=st.lists(
        st.lists(st.integers(0, 9), min_size=1, max_size=4, unique=True).map(tuple), max_size=8
    )
)
def test_static_frequency_grows_with_capacity_up_to_the_ceiling(
    requests: list[tuple[int, ...]],
) -> None:
    hits = [static_frequency_hits(requests, c) for c in range(11)]
    assert hits == sorted(hits)
    assert hits[-1] == ceiling_hits(requests)


@pytest.mark.parametrize("capacity", [3, 5, 50])
def test_lru_replay_matches_the_pool_benchmark(capacity: int) -> None:
    requests = [(0, 1, 2), (0, 1, 3), (0, 1, 2, 4), (9,), (0, 1, 2), (7, 8), (0, 1, 3, 5)]
    keys = [[BlockHash(h.to_bytes(16, "little", signed=True)) for h in r] for r in requests]
    expected = bench.replay(CpuBlockPool(capacity), keys)
    got = replay_pool(Trace("", tuple(requests)), capacity, "lru")
    assert got.hit_blocks == expected.hit_blocks


def test_admission_refuses_first_offers() -> None:
    trace = Trace("", ((1, 2), (1, 2), (1, 2), (3,)))
    always = replay_pool(trace, 10, "lru", "always")
    twice = replay_pool(trace, 10, "lru", "seen_twice")
    assert (always.hit_blocks, always.refused_blocks) == (4, 0)
    # first offer refused, second stored, third hits
    assert (twice.hit_blocks, twice.refused_blocks, twice.stored_blocks) == (2, 3, 2)


def write_trace(path: Path, requests: list[list[int]]) -> Path:
    lines = [
        json.dumps(
            {"timestamp": i, "input_length": 512 * len(r), "output_length": 1, "hash_ids": r}
        )
        for i, r in enumerate(requests)
    ]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_report_json_schema(tmp_path: Path) -> None:
    trace = load_trace(write_trace(tmp_path / "t.jsonl", [[0, 1, 2], [0, 1, 3], [0, 1, 2, 4]]))
    data = run_replay(trace, [2, 8], ["lru", "arc"], "always").to_json()
    json.dumps(data)  # serialisable
    assert data["schema_version"] == REPLAY_SCHEMA_VERSION
    assert set(data) == {
        "schema_version",
        "trace",
        "requests",
        "blocks",
        "useful_capacity",
        "unique_blocks",
        "admission",
        "ceiling_hit_rate",
        "rows",
    }
    assert (data["requests"], data["blocks"], data["unique_blocks"]) == (3, 10, 5)
    assert data["ceiling_hit_rate"] == pytest.approx(5 / 10)
    assert [row["capacity"] for row in data["rows"]] == [2, 8]
    for row in data["rows"]:
        assert set(row) == {
            "capacity",
            "results",
            "optimal_hit_rate",
            "best_static_policy",
            "best_static_hit_rate",
            "pool_blocks",
            "hinted",
        }
        assert not row["hinted"]  # the trace gives no retention hint
        best = max(row["results"], key=lambda r: r["hit_rate"])
        assert (row["best_static_policy"], row["best_static_hit_rate"]) == (
            best["policy"],
            best["hit_rate"],
        )
        assert [r["policy"] for r in row["results"]] == ["lru", "arc"]
        for r in row["results"]:
            assert set(r) == {
                "policy",
                "hit_blocks",
                "hit_rate",
                "stored_blocks",
                "refused_blocks",
                "evictions",
                "by_priority",
                "misses",
                "hinted",
            }
            assert (r["misses"], r["hinted"]) == (None, False)
            assert [p["priority"] for p in r["by_priority"]] == [0]
            assert 0 <= r["hit_rate"] <= row["optimal_hit_rate"] + 1e-12 or row["capacity"] == 2
    assert data["rows"][1]["optimal_hit_rate"] == pytest.approx(0.5)


def test_smallest_capacity_reaches_the_target() -> None:
    trace = Trace("", tuple((0, 1, 2, i + 10) for i in range(6)) + ((0, 1, 2),))
    capacity, rate, ceiling = smallest_capacity(trace, 1.0, "lru")
    assert rate == pytest.approx(ceiling)
    assert capacity == 3  # the shared prefix; the blocks behind it are skipped, not needed
    assert replay_pool(trace, capacity - 1, "lru").hit_rate < ceiling
    with pytest.raises(ValueError, match="target"):
        smallest_capacity(trace, 0.0)


def test_load_trace_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nope"):
        load_trace(tmp_path / "nope.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        '{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [1]}\n{"x": 1}\n'
    )
    with pytest.raises(ValueError, match=r"bad.jsonl:2"):
        load_trace(bad)


READMES = {1000: (0.084, 0.263), 6000: (0.312, 0.550), 20000: (0.572, 0.640)}


@pytest.mark.trace
def test_synthetic_trace_matches_the_readme_table(trace_path: Path) -> None:
    trace = load_trace(trace_path)
    report = run_replay(trace, list(READMES), POLICY_NAMES)
    assert report.ceiling_hit_rate == pytest.approx(0.640, abs=0.005)
    for row in report.rows:
        lru_ref, opt_ref = READMES[row.capacity]
        rates = {r.policy: r.hit_rate for r in row.results}
        assert rates["lru"] == pytest.approx(lru_ref, abs=0.005)
        assert row.optimal_hit_rate == pytest.approx(opt_ref, abs=0.01)
        for name, rate in rates.items():
            assert rate >= rates["lru"] - 0.01, (row.capacity, name, rate)
            assert rate <= row.optimal_hit_rate + 0.02, (row.capacity, name, rate)


def test_a_pool_beyond_useful_capacity_gives_the_same_result_and_is_not_built() -> None:
    # A gap in a prefix (3 found, 1 not) allocates a cached block again: a pool of the
    # distinct blocks alone would evict where a larger one does not.
    requests = ((5,), (3,), (1, 3), (5,))
    trace = Trace("", requests)
    assert useful_capacity(requests) == 3 + 2
    for name in ("lru", "arc"):
        big = replay_pool(trace, 10**8, name)  # would take minutes and GiBs if built
        assert big == replay_pool(trace, useful_capacity(requests), name)
        assert big.evictions == 0


def test_an_empty_trace_and_a_bad_id_are_refused() -> None:
    with pytest.raises(ValueError, match="no blocks"):
        run_replay(Trace("e.jsonl", ((),)), [4])
    with pytest.raises(ValueError, match=r"block id 170141183460469231731687303715884105728"):
        replay_pool(Trace("t", ((2**127,),)), 4)


def test_replay_reports_hits_per_priority_as_tallied(tmp_path: Path) -> None:
    lines = [
        {"hash_ids": [1, 2], "priority": 1},
        {"hash_ids": [3, 4, 5]},
        {"hash_ids": [1, 2, 6], "priority": 0},
        {"hash_ids": [3, 4, 7], "priority": 2},
    ]
    path = tmp_path / "p.jsonl"
    path.write_text(
        "".join(
            json.dumps({"timestamp": i, "input_length": 1, "output_length": 1, **rec}) + "\n"
            for i, rec in enumerate(lines)
        )
    )
    trace = load_trace(path)
    assert trace.priorities == (1, 0, 0, 2)
    # Tally by hand with an infinite pool: a block hits once seen (leading run only).
    seen: set[int] = set()
    tally: dict[int, list[int]] = {}
    for rec in lines:
        run = 0
        for b in rec["hash_ids"]:
            if b not in seen:
                break
            run += 1
        seen.update(rec["hash_ids"])
        row = tally.setdefault(rec.get("priority", 0), [0, 0])
        row[0] += len(rec["hash_ids"])
        row[1] += run
    result = replay_pool(trace, 100)
    got = {p.priority: (p.blocks, p.hit_blocks) for p in result.by_priority}
    assert got == {p: (b, x) for p, (b, x) in tally.items()}
    assert got == {0: (6, 2), 1: (2, 0), 2: (3, 2)}


def test_priorities_keep_a_system_prompt_under_lru() -> None:
    system = (1, 2, 3)
    requests: list[tuple[int, ...]] = [system]
    priorities = [1]
    for i in range(3):  # two one-off scans of 3 blocks, then the system prompt again
        requests += [(100 + 10 * i, 101 + 10 * i, 102 + 10 * i)]
        requests += [(200 + 10 * i, 201 + 10 * i, 202 + 10 * i), system]
        priorities += [0, 0, 0]
    plain = replay_pool(Trace("", tuple(requests)), 6)
    ranked = replay_pool(Trace("", tuple(requests), tuple(priorities)), 6)
    assert plain.hit_blocks == 0  # under LRU the second scan evicts the prompt each time
    assert ranked.hit_blocks == 9  # with priority 1 it stays: 3 hits at each of 3 reuses


@pytest.mark.parametrize("bad", ["1", -1, 1.0, True, 1 << 17, None])
def test_a_bad_priority_names_the_line_and_field(tmp_path: Path, bad: object) -> None:
    path = tmp_path / "bad.jsonl"
    good = {"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [1]}
    path.write_text(json.dumps(good) + "\n" + json.dumps({**good, "priority": bad}) + "\n")
    with pytest.raises(TraceFormatError, match=r"bad\.jsonl:2: field 'priority': expected"):
        load_trace(path)
