"""RedisTier edge cases on real redis-servers: a key of another type under a block's key,
Unix sockets, a server whose value limit is below a block, and a password that must never
be printed."""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable

import pytest
from tier_helpers import (
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

from kvoffload.errors import ConfigError, TierError
from kvoffload.hashing import BlockHash
from kvoffload.offloader import KVOffloader
from kvoffload.tiers.base import BlockWrite
from kvoffload.tiers.format import encode_header

pytestmark = pytest.mark.anyio

NS = b"\5" * 32
PASSWORD = "s3cret-hunter2"


@pytest.fixture
def prefix() -> str:
    return f"kvedge:{uuid.uuid4().hex[:12]}:"


def redis_client(url: str):  # type: ignore[no-untyped-def]
    aioredis = pytest.importorskip("redis.asyncio")
    return aioredis.Redis.from_url(url)


def block(i: int, nbytes: int = 1024) -> tuple[BlockHash, bytes, BlockWrite]:
    h = BlockHash(bytes([i]) * 32)
    data = bytes([i + 1]) * nbytes
    return h, data, BlockWrite(h, encode_header(NS, h, data), memoryview(bytearray(data)))


def tier_class():  # type: ignore[no-untyped-def]
    return pytest.importorskip("kvoffload.tiers.redis").RedisTier


# -- a key of another type ----------------------------------------------------------------


async def test_a_key_of_another_type_is_a_miss_for_that_key_alone(
    redis_url: str, prefix: str
) -> None:
    tier = tier_class()(redis_url, block_nbytes=1024, namespace=NS, key_prefix=prefix)
    await tier.open()
    client = redis_client(redis_url)
    try:
        blocks = [block(i) for i in range(3)]
        assert await tier.put([blocks[0][2], blocks[2][2]]) == 2
        await client.rpush(tier.key(blocks[1][0]), b"not a block")  # a list, not a string
        bufs = [memoryview(bytearray(1024)) for _ in range(3)]
        reads = await tier.get([b[0] for b in blocks], bufs)
        assert reads[1] is None
        assert reads[0] is not None
        assert bytes(bufs[0]) == blocks[0][1]
        assert reads[2] is not None
        assert bytes(bufs[2]) == blocks[2][1]
        assert not await client.exists(tier.key(blocks[1][0]))  # deleted
        assert tier.statistics()["bad_replies"] == 1
        # The next read of that key is a plain miss, and nothing is counted again.
        assert (await tier.get([blocks[1][0]], bufs[1:2])) == [None]
        assert tier.statistics()["bad_replies"] == 1
    finally:
        await client.aclose()
        await tier.close()


async def test_a_foreign_key_keeps_the_tier_healthy_and_its_other_blocks_served(
    redis_url: str, prefix: str
) -> None:
    kv = make_kv()
    tier = {"kind": "redis", "url": redis_url, "key_prefix": prefix}
    client = redis_client(redis_url)
    try:
        async with KVOffloader(config([tier]), kv) as off:
            prompt = tokens(7, 4)
            hashes = await compute_and_store(off, kv, "s", prompt, range(4))
            await settle(off)
            assert tier_stats(off).blocks_written == 4
            redis_tier = off.tiers.tiers[0]  # type: ignore[union-attr]
            key = redis_tier.key(hashes[2])
            await client.delete(key)
            await client.rpush(key, b"x")
            await off.reset()
            assert await lookup_load(off, kv, "l", prompt, range(8, 12)) == 2 * 4
            await settle(off)
            stats = tier_stats(off)
            assert stats.healthy
            assert stats.writable
            assert stats.errors == 0
            # The blocks before and after the foreign key came back; the hit stops at it.
            assert stats.blocks_promoted == 3
            assert stats.details["bad_replies"] == 1
            assert not await client.exists(key)
            check(off)
    finally:
        await client.aclose()


# -- unix sockets and the value limit --------------------------------------------------------


async def test_a_unix_socket_url_connects(
    start_redis: Callable[..., RedisServer], prefix: str
) -> None:
    server = start_redis(unix_socket=True)
    assert server.url.startswith("unix://")
    tier = tier_class()(server.url, block_nbytes=1024, namespace=NS, key_prefix=prefix)
    await tier.open()
    try:
        h, data, write = block(1)
        assert await tier.put([write]) == 1
        buf = memoryview(bytearray(1024))
        (read,) = await tier.get([h], [buf])
        assert read is not None
        assert bytes(buf) == data
    finally:
        await tier.close()


async def test_a_block_above_the_servers_bulk_limit_is_refused_at_open(
    start_redis: Callable[..., RedisServer], prefix: str
) -> None:
    server = start_redis("--proto-max-bulk-len", "1mb")
    tier = tier_class()(server.url, block_nbytes=1 << 20, namespace=NS, key_prefix=prefix)
    try:
        with pytest.raises(TierError, match=r"1048672 bytes .* proto-max-bulk-len is 1048576"):
            await tier.open()
    finally:
        await tier.close()
    # A block that fits opens, and the limit is reported.
    small = tier_class()(server.url, block_nbytes=4096, namespace=NS, key_prefix=prefix)
    await small.open()
    try:
        assert small.statistics()["proto_max_bulk_len"] == 1 << 20
    finally:
        await small.close()


async def test_a_refused_write_is_named_when_config_is_refused(
    start_redis: Callable[..., RedisServer], prefix: str
) -> None:
    kv = make_kv(head_size=8 * 1024)  # 1 MiB blocks (and a header): larger than the server's limit
    server = start_redis("--proto-max-bulk-len", "1mb", "--rename-command", "CONFIG", "")
    tier = {
        "kind": "redis",
        "url": server.url,
        "key_prefix": prefix,
        "retry_initial_s": 0.02,
        "retry_max_s": 0.05,
    }
    async with KVOffloader(config([tier], num_cpu_blocks=8), kv) as off:
        await compute_and_store(off, kv, "s", tokens(3, 1), range(1))
        await settle(off)
        await wait_until(lambda: not tier_stats(off).writable)
        stats = tier_stats(off)
        assert "proto-max-bulk-len" in stats.last_error
        assert "1048672 bytes" in stats.last_error
        assert stats.healthy  # reads still go to it
        assert stats.details["write_refused"]
        await compute_and_store(off, kv, "t", tokens(4, 1), range(1, 2))
        await settle(off)
        stats = tier_stats(off)
        assert stats.blocks_written == 0
        assert stats.writes_skipped_unhealthy >= 1
        check(off)


# -- the password ------------------------------------------------------------------------------


def test_the_password_is_never_printed_by_the_config() -> None:
    url = f"redis://kv:{PASSWORD}@cache:6379/0?password={PASSWORD}"
    cfg = config([{"kind": "redis", "url": url}])
    settings = cfg.tiers[0]
    for text in (
        repr(cfg),
        str(cfg),
        repr(cfg.model_dump()),
        str(cfg.model_dump()),
        json.dumps(cfg.model_dump(mode="json")),
        cfg.model_dump_json(),
        repr(settings),
        str(settings),
        settings.model_dump_json(),
        str(settings.url),  # type: ignore[union-attr]
    ):
        assert PASSWORD not in text, text
        assert "cache:6379" in text or "**" in text, text
    assert "redis://kv:***@cache:6379/0" in cfg.model_dump_json()
    assert settings.url.get_secret_value() == url  # type: ignore[union-attr]


def test_a_cluster_node_password_is_never_printed_by_the_config() -> None:
    url = f"redis://kv:{PASSWORD}@node1:7000"
    cfg = config([{"kind": "redis-cluster", "startup_nodes": [url, "redis://node2:7001"]}])
    settings = cfg.tiers[0]
    for text in (
        repr(cfg),
        str(cfg),
        repr(cfg.model_dump()),
        json.dumps(cfg.model_dump(mode="json")),
        cfg.model_dump_json(),
        repr(settings),
        settings.model_dump_json(),
    ):
        assert PASSWORD not in text, text
    assert "redis://kv:***@node1:7000" in cfg.model_dump_json()
    assert [n.get_secret_value() for n in settings.startup_nodes] == [  # type: ignore[union-attr]
        url,
        "redis://node2:7001",
    ]
    with pytest.raises(ConfigError) as info:
        config([{"kind": "redis-cluster", "startup_nodes": [f"redis://kv:{PASSWORD}@node1"]}])
    assert PASSWORD not in str(info.value)
    assert "host and a port" in str(info.value)


def test_a_config_error_never_prints_the_password() -> None:
    from kvoffload.errors import ConfigError  # noqa: PLC0415

    url = f"redis://:{PASSWORD}@cache:6379/0"
    for bad in (
        [{"kind": "redis", "url": url, "retry_max_s": 0.1}],
        [{"kind": "redis", "url": url, "colour": 1}],
        [{"kind": "redis", "url": url, "name": "x"}, {"kind": "redis", "url": url, "name": "x"}],
        [{"kind": "redish", "url": url}],
    ):
        with pytest.raises(ConfigError) as info:
            config(bad)  # type: ignore[arg-type]
        chain = f"{info.value} {info.value.__cause__}"
        assert PASSWORD not in chain, chain
        assert "redis://:***@cache:6379/0" in str(info.value) or "colour" in str(info.value)


async def test_the_tier_authenticates_and_never_logs_the_password(
    start_redis: Callable[..., RedisServer], prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    server = start_redis("--requirepass", PASSWORD)
    good = server.url.replace("redis://", f"redis://:{PASSWORD}@")
    wrong = server.url.replace("redis://", "redis://:wrong-password@")
    kv = make_kv()
    with caplog.at_level(logging.DEBUG, logger="kvoffload"):
        async with KVOffloader(
            config([{"kind": "redis", "url": good, "key_prefix": prefix}]), kv
        ) as off:
            assert tier_stats(off).healthy
            await compute_and_store(off, kv, "s", tokens(5, 2), range(2))
            await settle(off)
            assert tier_stats(off).blocks_written == 2
            text = f"{off.tiers!r} {off.tiers.tiers!r} {off.statistics()!r}"  # type: ignore[union-attr]
            assert PASSWORD not in text
        tier = {"kind": "redis", "url": wrong, "key_prefix": prefix, "name": "wrong"}
        async with KVOffloader(config([tier]), kv) as off:
            stats = tier_stats(off)
            assert not stats.healthy
            assert stats.last_error
            assert "wrong-password" not in repr(off.statistics())
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "tier_unhealthy" in logged
    assert PASSWORD not in logged
    assert "wrong-password" not in logged
