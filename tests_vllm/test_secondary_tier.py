"""kvoffload's tiers as a secondary tier of vLLM's OffloadingConnector, at unit level:
vLLM's real tiering manager (`TieringOffloadingManager`, `CPUPrimaryTierOffloadingManager`,
`SecondaryTierFactory`) over a CPU primary region in host memory.

The secondary tier is loaded exactly as vLLM loads it from
``kv_connector_extra_config["secondary_tiers"]`` (class name and module path).
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from redis_server import RedisServer, require_redis_client
from vllm.v1.kv_offload.base import (
    LookupResult,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
from vllm.v1.kv_offload.tiering.manager import (
    CPUPrimaryTierOffloadingManager,
    TieringOffloadingManager,
)

from kvoffload.errors import ConfigError

ROW = 4096
CHUNKS = 8
MODULE = "kvoffload.integrations.vllm.secondary_tier"


def spec(rank: int = 0) -> Any:
    """What a secondary tier reads of vLLM's offloading spec."""
    config = OffloadingConfig(
        groups=(OffloadingGroupConfig(16, ("layer0",), 0),),
        worker_kv_bytes_per_block=ROW,
        enable_kv_cache_events=True,
        extra_config={},
        engine_id="test",
        model=OffloadingModelConfig("tiny-llama", "float32"),
        cache=OffloadingCacheConfig(16, 1),
        parallel=OffloadingParallelConfig(rank, 1, 1, 1, 1, 1, 0, 1, None, True),
        kv_cache_layout="NHD",
    )
    return SimpleNamespace(config=config, kv_events_config=SimpleNamespace(
        enable_kv_cache_events=True))  # fmt: skip


class Stack:
    """vLLM's tiering manager: a CPU primary region and kvoffload as its secondary tier."""

    def __init__(self, tiers: list[dict[str, Any]]) -> None:
        self.region = SharedOffloadRegion(
            engine_id=f"kvoffload-test-{uuid.uuid4().hex[:8]}",
            num_chunks=CHUNKS,
            rank=None,
            kv_bytes_per_chunk=ROW,
            cpu_page_size=ROW,
        )
        self.primary = CPUPrimaryTierOffloadingManager(
            num_chunks=CHUNKS, mmap_region=self.region, enable_events=True
        )
        self.view = self.primary.get_kv_memoryview()
        self.tier = SecondaryTierFactory.create_secondary_tier(
            {"type": "KVOffloadSecondaryTier", "module_path": MODULE, "tiers": tiers},
            self.view,
            spec(),
        )
        self.manager = TieringOffloadingManager(self.primary, [self.tier])
        self.ctx = ReqContext(req_id="r0")
        self.manager.on_new_request(self.ctx)

    def row(self, chunk: int) -> memoryview:
        return self.view.cast("B")[chunk * ROW : (chunk + 1) * ROW]

    def step(self) -> None:
        self.manager.on_schedule_end(ScheduleEndContext((), ()))

    def store(self, keys: list[bytes], data: list[bytes]) -> None:
        out = self.manager.prepare_store(keys, self.ctx)
        assert out is not None
        for chunk, payload in zip(out.store_spec.block_ids, data, strict=True):
            self.row(int(chunk))[:] = payload
        self.manager.complete_store(keys, self.ctx)
        self.settle()

    def settle(self, deadline_s: float = 30.0) -> None:
        end = time.monotonic() + deadline_s
        while self.manager.has_pending_work() and time.monotonic() < end:
            self.step()
            time.sleep(0.005)
        self.step()

    def lookup(self, key: bytes, deadline_s: float = 30.0) -> LookupResult:
        """Ask until the answer is neither RETRY nor HIT_PENDING (a promotion running)."""
        end = time.monotonic() + deadline_s
        while True:
            result = self.manager.lookup(key, self.ctx)
            if result not in (LookupResult.RETRY, LookupResult.HIT_PENDING):
                return result
            if time.monotonic() > end:
                return result
            self.step()
            time.sleep(0.005)

    def load(self, keys: list[bytes]) -> list[bytes]:
        spec_ = self.manager.prepare_load(keys, self.ctx)
        rows = [bytes(self.row(int(c))) for c in spec_.block_ids]
        self.manager.complete_load(keys, self.ctx)
        return rows

    def close(self) -> None:
        self.manager.shutdown()


def keys_and_data(n: int) -> tuple[list[bytes], list[bytes]]:
    keys = [make_offload_key(os.urandom(32), 0) for _ in range(n)]
    data = [os.urandom(ROW) for _ in range(n)]
    return keys, data


@pytest.fixture
def disk_stack(tmp_path: Path) -> Iterator[Stack]:
    stack = Stack([{"kind": "disk", "path": str(tmp_path / "kv.bin"), "capacity_bytes": "1MiB"}])
    try:
        yield stack
    finally:
        stack.close()


