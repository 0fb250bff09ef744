"""`TierBridge`: kvoffload's tiers on a private event loop thread, called from plain threads.

Verified reads (a corrupted block is a miss and deleted), budgets (a blocked tier turns
into misses and is skipped while unhealthy), futures, shutdown (drain or cancel) and no
thread left behind.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import anyio
import pytest
from tier_helpers import RedisServer

from kvoffload.config import OffloadConfig
from kvoffload.errors import ClosedError, ConfigError
from kvoffload.hashing import BlockHash
from kvoffload.tier_config import DiskTierSettings, RedisTierSettings, parse_tier_settings
from kvoffload.tiers import TierBridge, engine_namespace
from kvoffload.tiers.base import BlockRead, BlockWrite

NBYTES = 4096
NS = engine_namespace(model="m", layout="L2:H2:D8:B16", dtype="bfloat16", rank=0)


def payload(i: int) -> bytearray:
    return bytearray((i * 7 + j) % 251 for j in range(NBYTES))


def disk_settings(tmp_path: Path, **kw: object) -> DiskTierSettings:
    return DiskTierSettings(path=tmp_path / "kv.bin", capacity_bytes=1 << 20, **kw)  # type: ignore[arg-type]


class MemoryTier:
    """An in-memory tier; ``block`` makes every get/exists wait until it is set."""

    def __init__(self, name: str = "mem") -> None:
        self._name = name
        self.values: dict[BlockHash, tuple[bytes, bytes]] = {}
        self.block: threading.Event | None = None
        self.closed = False

    @property
    def name(self) -> str:
        return self._name

    async def _maybe_wait(self) -> None:
        if self.block is not None:
            while not self.block.is_set():
                await anyio.sleep(0.01)

    async def open(self) -> None:
        pass

    async def ping(self) -> None:
        pass

    async def exists(self, block_hashes: Sequence[BlockHash]) -> int:
        await self._maybe_wait()
        n = 0
        for h in block_hashes:
            if h not in self.values:
                break
            n += 1
        return n

    async def put(self, blocks: Sequence[BlockWrite]) -> int:
        for b in blocks:
            self.values[b.block_hash] = (b.sealed_header(), bytes(b.payload))
        return len(blocks)

    async def get(
        self, block_hashes: Sequence[BlockHash], into: Sequence[memoryview]
    ) -> list[BlockRead | None]:
        await self._maybe_wait()
        out: list[BlockRead | None] = []
        for h, view in zip(block_hashes, into, strict=True):
            if h not in self.values:
                out.append(None)
                continue
            header, data = self.values[h]
            view[: len(data)] = data
            out.append(BlockRead(header, len(data)))
        return out

    async def delete(self, block_hashes: Sequence[BlockHash]) -> None:
        for h in block_hashes:
            self.values.pop(h, None)

    async def close(self) -> None:
        self.closed = True

    def statistics(self) -> Mapping[str, int | float | str | bool]:
        return {"blocks": len(self.values)}


def mem_bridge(tier: MemoryTier, *, op_timeout_s: float = 5.0, namespace: bytes = NS) -> TierBridge:
    settings = DiskTierSettings(
        path=Path("/nonexistent/unused"),
        capacity_bytes=1 << 20,  # type: ignore[arg-type]
        op_timeout_s=op_timeout_s,
        retry_initial_s=30,
        retry_max_s=60,
    )
    return TierBridge([(tier, settings)], namespace=namespace, block_nbytes=NBYTES)


def thread_names() -> set[str]:
    return {t.name for t in threading.enumerate()}


def wait_for_threads(before: set[str]) -> set[str]:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        extra = thread_names() - before
        if not extra:
            return extra
        time.sleep(0.02)
    return thread_names() - before


@pytest.fixture
def bridge(tmp_path: Path) -> Iterator[TierBridge]:
    b = TierBridge.from_settings([disk_settings(tmp_path)], namespace=NS, block_nbytes=NBYTES)
    try:
        yield b
    finally:
        b.close()


def test_blocks_round_trip_exactly_through_a_disk_tier(bridge: TierBridge) -> None:
    keys = [bridge.key(b"block-%d" % i) for i in range(5)]
    data = [payload(i) for i in range(5)]
    assert bridge.put(keys[:3], [memoryview(d) for d in data[:3]]) == 3
    assert bridge.exists(keys) == 3
    out = [bytearray(NBYTES) for _ in keys]
    assert bridge.get(keys, [memoryview(o) for o in out]) == [True, True, True, False, False]
    assert out[:3] == data[:3]
    # The non-blocking calls return futures that another thread may wait on.
    fut = bridge.submit_put(keys[3:], [memoryview(d) for d in data[3:]])
    assert isinstance(fut, concurrent.futures.Future)
    assert fut.result() == 2
    assert bridge.submit_exists(keys).result() == 5
    out = [bytearray(NBYTES) for _ in keys]
    assert bridge.submit_get(keys, [memoryview(o) for o in out]).result() == [True] * 5
    assert out == data
    bridge.delete(keys[:1])
    assert bridge.exists(keys) == 0
    (stats,) = bridge.statistics()
    assert stats.blocks_read == 8
    assert stats.blocks_written == 5
    assert stats.failed_checks == 0


def test_many_threads_share_one_bridge(bridge: TierBridge) -> None:
    def one(i: int) -> bool:
        key = bridge.key(b"t%d" % i)
        bridge.put([key], [memoryview(payload(i))])
        out = bytearray(NBYTES)
        return bridge.get([key], [memoryview(out)]) == [True] and out == payload(i)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        assert all(pool.map(one, range(32)))


def test_a_corrupted_block_is_a_miss_and_is_deleted(tmp_path: Path, bridge: TierBridge) -> None:
    keys = [bridge.key(b"a"), bridge.key(b"b")]
    data = [payload(1), payload(2)]
    bridge.put(keys, [memoryview(d) for d in data])
    raw = (tmp_path / "kv.bin").read_bytes()
    at = raw.index(bytes(data[1]))
    with open(tmp_path / "kv.bin", "r+b") as f:  # one flipped byte of block b's payload
        f.seek(at + 100)
        f.write(bytes([raw[at + 100] ^ 0xFF]))
    os.sync()
    out = [bytearray(NBYTES) for _ in keys]
    assert bridge.get(keys, [memoryview(o) for o in out]) == [True, False]
    assert out[0] == data[0]
    (stats,) = bridge.statistics()
    assert stats.failed_checks == 1
    assert bridge.exists(keys[1:]) == 0  # deleted: the next lookup misses at once


def test_a_block_of_another_namespace_is_never_served() -> None:
    tier = MemoryTier()
    other = engine_namespace(model="m", layout="L2:H2:D8:B16", dtype="bfloat16", rank=1)
    with mem_bridge(tier, namespace=other) as writer:
        key = writer.key(b"k")
        writer.put([key], [memoryview(payload(3))])
    assert key in tier.values
    with mem_bridge(tier) as reader:
        assert reader.key(b"k") != key  # the rank is part of every key
        out = bytearray(NBYTES)
        assert reader.get([key], [memoryview(out)]) == [False]  # same key, wrong header
        (stats,) = reader.statistics()
        assert stats.failed_checks == 1
    assert key not in tier.values


def test_a_blocked_tier_turns_into_misses_within_its_budget() -> None:
    tier = MemoryTier()
    with mem_bridge(tier, op_timeout_s=0.2) as bridge:
        key = bridge.key(b"k")
        bridge.put([key], [memoryview(payload(4))])
        tier.block = threading.Event()  # every read now hangs
        assert bridge.exists([key]) == 0
        (stats,) = bridge.statistics()
        assert not stats.healthy
        assert "TimeoutError" in stats.last_error
        # Unhealthy: skipped (retried with backoff by the health loop), misses at once.
        out = bytearray(NBYTES)
        assert bridge.get([key], [memoryview(out)]) == [False]
        assert bridge.statistics()[0].errors == 1
        tier.block.set()


def test_close_drains_the_jobs_in_flight() -> None:
    before = thread_names()
    tier = MemoryTier()
    bridge = mem_bridge(tier)
    key = bridge.key(b"k")
    bridge.put([key], [memoryview(payload(5))])
    tier.block = threading.Event()
    fut = bridge.submit_exists([key])
    threading.Timer(0.2, tier.block.set).start()
    bridge.close()  # waits for the probe, which finishes once the tier answers
    assert fut.result() == 1
    assert tier.closed
    assert wait_for_threads(before) == set()


def test_close_without_drain_cancels_a_blocked_job_and_leaks_no_thread(tmp_path: Path) -> None:
    before = thread_names()
    tier = MemoryTier("blocked")
    disk = disk_settings(tmp_path)
    from kvoffload.tiers.build import build_tier  # noqa: PLC0415

    slow = DiskTierSettings(
        path=Path("/nonexistent/unused"),
        capacity_bytes=1 << 20,  # type: ignore[arg-type]
        op_timeout_s=600,
    )
    pairs = [
        (build_tier(disk, 0, namespace=NS, block_nbytes=NBYTES), disk),
        (tier, slow),
    ]
    bridge = TierBridge(pairs, namespace=NS, block_nbytes=NBYTES)
    tier.block = threading.Event()  # never set: the tier hangs until cancelled
    out = bytearray(NBYTES)
    fut = bridge.submit_get([bridge.key(b"nowhere")], [memoryview(out)])
    time.sleep(0.1)
    assert not fut.done()
    bridge.close(drain=False)
    with pytest.raises(ClosedError, match="closed during the job"):
        fut.result()
    assert tier.closed
    assert wait_for_threads(before) == set()
    with pytest.raises(ClosedError):
        bridge.exists([bridge.key(b"x")])
    bridge.close()  # idempotent


def test_redis_tier_settings_are_validated_like_offload_config() -> None:
    bad = [{"kind": "redis", "url": "redis://u:secret@h:1/0", "max_in_flight": 0}]
    with pytest.raises(ConfigError) as ours:
        parse_tier_settings(bad, owner="kvoffload secondary tier")
    with pytest.raises(ConfigError) as theirs:
        OffloadConfig(num_cpu_blocks=4, tiers=bad)
    assert "tiers.0.redis.max_in_flight" in str(ours.value)
    assert "secret" not in str(ours.value)
    # The same reason, word for word, after the owner's name.
    reason = str(ours.value).split(": ", 1)[1]
    assert reason in str(theirs.value).replace(" (env KVOFFLOAD_TIERS)", "")
    with pytest.raises(ConfigError, match="at least one tier"):
        parse_tier_settings([], owner="kvoffload secondary tier")
    (parsed,) = parse_tier_settings(
        [{"kind": "redis", "url": "redis://h:1/0"}], owner="kvoffload secondary tier"
    )
    assert isinstance(parsed, RedisTierSettings)


def test_a_bad_namespace_or_block_size_is_refused() -> None:
    with pytest.raises(ConfigError, match="namespace: 3 bytes"):
        TierBridge([], namespace=b"abc", block_nbytes=NBYTES)
    with pytest.raises(ConfigError, match="block_nbytes=0"):
        TierBridge([], namespace=NS, block_nbytes=0)


def test_a_paused_redis_server_turns_into_misses(own_redis: RedisServer) -> None:
    settings = RedisTierSettings(url=own_redis.url, op_timeout_s=0.3, retry_initial_s=30)  # type: ignore[arg-type]
    before = thread_names()
    bridge = TierBridge.from_settings([settings], namespace=NS, block_nbytes=NBYTES)
    try:
        keys = [bridge.key(b"r%d" % i) for i in range(4)]
        data = [payload(i) for i in range(4)]
        assert bridge.put(keys, [memoryview(d) for d in data]) == 4
        out = [bytearray(NBYTES) for _ in keys]
        assert bridge.get(keys, [memoryview(o) for o in out]) == [True] * 4
        assert out == data
        own_redis.pause()
        assert bridge.exists(keys) == 0
        assert bridge.get(keys, [memoryview(o) for o in out]) == [False] * 4
        (stats,) = bridge.statistics()
        assert not stats.healthy
    finally:
        bridge.close(drain=False)
        own_redis.resume()
    assert wait_for_threads(before) == set()


class HalfTier(MemoryTier):
    """Stores only the first half of every write."""

    async def put(self, blocks: Sequence[BlockWrite]) -> int:
        return await super().put(blocks[: len(blocks) // 2])


def test_submit_put_each_counts_each_tier_s_stored_blocks() -> None:
    full, half = MemoryTier("full"), HalfTier("half")
    settings = DiskTierSettings(path=Path("/nonexistent/unused"), capacity_bytes=1 << 20)  # type: ignore[arg-type]
    pairs = [(full, settings), (half, settings)]
    with TierBridge(pairs, namespace=NS, block_nbytes=NBYTES) as bridge:
        keys = [bridge.key(b"e%d" % i) for i in range(4)]
        views = [memoryview(payload(i)) for i in range(4)]
        assert bridge.submit_put_each(keys, views).result(timeout=10) == (4, 2)
        assert bridge.submit_put(keys, views).result(timeout=10) == 4  # the best tier's
    assert set(full.values) == set(keys)
    assert set(half.values) == set(keys[:2])
