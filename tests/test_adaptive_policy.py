"""The adaptive policy: registry, shadows, the pool's lookup hook, its target and its memory."""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Sequence
from pathlib import Path

import pytest

from kvoffload.bench.tracegen import generate, write_trace
from kvoffload.config import OffloadConfig
from kvoffload.errors import InvariantError
from kvoffload.hashing import BlockHash
from kvoffload.pool.block_pool import CpuBlockPool
from kvoffload.pool.free_queue import CpuBlock, LruFreeQueue
from kvoffload.pool.policies import (
    POLICY_NAMES,
    STATIC_POLICY_NAMES,
    AdaptivePolicy,
    make_policy,
)
from kvoffload.pool.policies.adaptive import DEFAULT_EXPERTS, ShadowPool
from kvoffload.replay import Trace, load_trace, replay_pool, run_replay


def h(i: int) -> BlockHash:
    return BlockHash(i.to_bytes(8, "little", signed=True))


def keys_of(requests: Sequence[Sequence[int]]) -> list[list[BlockHash]]:
    return [[h(b) for b in r] for r in requests]


def replay(pool: CpuBlockPool, requests: Sequence[Sequence[BlockHash]]) -> int:
    """`replay_pool`'s loop over a given pool; returns the prefix hits."""
    hits = 0
    for keys in requests:
        found = pool.lookup(keys)
        hits += len(found)
        pool.touch(found)
        missing = keys[len(found) :]
        new = pool.allocate(min(len(missing), pool.num_free))
        for block, key in zip(new, missing, strict=False):
            pool.publish(block, key)
        held = found + new
        held.reverse()
        pool.free(held)
    return hits


