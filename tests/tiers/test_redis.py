"""RedisTier on a real redis-server: sharing, namespaces, corruption, restarts, back-pressure."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import anyio
import pytest
from tier_helpers import (
    BS,
    REDIS_SERVER_ENV,
    RedisServer,
    check,
    compute_and_store,
    config,
    lookup_load,
    make_kv,
    settle,
    tier_stats,
    tokens,
    wait_until,
)

from kvoffload.hashing import BlockHash
from kvoffload.offloader import KVOffloader
from kvoffload.tiers.base import BlockWrite
from kvoffload.tiers.format import checksum, encode_header

pytestmark = pytest.mark.anyio

PEER = Path(__file__).with_name("redis_peer.py")


def redis_tier(url: str, prefix: str, **kw: object) -> dict[str, object]:
    values: dict[str, object] = {"kind": "redis", "url": url, "key_prefix": prefix}
    values.update(kw)
    return values


@pytest.fixture
def prefix() -> str:
    return f"kvtest:{uuid.uuid4().hex[:12]}:"


def redis_client(url: str):  # type: ignore[no-untyped-def]
    aioredis = pytest.importorskip("redis.asyncio")
    return aioredis.Redis.from_url(url)


async def test_the_server_is_the_one_asked_for(redis_url: str) -> None:
    # scripts/with_redis.sh runs Redis 7, or Valkey with KVOFFLOAD_TEST_REDIS_SERVER: a run
    # meant for Valkey must really talk to Valkey.
    client = redis_client(redis_url)
    try:
        info = await client.info("server")
    finally:
        await client.aclose()
    if os.environ.get(REDIS_SERVER_ENV, "redis-server") == "valkey-server":
        assert info.get("server_name") == "valkey", info
        assert int(str(info["valkey_version"]).split(".")[0]) >= 7
    else:
        assert "valkey_version" not in info, info
        assert int(str(info["redis_version"]).split(".")[0]) >= 7


async def test_put_get_exists_delete_and_ttl(redis_url: str, prefix: str) -> None:
    RedisTier = pytest.importorskip("kvoffload.tiers.redis").RedisTier
    ns = b"\7" * 32
    hashes = [BlockHash(bytes([i]) * 32) for i in range(3)]
    data = [bytes([i + 1]) * 1024 for i in range(3)]
    tier = RedisTier(redis_url, block_nbytes=1024, namespace=ns, key_prefix=prefix, ttl_s=60)
    await tier.open()
    try:
        writes = [
            BlockWrite(h, encode_header(ns, h, d), memoryview(bytearray(d)))
            for h, d in zip(hashes[:2], data, strict=False)
        ]
        assert await tier.put(writes) == 2
        assert await tier.exists(hashes) == 2
        assert await tier.exists([hashes[2], hashes[0]]) == 0
        bufs = [memoryview(bytearray(1024)) for _ in range(3)]
        reads = await tier.get(hashes, bufs)
        assert reads[2] is None
        assert reads[0] is not None
        assert reads[0].payload_length == 1024
        assert bytes(bufs[1]) == data[1]
        # The checksum of the bytes copied into the buffer comes with the read.
        assert reads[1] is not None
        assert reads[1].payload_checksum == checksum(data[1])
        client = redis_client(redis_url)
        ttl = await client.ttl(tier.key(hashes[0]))
        await client.aclose()
        assert 0 < ttl <= 60
        await tier.delete(hashes)
        assert await tier.exists(hashes) == 0
    finally:
        await tier.close()


async def test_two_processes_share_one_redis(redis_url: str, prefix: str) -> None:
    kv = make_kv()
    async with KVOffloader(config([redis_tier(redis_url, prefix)], model_id="m"), kv) as off:
        await compute_and_store(off, kv, "a", tokens(1, 5), range(5))
        await settle(off)
        assert tier_stats(off).blocks_written == 5
    env = {**os.environ, "PYTHONPATH": str(PEER.parent)}

    def peer(model_id: str) -> list[int]:
        out = subprocess.run(
            [sys.executable, str(PEER), redis_url, prefix, model_id, "1", "5"],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        return [int(x) for x in out.stdout.split()]

    # The same namespace in another process: promoted from Redis and loaded bit-exact.
    assert await anyio.to_thread.run_sync(peer, "m") == [5 * BS, 5, 0]
    # Another model never sees those blocks.
    assert await anyio.to_thread.run_sync(peer, "other") == [0, 0, 0]


async def test_other_salt_or_dtype_misses(redis_url: str, prefix: str) -> None:
    kv = make_kv()
    tiers = [redis_tier(redis_url, prefix)]
    async with KVOffloader(config(tiers), kv) as off:
        await compute_and_store(off, kv, "a", tokens(2, 3), range(3))
        await settle(off)
    async with KVOffloader(config(tiers, hash_salt="tenant-b"), kv) as off:
        assert await lookup_load(off, kv, "b", tokens(2, 3), range(3)) == 0
    kv16 = [t.half() for t in make_kv()]
    async with KVOffloader(config(tiers), kv16) as off:
        assert off.lookup("c", off.hash_prompt(tokens(2, 3)), 3 * BS + 1) == 0
        await settle(off)
        assert tier_stats(off).blocks_read == 0


@pytest.mark.parametrize("corruption", ["flip", "truncate", "foreign", "garbage"])
async def test_corrupted_value_is_never_served(
    redis_url: str, prefix: str, corruption: str
) -> None:
    kv = make_kv()
    async with KVOffloader(config([redis_tier(redis_url, prefix)]), kv) as off:
        prompt = tokens(3, 4)
        hashes = await compute_and_store(off, kv, "a", prompt, range(4))
        await compute_and_store(off, kv, "x", tokens(4, 1), range(4, 5))
        await settle(off)
        tier = off.tiers.tiers[0]  # type: ignore[union-attr]
        key = tier.key(hashes[2])  # type: ignore[attr-defined]
        client = redis_client(redis_url)
        value = bytearray(await client.get(key))
        if corruption == "flip":
            value[500] ^= 0x01
        elif corruption == "truncate":
            value = value[: len(value) // 2]
        elif corruption == "garbage":
            value = bytearray(b"\0" * len(value))
        else:  # a block of another namespace written under this key
            async with KVOffloader(config([redis_tier(redis_url, prefix)], model_id="b"), kv) as o2:
                other = await compute_and_store(o2, kv, "o", prompt, range(8, 12))
                await settle(o2)
                key2 = o2.tiers.tiers[0].key(other[2])  # type: ignore[union-attr]
                value = bytearray(await client.get(key2))
        await client.set(key, bytes(value))
        await off.reset()
        assert await lookup_load(off, kv, "b", prompt, range(10, 14)) == 2 * BS
        assert tier_stats(off).failed_checks == 1
        assert await client.exists(key) == 0
        await client.aclose()
        assert off.pool.get_cached(hashes[2]) is None
        check(off)


async def test_redis_stopped_and_started_again(own_redis: RedisServer, prefix: str) -> None:
    kv = make_kv()
    tiers = [redis_tier(own_redis.url, prefix, retry_initial_s=0.05, retry_max_s=0.2)]
    async with KVOffloader(config(tiers, num_cpu_blocks=32), kv) as off:
        await compute_and_store(off, kv, "a", tokens(5, 2), range(2))
        await settle(off)
        own_redis.stop()
        await compute_and_store(off, kv, "b", tokens(6, 2), range(2, 4))
        await off.drain()
        await wait_until(lambda: not tier_stats(off).healthy)
        # The engine keeps serving from the CPU pool, and lookups ignore the tier.
        assert await lookup_load(off, kv, "c", tokens(6, 2), range(4, 6)) == 2 * BS
        await compute_and_store(off, kv, "d", tokens(7, 2), range(6, 8))
        await off.drain()
        assert tier_stats(off).writes_skipped_unhealthy >= 2
        check(off)
        own_redis.start()  # empty: persistence is off
        await wait_until(lambda: tier_stats(off).healthy)
        await compute_and_store(off, kv, "e", tokens(8, 3), range(8, 11))
        await settle(off)
        await off.reset()
        assert await lookup_load(off, kv, "f", tokens(8, 3), range(12, 15)) == 3 * BS
        assert tier_stats(off).recoveries >= 1
        check(off)


async def test_paused_server_bounds_write_downs_and_loads_proceed(
    own_redis: RedisServer, prefix: str
) -> None:
    kv = make_kv()
    tiers = [redis_tier(own_redis.url, prefix, max_queued_writes=4, op_timeout_s=30)]
    async with KVOffloader(config(tiers, num_cpu_blocks=32), kv) as off:
        own_redis.pause()
        try:
            for i in range(4):
                await compute_and_store(
                    off, kv, f"s{i}", tokens(20 + i, 3), range(3 * i, 3 * i + 3)
                )
                await off.drain()
                stats = tier_stats(off)
                assert stats.writes_held <= 4
                check(off)
            stats = tier_stats(off)
            assert stats.max_writes_held == 4
            assert stats.writes_skipped_full == 12 - 4
            # Loads (CPU) proceed while the tier is stuck.
            assert await lookup_load(off, kv, "l", tokens(21, 3), range(20, 23)) == 3 * BS
        finally:
            own_redis.resume()
        await settle(off)
        assert tier_stats(off).blocks_written == 4
        assert tier_stats(off).healthy
        check(off)


async def test_timeouts_mark_the_tier_unhealthy_until_it_answers(
    own_redis: RedisServer, prefix: str
) -> None:
    kv = make_kv()
    tiers = [redis_tier(own_redis.url, prefix, op_timeout_s=0.3, retry_initial_s=0.05)]
    async with KVOffloader(config(tiers), kv) as off:
        own_redis.pause()
        try:
            await compute_and_store(off, kv, "a", tokens(30, 2), range(2))
            await off.drain()
            await wait_until(lambda: not tier_stats(off).healthy)
            assert "TimeoutError" in tier_stats(off).last_error
            assert off.pool.num_free == off.pool.num_blocks  # nothing held by the stuck tier
        finally:
            own_redis.resume()
        await wait_until(lambda: tier_stats(off).healthy)
        check(off)


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_on_trio_the_redis_tier_reports_why_it_cannot_run(prefix: str) -> None:
    pytest.importorskip("redis.asyncio")
    kv = make_kv()
    # No server is needed: the tier refuses before connecting.
    tiers = [redis_tier("redis://127.0.0.1:1/0", prefix, retry_initial_s=60, retry_max_s=60)]
    async with KVOffloader(config(tiers), kv) as off:
        stats = tier_stats(off)
        assert not stats.healthy
        assert "asyncio only" in stats.last_error
        prompt = tokens(40, 2)
        await compute_and_store(off, kv, "a", prompt, range(2))
        assert await lookup_load(off, kv, "b", prompt, range(2, 4)) == 2 * BS