def test_chunks_come_back_exactly_after_the_primary_tier_is_reset(disk_stack: Stack) -> None:
    s = disk_stack
    keys, data = keys_and_data(4)
    s.store(keys, data)
    stats = s.tier.get_stats()
    assert stats is not None
    s.manager.reset_cache()  # drains the tier's jobs, empties the primary region
    for key in keys:
        assert s.manager.primary_tier.lookup(key, s.ctx) is LookupResult.MISS
        assert s.lookup(key) is LookupResult.HIT  # promoted back from kvoffload's tier
    assert s.load(keys) == data
    events = list(s.tier.take_events())
    assert [k for e in events if not e.removed for k in e.keys] == keys


def test_a_corrupted_block_is_a_miss_is_deleted_and_is_not_reported_landed(
    tmp_path: Path, disk_stack: Stack
) -> None:
    s = disk_stack
    keys, data = keys_and_data(2)
    s.store(keys, data)
    s.manager.reset_cache()
    raw = (tmp_path / "kv.bin").read_bytes()
    at = raw.index(data[1])
    with open(tmp_path / "kv.bin", "r+b") as f:
        f.seek(at + 7)
        f.write(bytes([raw[at + 7] ^ 0x55]))
    assert s.lookup(keys[0]) is LookupResult.HIT
    # The tier still answers HIT (its index knows the key); the verified read fails, the
    # job reports the key as not landed, so vLLM never serves it and never asks again.
    first = s.manager.lookup(keys[1], s.ctx)
    assert first in (LookupResult.HIT_PENDING, LookupResult.RETRY)
    assert s.lookup(keys[1]) is LookupResult.MISS
    assert s.load(keys[:1]) == data[:1]
    removed = [k for e in s.tier.take_events() if e.removed for k in e.keys]
    assert removed == [keys[1]]
    (tier_stats,) = s.tier._bridge.statistics()
    assert tier_stats.failed_checks == 1
    # Deleted from the tier: a fresh probe finds nothing.
    assert s.tier._bridge.exists([s.tier._bridge.key(keys[1])]) == 0


def test_a_key_written_by_another_instance_is_probed_then_hit(tmp_path: Path) -> None:
    tiers = [{"kind": "disk", "path": str(tmp_path / "kv.bin"), "capacity_bytes": "1MiB",
              "persist": True}]  # fmt: skip
    keys, data = keys_and_data(1)
    first = Stack(tiers)
    first.store(keys, data)
    first.close()
    second = Stack(tiers)
    try:
        assert second.tier.lookup(keys[0], second.ctx) is LookupResult.RETRY
        assert second.lookup(keys[0]) is LookupResult.HIT
        assert second.load(keys) == data
    finally:
        second.close()


def test_settings_are_validated_like_offload_config(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"tiers\.0\.disk\.capacity_bytes"):
        Stack([{"kind": "disk", "path": str(tmp_path / "kv.bin"), "capacity_bytes": "1KiB"}])
    with pytest.raises(ConfigError, match="'tiers' is missing"):
        SecondaryTierFactory.create_secondary_tier(
            {"type": "KVOffloadSecondaryTier", "module_path": MODULE},
            memoryview(bytearray(ROW * 2)).cast("B", (2, ROW)),
            spec(),
        )
    with pytest.raises(ConfigError, match="unknown setting"):
        SecondaryTierFactory.create_secondary_tier(
            {"type": "KVOffloadSecondaryTier", "module_path": MODULE, "tiers": [], "tier": 1},
            memoryview(bytearray(ROW * 2)).cast("B", (2, ROW)),
            spec(),
        )


def test_a_paused_redis_node_turns_into_misses_within_the_budget() -> None:
    require_redis_client()
    server = RedisServer()
    before = {t.name for t in threading.enumerate()}
    tiers = [{"kind": "redis", "url": server.url,
              "op_timeout_s": 0.5, "retry_initial_s": 30}]  # fmt: skip
    s = Stack(tiers)
    try:
        keys, data = keys_and_data(3)
        s.store(keys, data)
        s.manager.reset_cache()
        assert s.lookup(keys[0]) is LookupResult.HIT
        assert s.load(keys[:1]) == data[:1]
        server.pause()
        # Known keys answer HIT without the server; the load then fails within the
        # tier's op_timeout_s and the keys are reported not landed: a miss.
        assert s.lookup(keys[1]) is LookupResult.MISS
        # The tier is unhealthy now: an unknown key's probe is a miss at once.
        stranger = make_offload_key(os.urandom(32), 0)
        assert s.lookup(stranger) is LookupResult.MISS
        (tier_stats,) = s.tier._bridge.statistics()
        assert not tier_stats.healthy
    finally:
        s.close()
        server.close()
    end = time.monotonic() + 10
    while {t.name for t in threading.enumerate()} - before and time.monotonic() < end:
        time.sleep(0.02)
    assert {t.name for t in threading.enumerate()} - before == set()
