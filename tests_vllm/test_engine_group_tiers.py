"""End to end: kvoffload's connector with ``tiers`` on a hybrid model (several KV cache
groups, vLLM's hybrid KV cache manager on) in the vLLM CPU engine. Two engines one after
the other, each a fresh engine, share a persistent disk tier, a Redis tier or a six-node
Redis Cluster (Gemma 3): the second serves at least half of its first turn's prompt
tokens from the tier, with the tokens of an engine without connector; a value corrupted
in place in one group's file is never served (a hit needs every group).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from disk_files import corrupt_every_slot
from engine_runs import connector_of, kvoffload_config
from engine_runs import worker_connector_of as worker_of
from models import CASES, ENGINE_BLOCK_SIZE, engine_kwargs, started, write_model
from redis_cluster import RedisClusterProcs
from redis_server import RedisServer, require_redis_client
from test_engine_cluster_tier import cluster_tier
from test_engine_secondary_tier import DISK_BYTES, PROMPT_TOKENS, Turn, generate

from kvoffload.integrations.vllm.group_tiers import GroupedSchedulerTiers, GroupedWorkerTiers

pytestmark = pytest.mark.engine

# The prompt and the answer fit; prefill in chunks, as a hybrid model's tests do.
OVERRIDES: dict[str, dict[str, Any]] = {
    "gemma3": {"max_model_len": 640, "max_num_batched_tokens": 128, "gpu_blocks": 96},
    "qwen3_next": {"max_model_len": 1024, "max_num_batched_tokens": 576, "gpu_blocks": 16},
}
MODELS = ["gemma3", "qwen3_next"]


def whole_blocks(alignment: int) -> int:
    """The prompt tokens below its last token in whole multiples of the groups' hit
    alignment (the longest hit)."""
    return (PROMPT_TOKENS - 1) // alignment * alignment


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("hybrid-tiers")


def run(models_dir: Path, name: str, tiers: list[dict[str, Any]] | None) -> Engine:
    case = CASES[name]
    extra = dict(OVERRIDES[name])
    gpu_blocks = extra.pop("gpu_blocks")
    if tiers is not None:
        extra["kv_transfer_config"] = kvoffload_config({"num_cpu_blocks": 64, "tiers": tiers})
    kwargs = engine_kwargs(
        write_model(models_dir / name, case),
        case,
        gpu_blocks=gpu_blocks,
        disable_log_stats=False,
        **extra,
    )
    with started(**kwargs) as llm:
        turn = generate(llm)
        if tiers is None:
            return Engine(turn)
        side = connector_of(llm).scheduler_side
        sched = side.tiers
        worker = worker_of(llm).worker_side
        assert isinstance(sched, GroupedSchedulerTiers)
        assert isinstance(worker.tiers, GroupedWorkerTiers)
        need = {g.name: g.num_cpu_blocks * g.layout.bytes_per_block for g in worker.groups.values()}
        return Engine(
            turn,
            promoted={n: s.blocks_promoted for n, s in sched.group_statistics().items()},
            failed={n: s.blocks_failed for n, s in sched.group_statistics().items()},
            tiers={t.name: t for t in worker.tiers.statistics()},
            need=need,
            alignment=side.alignment,
        )


class Engine:
    """What one engine did: its turn, and with tiers each group's promotions and tiers."""

    def __init__(
        self,
        turn: Turn,
        *,
        promoted: dict[str, int] | None = None,
        failed: dict[str, int] | None = None,
        tiers: dict[str, Any] | None = None,
        need: dict[str, int] | None = None,
        alignment: int = ENGINE_BLOCK_SIZE,
    ) -> None:
        self.turn = turn
        self.promoted = promoted or {}
        self.failed = failed or {}
        self.tiers = tiers or {}
        self.need = need or {}
        self.alignment = alignment


_baselines: dict[str, Turn] = {}


def baseline(models_dir: Path, name: str) -> Turn:
    if name not in _baselines:
        _baselines[name] = run(models_dir, name, None).turn
    return _baselines[name]