def test_registered_and_configurable() -> None:
    assert "adaptive" in POLICY_NAMES
    assert "adaptive" not in STATIC_POLICY_NAMES
    assert set(STATIC_POLICY_NAMES) == set(POLICY_NAMES) - {"adaptive"}
    policy = make_policy("Adaptive")
    assert isinstance(policy, AdaptivePolicy)
    assert policy.name == "adaptive"
    assert policy.experts == DEFAULT_EXPERTS
    config = OffloadConfig(num_cpu_blocks=64, eviction_policy="adaptive")
    assert config.eviction_policy == "adaptive"
    pool = CpuBlockPool(64, policy=config.eviction_policy)
    assert isinstance(pool.policy, AdaptivePolicy)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"experts": ()}, "at least one expert"),
        ({"experts": ("lru", "LRU")}, "named twice"),
        ({"experts": ("lru", "adaptive")}, "unknown expert 'adaptive'"),
        ({"experts": ("lru", "fifo")}, "unknown expert 'fifo'"),
        ({"window": 0}, "window must be > 0"),
        ({"margin": 1.0}, r"margin must be in \[0, 1\)"),
        ({"margin": -0.1}, r"margin must be in \[0, 1\)"),
        ({"confidence": -1.0}, "confidence must be finite and >= 0"),
        ({"confidence": float("inf")}, "confidence must be finite and >= 0"),
        ({"temperature": 0.0}, "temperature must be finite and > 0"),
        ({"temperature": float("inf")}, "temperature must be finite and > 0"),
    ],
)
def test_arguments_are_checked(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        AdaptivePolicy(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("shape", ["chat", "scan"])
def test_each_shadow_has_exactly_its_static_policys_hits(shape: str) -> None:
    """A shadow pool sees the trace the real pool sees, so it is that expert, replayed."""
    requests = keys_of(generate(shape, 600))
    policy = AdaptivePolicy()
    pool = CpuBlockPool(400, policy=policy)
    real = replay(pool, requests)
    pool.check_invariants()
    stats = policy.statistics()
    static = {name: replay_pool(requests, 400, name).hit_blocks for name in policy.experts}
    assert stats.shadow_hits == static
    assert real == replay_pool(requests, 400, "adaptive").hit_blocks


def test_leader_follows_the_workload_and_the_pool_keeps_what_it_would() -> None:
    """Under a scan, LRU's shadow keeps nothing of the hot set; a scan-resistant one
    takes the lead and the real pool then serves the hot set as that expert would."""
    requests = keys_of(generate("scan", 1500))
    policy = AdaptivePolicy(experts=("lru", "s3fifo", "arc", "prefix-freq"))
    pool = CpuBlockPool(1000, policy=policy)
    hits = replay(pool, requests)
    stats = policy.statistics()
    assert stats.leader in {"s3fifo", "arc"}
    assert stats.switches >= 1
    assert stats.shadow_hits["lru"] < 0.5 * stats.shadow_hits[stats.leader]
    assert hits > 0.9 * stats.shadow_hits[stats.leader]
    assert hits > 2 * stats.shadow_hits["lru"]


def test_with_no_evidence_the_pool_follows_the_leader_not_the_majority() -> None:
    """Until an expert hits what another does not, the pool holds the leader's blocks.

    On a cycle larger than the pool, LRU, ARC and ``prefix-freq`` hold the same recent
    blocks and never hit; only S3-FIFO keeps part of the cycle. Summed weights (all 1
    before any hit) would keep the three's blocks and evict S3-FIFO's, so S3-FIFO's
    first cycle of hits would be lost (0.0066 of the trace at 8,000 blocks).
    """
    requests = keys_of(generate("loop", 4000))
    assert DEFAULT_EXPERTS[0] == "s3fifo"  # the scan-resistant expert leads at the start
    policy = AdaptivePolicy(experts=("s3fifo", "lru", "arc", "prefix-freq"))
    pool = CpuBlockPool(8000, policy=policy)
    hits = replay(pool, requests)
    stats = policy.statistics()
    assert stats.shadow_hits["lru"] == stats.shadow_hits["arc"] == 0
    assert hits >= stats.shadow_hits["s3fifo"] - 0.001 * sum(map(len, requests))


class _Recorder:
    """A policy with an ``on_lookup`` hook, LRU otherwise."""

    name = "recorder"

    def __init__(self) -> None:
        self.free: LruFreeQueue | None = None
        self.lookups: list[tuple[list[BlockHash], int]] = []

    def attach(self, blocks: Sequence[CpuBlock], free: LruFreeQueue) -> None:
        self.free = free

    def on_touch(self, block: CpuBlock) -> None:
        pass

    def on_free(self, blocks: Sequence[CpuBlock]) -> None:
        pass

    def on_lookup(self, block_hashes: Sequence[BlockHash], hits: int) -> None:
        self.lookups.append((list(block_hashes), hits))

    def victims(self, n: int, protect: Collection[CpuBlock]) -> list[CpuBlock]:
        assert self.free is not None
        return [b for b in self.free if b not in protect][:n]

    def check(self) -> None:
        pass


def test_pool_tells_a_policy_with_a_lookup_hook_what_was_looked_up() -> None:
    policy = _Recorder()
    pool = CpuBlockPool(4, policy=policy)
    (block,) = pool.allocate(1)
    pool.publish(block, h(1))
    pool.free([block])
    hits = pool.lookup(iter([h(1), h(2), h(1)]))  # any iterable, read once
    assert hits == [block]
    assert policy.lookups == [([h(1), h(2), h(1)], 1)]
    assert pool.statistics().lookups == 1
    assert pool.statistics().hit_blocks == 1


def test_policies_without_the_hook_are_not_called_for_lookups() -> None:
    for name in STATIC_POLICY_NAMES:
        pool = CpuBlockPool(4, policy=name)
        assert pool._on_lookup is None
    assert CpuBlockPool(4, policy="adaptive")._on_lookup is not None


def test_a_repeated_lookup_is_replayed_once() -> None:
    """A request that asks again before anything was freed is not a second use."""
    policy = AdaptivePolicy(experts=("lru",))
    pool = CpuBlockPool(8, policy=policy)
    keys = [h(1), h(2)]
    replay(pool, [keys])
    pool.lookup(keys)
    pool.lookup(keys)
    assert policy.statistics().shadow_hits == {"lru": 2}
    replay(pool, [keys])  # the same request, still: its lookup is not a new use
    assert policy.statistics().shadow_hits == {"lru": 2}
    replay(pool, [[h(3)], keys])  # a free came between: a new use
    assert policy.statistics().shadow_hits == {"lru": 4}


def test_never_chooses_a_held_or_protected_block() -> None:
    policy = AdaptivePolicy()
    pool = CpuBlockPool(16, policy=policy)
    replay(pool, keys_of(generate("scan", 50)))
    held = pool.lookup([]) or [pool.block(i) for i in range(4)]
    pool.touch(held)
    protect = [pool.block(i) for i in range(4, 8)]
    got = pool.allocate(8, protect=protect)
    assert not {b.block_id for b in got} & set(range(8))
    pool.free(got + held)
    pool.check_invariants()


def test_check_reports_a_broken_bound() -> None:
    policy = AdaptivePolicy()
    pool = CpuBlockPool(8, policy=policy)
    replay(pool, keys_of(generate("chat", 30)))
    pool.check_invariants()
    policy._where.update((h(10**6 + i), 0) for i in range(10_000))
    with pytest.raises(InvariantError, match="exceed the bound"):
        policy.check()


def test_check_reports_a_block_in_the_wrong_bucket() -> None:
    policy = AdaptivePolicy()
    pool = CpuBlockPool(8, policy=policy)
    replay(pool, keys_of(generate("chat", 30)))
    pool.check_invariants()
    m, bucket = next((m, b) for m, b in enumerate(policy._buckets) if b)
    block_id = next(iter(bucket))
    policy._mask_of[block_id] = m ^ 1
    with pytest.raises(InvariantError, match=f"block {block_id} in bucket {m} is recorded"):
        policy.check()


def test_weights_fall_with_the_distance_to_the_best_in_standard_deviations() -> None:
    policy = AdaptivePolicy(experts=("lru", "s3fifo", "arc"))
    policy._scores = [100.0, 80.0, 100.0]
    policy._squares = [1000.0, 640.0, 1000.0]  # hits in runs of 10 and 8 blocks
    lru, s3fifo, arc = policy.weights()
    assert lru == arc == 1.0
    assert s3fifo == pytest.approx(math.erfc(20 / (math.sqrt(2.0) * math.sqrt(1641.0))))
    policy._squares = [100.0, 80.0, 100.0]  # the same hits one block at a time: less noise
    assert policy.weights()[1] < s3fifo / 2
    policy._scores = [10_000.0, 8_000.0, 10_000.0]  # the same runs, 100 times the evidence
    policy._squares = [100_000.0, 64_000.0, 100_000.0]
    assert policy.weights()[1] < s3fifo**9
    assert policy.statistics().weights == dict(zip(policy.experts, policy.weights(), strict=True))
    softer = AdaptivePolicy(experts=("lru", "s3fifo", "arc"), temperature=2.0)
    softer._scores, softer._squares = policy._scores, policy._squares
    z = 2_000 / math.sqrt(164_001.0)
    assert softer.weights()[1] == pytest.approx(math.erfc(z / (2.0 * math.sqrt(2.0))))
    policy._scores = [50.0, 50.0, 50.0]  # no evidence: the leader (the first) votes alone
    assert policy.weights() == [1.0, 0.0, 0.0]


def _worth(block: CpuBlock, weights: Sequence[float], shadows: Sequence[ShadowPool]) -> float:
    """The summed weight of the experts whose shadow holds the block's hash (-1: no hash)."""
    if block.block_hash is None:
        return -1.0
    held = [s.is_cached(block.block_hash) for s in shadows]
    return sum(x for x, yes in zip(weights, held, strict=True) if yes)


@pytest.mark.parametrize(("shape", "capacity"), [("chat", 300), ("scan", 400)])
def test_victims_are_the_free_blocks_the_least_weight_holds(shape: str, capacity: int) -> None:
    """At every allocation of a replay, each block the pool evicts is worth (the summed
    weight of the experts whose shadow holds its hash) no more than any free block it
    keeps; free blocks that hold nothing go first."""
    requests = keys_of(generate(shape, 300))
    policy = AdaptivePolicy()
    pool = CpuBlockPool(capacity, policy=policy)
    shadows = policy._shadows
    checked = 0
    for keys in requests:
        found = pool.lookup(keys)
        pool.touch(found)
        missing = keys[len(found) :]
        w = policy.weights()
        free = [b for b in (pool.block(i) for i in range(capacity)) if b.ref_cnt == 0]
        before = {b.block_id: _worth(b, w, shadows) for b in free}
        new = pool.allocate(min(len(missing), pool.num_free))
        taken = {b.block_id for b in new}
        if taken and len(taken) < len(free):
            kept = min(v for i, v in before.items() if i not in taken)
            assert max(before[i] for i in taken) <= kept + 1e-9
            checked += 1
        for block, key in zip(new, missing, strict=False):
            pool.publish(block, key)
        held = found + new
        held.reverse()
        pool.free(held)
    pool.check_invariants()
    assert checked > 50


@pytest.mark.parametrize(
    ("experts", "per_block", "extra"),
    [(DEFAULT_EXPERTS, 25, 64), (("lru", "s3fifo", "arc"), 17, 0)],
)
def test_metadata_stays_within_its_bound_after_a_long_scan(
    experts: Sequence[str], per_block: int, extra: int
) -> None:
    """A scan of 40 pools' worth of one-off blocks (with a small hot set reused) leaves
    the policy with no more metadata than its documented O(capacity) bound."""
    capacity = 300
    hot = [[h(10**9 + 100 * i + j) for j in range(20)] for i in range(5)]
    requests: list[list[BlockHash]] = []
    for q in range(600):
        requests.append(hot[q % 5] if q % 3 == 0 else [h(q * 1000 + j) for j in range(30)])
    policy = AdaptivePolicy(experts=experts)
    pool = CpuBlockPool(capacity, policy=policy)
    replay(pool, requests)
    pool.check_invariants()
    stats = policy.statistics()
    assert sum(len(r) for r in requests) > 40 * capacity
    assert policy.metadata_bound == per_block * capacity + extra
    # Every shadow is full (C records, C hashes); nothing grew with the 12,000 accesses.
    assert 2 * len(experts) * capacity <= stats.metadata_entries <= policy.metadata_bound
    assert len(policy._where) <= 2 * capacity
    assert sum(len(bucket) for bucket in policy._buckets) <= capacity


def test_a_run_of_hits_keeps_a_frequency_experts_heap_in_bound() -> None:
    """``prefix-freq`` compacts its heap only when it evicts; in a shadow that only hits,
    the adaptive policy compacts it, so the bound holds (it grew by 50 a request)."""
    policy = AdaptivePolicy(experts=("lru", "prefix-freq"))
    pool = CpuBlockPool(100, policy=policy)
    keys = [h(i) for i in range(50)]
    replay(pool, [keys] * 1000)
    pool.check_invariants()
    assert policy.statistics().shadow_hits == {"lru": 999 * 50, "prefix-freq": 999 * 50}
    assert policy.metadata_entries() <= policy.metadata_bound == (2 + 2 + 6 + 5) * 100 + 64


# The target (issue 20): within 0.005 of the best static policy and never more than 0.005
# below LRU, hit rates only. The whole grid (every shape, 14 capacities from 500 to 40,000
# blocks) takes minutes: `scripts/adaptive_grid.py` runs it and docs/policies.md records it.
# Here, within CI time, one or two cells of each regime of the grid: where ARC is best
# (chat at 1,000), where `prefix-freq` is (chat at 15,000, which following a single leader
# missed), where S3-FIFO is by far (rag at 500 and 6,000, scan at 1,000), where the static
# policies tie (scan at 20,000), where only S3-FIFO keeps anything (loop at 6,000 and 8,000,
# missed before the no-evidence rule, like rag at 3,000), on the
# traces `kvoffload synth-trace` writes by default (4,000 requests: the learning phase is
# part of what is judged); and the Mooncake synthetic trace at 1,000, 6,000 (the cell
# following a single leader missed, 0.3199 against ARC's 0.3266), 10,000 (missed while the
# noise of the hit counts was taken as that of independent hits, 0.4289 against ARC's
# 0.4344) and 20,000 blocks.
TARGET_CASES = [
    ("chat", 1000),
    ("chat", 15000),
    ("rag", 500),
    ("rag", 3000),
    ("rag", 6000),
    ("scan", 1000),
    ("scan", 20000),
    ("loop", 6000),
    ("loop", 8000),
]
MOONCAKE_CAPACITIES = [1000, 6000, 10000, 20000]


def _meets_target(trace: Trace, capacity: int) -> None:
    (row,) = run_replay(trace, [capacity], POLICY_NAMES).rows
    rates = {r.policy: r.hit_rate for r in row.results}
    adaptive = rates.pop("adaptive")
    assert row.best_static_hit_rate == max(rates.values())
    assert adaptive >= row.best_static_hit_rate - 0.005, (rates, adaptive)
    assert adaptive >= rates["lru"] - 0.005, (rates, adaptive)


@pytest.mark.parametrize(("shape", "capacity"), TARGET_CASES)
def test_adaptive_meets_its_target_on_the_generated_shapes(shape: str, capacity: int) -> None:
    _meets_target(Trace("", tuple(tuple(r) for r in generate(shape, 4000))), capacity)


@pytest.mark.parametrize("capacity", MOONCAKE_CAPACITIES)
def test_adaptive_meets_its_target_on_the_mooncake_trace(trace_path: Path, capacity: int) -> None:
    _meets_target(load_trace(trace_path), capacity)


def test_replay_rows_name_the_best_static_policy() -> None:
    trace = Trace("", tuple(tuple(r) for r in generate("scan", 400)))
    report = run_replay(trace, [200, 5000], ["lru", "s3fifo", "adaptive"])
    for row in report.rows:
        rates = {r.policy: r.hit_rate for r in row.results}
        best = "s3fifo" if rates["s3fifo"] > rates["lru"] else "lru"  # first on a tie
        assert row.best_static_policy == best
        assert row.best_static_hit_rate == rates[best]
    assert report.rows[0].best_static_policy == "s3fifo"  # scan resistance pays at 200
    data = report.to_json()["rows"][0]
    assert data["best_static_policy"] == "s3fifo"
    assert data["best_static_hit_rate"] == pytest.approx(report.rows[0].best_static_hit_rate)
    (alone,) = run_replay(trace, [200], ["adaptive"]).rows
    assert alone.best_static_policy is None
    assert alone.best_static_hit_rate is None


def test_cli_replay_table_has_the_adaptive_policy_and_the_best_static_one(
    tmp_path: Path,
) -> None:
    from click.testing import CliRunner  # noqa: PLC0415 (the cli extra)

    from kvoffload.cli import cli  # noqa: PLC0415

    path = tmp_path / "scan.jsonl"
    write_trace(path, generate("scan", 300))
    result = CliRunner().invoke(
        cli,
        ["replay", str(path), "--capacity", "200", "--no-progress"],
        catch_exceptions=False,
        env={"COLUMNS": "200"},
    )
    assert result.exit_code == 0, result.output
    assert "adaptive" in result.output
    assert "best static" in result.output
    (row,) = run_replay(load_trace(path), [200]).rows
    assert f"{row.best_static_hit_rate:.4f} ({row.best_static_policy})" in result.output
    only = CliRunner().invoke(
        cli,
        ["replay", str(path), "--capacity", "200", "--policy", "adaptive", "--no-progress"],
        catch_exceptions=False,
        env={"COLUMNS": "200"},
    )
    assert only.exit_code == 0, only.output
    assert re.search(r"│\s+-\s+│", only.output)  # no static policy ran: no best one