@pytest.mark.parametrize("name", MODELS)
def test_a_restarted_hybrid_engine_serves_from_the_disk_tier_and_never_a_corrupt_block(
    models_dir: Path, tmp_path: Path, name: str
) -> None:
    want = baseline(models_dir, name)
    tiers = [{"kind": "disk", "path": str(tmp_path / "kv.bin"), "capacity_bytes": DISK_BYTES,
              "persist": True}]  # fmt: skip
    first = run(models_dir, name, tiers)
    second = run(models_dir, name, tiers)

    assert first.turn.tokens == want.tokens
    assert first.turn.external == 0
    # one file per group, each group's blocks under its own namespace
    groups = sorted(second.need)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"kv.{g}.bin" for g in groups]
    # A fresh engine: its first turn's prompt comes back from the files, in every group.
    assert second.turn.tokens == want.tokens
    assert second.turn.local_hit == 0
    assert second.turn.external >= PROMPT_TOKENS / 2
    assert second.turn.external == whole_blocks(second.alignment)
    assert all(second.promoted[g] >= 1 for g in groups), second.promoted
    assert sum(second.failed.values()) == 0

    # Corrupt one group's file in place (the full-attention group's, the last): its
    # blocks fail their checks, so no hit is served in any group; same tokens.
    full = groups[-1]
    tier = second.tiers[f"disk0.{full}"]
    capacity = int(DISK_BYTES * (second.need[full] / sum(second.need.values())))
    block_nbytes = tier.bytes_read // max(tier.blocks_read, 1)
    assert corrupt_every_slot(tmp_path / f"kv.{full}.bin", capacity, block_nbytes, offset=1000) >= 1
    third = run(models_dir, name, tiers)
    assert third.turn.external == 0
    assert third.turn.tokens == want.tokens
    assert third.promoted[full] == 0
    assert third.failed[full] >= 1
    assert third.tiers[f"disk0.{full}"].failed_checks >= 1
    print(
        f"\n{name} restart on disk: {second.turn.external:.0f}/{PROMPT_TOKENS} prompt tokens "
        f"from the files in {second.turn.seconds * 1e3:.0f} ms (first engine computed it in "
        f"{first.turn.seconds * 1e3:.0f} ms); corrupted: {third.turn.external:.0f} served"
    )


@pytest.mark.parametrize("name", MODELS)
def test_a_fresh_hybrid_engine_serves_its_first_prompt_from_the_redis_tier(
    models_dir: Path, name: str
) -> None:
    require_redis_client()
    want = baseline(models_dir, name)
    with RedisServer() as server:
        tiers = [{"kind": "redis", "url": server.url, "op_timeout_s": 2.0,
                  "max_batch_blocks": 256, "retry_initial_s": 30}]  # fmt: skip
        first = run(models_dir, name, tiers)
        second = run(models_dir, name, tiers)

    assert first.turn.tokens == want.tokens
    assert second.turn.tokens == want.tokens
    assert second.turn.local_hit == 0
    assert second.turn.external >= PROMPT_TOKENS / 2
    assert second.turn.external == whole_blocks(second.alignment)
    assert all(n >= 1 for n in second.promoted.values()), second.promoted
    assert sum(t.failed_checks for t in second.tiers.values()) == 0
    print(
        f"\n{name} on Redis: {second.turn.external:.0f}/{PROMPT_TOKENS} prompt tokens from "
        f"the tier in {second.turn.seconds * 1e3:.0f} ms"
    )


@pytest.mark.parametrize("name", ["gemma3"])
def test_a_fresh_hybrid_engine_serves_its_first_prompt_from_the_redis_cluster(
    models_dir: Path, name: str, own_redis_cluster: RedisClusterProcs
) -> None:
    """Two fresh engines of a hybrid model one after the other on a six-node Redis Cluster
    of the test's own: every group's blocks come back from the cluster (under each group's
    namespace), with the tokens of an engine without connector."""
    want = baseline(models_dir, name)
    tiers = [cluster_tier(own_redis_cluster.urls)]
    first = run(models_dir, name, tiers)
    second = run(models_dir, name, tiers)

    assert first.turn.tokens == want.tokens
    assert first.turn.external == 0
    assert second.turn.tokens == want.tokens
    assert second.turn.local_hit == 0
    assert second.turn.external >= PROMPT_TOKENS / 2
    assert second.turn.external == whole_blocks(second.alignment)
    assert all(n >= 1 for n in second.promoted.values()), second.promoted
    assert sum(second.failed.values()) == 0
    assert {t.kind for t in second.tiers.values()} == {"redis-cluster"}
    assert sum(t.failed_checks for t in second.tiers.values()) == 0
    print(
        f"\n{name} on a Redis Cluster: {second.turn.external:.0f}/{PROMPT_TOKENS} prompt "
        f"tokens from the cluster in {second.turn.seconds * 1e3:.0f} ms"
    )
