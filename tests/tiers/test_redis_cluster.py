"""RedisClusterTier on real six-node clusters: sharing, namespaces, corruption, faults."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Mapping

import anyio
import pytest
from anyio.from_thread import start_blocking_portal
from cluster_helpers import RedisClusterProcs, command
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, rule, run_state_machine_as_test
from test_tier_state_machine import TierMachine
from tier_helpers import (
    BS,
    REDIS_SERVER_ENV,
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

pytestmark = [pytest.mark.anyio, pytest.mark.redis_cluster]

Factory = Callable[..., RedisClusterProcs]


def cluster_tier(urls: list[str], prefix: str, **kw: object) -> dict[str, object]:
    values: dict[str, object] = {
        "kind": "redis-cluster",
        "startup_nodes": urls,
        "key_prefix": prefix,
        # Room for a busy CI host: these tests check what is served, not a sick node's cost.
        "lookup_budget_ms": 1000,
    }
    values.update(kw)
    return values


@pytest.fixture
def prefix() -> str:
    return f"kvtest:{uuid.uuid4().hex[:12]}:"


def cluster_tier_class():  # type: ignore[no-untyped-def]
    return pytest.importorskip("kvoffload.tiers.redis_cluster").RedisClusterTier


def node_figures(stats: Mapping[str, object], figure: str) -> dict[str, object]:
    """``{host:port: value}`` of one per-node figure, for the nodes where it is not 0."""
    suffix = f".{figure}"
    return {
        name[len("node.") : -len(suffix)]: value
        for name, value in stats.items()
        if name.startswith("node.") and name.endswith(suffix) and value
    }


def pipelines(tier: object) -> dict[str, int]:
    per_node = node_figures(tier.statistics(), "pipelines")  # type: ignore[attr-defined]
    return {"total": sum(int(v) for v in per_node.values()), "nodes": len(per_node)}  # type: ignore[call-overload]


async def test_the_cluster_runs_the_server_asked_for(redis_cluster_urls: list[str]) -> None:
    from redis.asyncio.cluster import RedisCluster  # noqa: PLC0415

    client = RedisCluster.from_url(redis_cluster_urls[0])
    try:
        info = await client.info("server", target_nodes=RedisCluster.RANDOM)
        cluster_info = await client.cluster_info(target_nodes=RedisCluster.RANDOM)
    finally:
        await client.aclose()
    assert cluster_info["cluster_state"] == "ok"
    assert int(cluster_info["cluster_size"]) == 3
    if os.environ.get(REDIS_SERVER_ENV, "redis-server") == "valkey-server":
        assert info.get("server_name") == "valkey", info
        assert int(str(info["valkey_version"]).split(".")[0]) >= 8
    else:
        assert "valkey_version" not in info, info
        assert int(str(info["redis_version"]).split(".")[0]) >= 7


async def test_put_get_exists_delete_and_ttl_over_every_primary(
    redis_cluster_urls: list[str], prefix: str
) -> None:
    ns = b"\7" * 32
    n = 48
    hashes = [BlockHash(bytes([i]) * 32) for i in range(n)]
    data = [bytes([i + 1]) * 1024 for i in range(n)]
    tier = cluster_tier_class()(
        redis_cluster_urls, block_nbytes=1024, namespace=ns, key_prefix=prefix, ttl_s=60
    )
    await tier.open()
    try:
        writes = [
            BlockWrite(h, encode_header(ns, h, d), memoryview(bytearray(d)))
            for h, d in zip(hashes[:-1], data, strict=False)
        ]
        assert await tier.put(writes) == n - 1
        # One pipeline per primary for the whole batch, not one round trip per block.
        assert pipelines(tier) == {"total": 3, "nodes": 3}
        assert await tier.exists(hashes) == n - 1
        assert pipelines(tier) == {"total": 6, "nodes": 3}
        assert await tier.exists([hashes[-1], hashes[0]]) == 0
        bufs = [memoryview(bytearray(1024)) for _ in range(n)]
        reads = await tier.get(hashes, bufs)
        assert reads[-1] is None
        for i in range(n - 1):
            read = reads[i]
            assert read is not None
            assert read.payload_length == 1024
            assert read.payload_checksum == checksum(data[i])
            assert bytes(bufs[i]) == data[i]
        stats = tier.statistics()
        # The keys spread over every primary: each served hits, in one pipeline per batch.
        assert len(node_figures(stats, "hits")) == 3, stats
        assert stats["hits"] == n - 1
        assert stats["misses"] == 1
        assert stats["timeouts"] == 0
        assert stats["breaker_trips"] == 0
        await tier.delete(hashes)
        assert await tier.exists(hashes) == 0
    finally:
        await tier.close()


def the_tier(off: KVOffloader):  # type: ignore[no-untyped-def]
    tiers = off.tiers
    assert tiers is not None
    return tiers.tiers[0]


def owner(off: KVOffloader, block_hash: BlockHash) -> str:
    """``host:port`` of the primary the tier's slot map names for a block's key."""
    tier = the_tier(off)
    client = tier._get_client()
    return str(client.nodes_manager.slots_cache[client.keyslot(tier.key(block_hash))][0].name)


def port_of(name: str) -> int:
    return int(name.rsplit(":", 1)[1])


def fault_tier(urls: list[str], prefix: str, **kw: object) -> dict[str, object]:
    """A tier that notices faults and recoveries quickly (tests only)."""
    values: dict[str, object] = {
        "refresh_interval_ms": 100,
        "breaker_failures": 2,
        "breaker_backoff_ms": 100,
        "breaker_backoff_max_ms": 200,
        "retry_initial_s": 0.05,
        "retry_max_s": 0.2,
        "lookup_budget_ms": 250,
    }
    values.update(kw)
    return cluster_tier(urls, prefix, **values)


async def load_again(off: KVOffloader, kv: list, rid: str, prompt: list[int], gpu: range) -> int:
    """Drop the CPU cache and load ``prompt`` (through the tier): the tokens loaded."""
    await settle(off)
    await off.reset()
    return await lookup_load(off, kv, rid, prompt, gpu)


async def until_hit(
    off: KVOffloader, kv: list, prompt: list[int], gpu: range, want: int, deadline_s: float = 40
) -> None:
    """Poll (bounded) until a load from the tier returns ``want`` tokens."""
    with anyio.fail_after(deadline_s):
        while await load_again(off, kv, f"poll-{uuid.uuid4().hex[:8]}", prompt, gpu) != want:
            await anyio.sleep(0.1)


async def test_two_offloaders_share_the_cluster_and_namespaces_stay_apart(
    redis_cluster_urls: list[str], prefix: str
) -> None:
    n = 24  # keys on every primary (all on two of three: 3 * (2/3)**24 < 2e-5)
    tiers = [cluster_tier(redis_cluster_urls, prefix)]
    kv_a, kv_b = make_kv(), make_kv()
    prompt = tokens(1, n)
    async with (
        KVOffloader(config(tiers, model_id="m", num_cpu_blocks=32), kv_a) as a,
        KVOffloader(config(tiers, model_id="m", num_cpu_blocks=32), kv_b) as b,
    ):
        await compute_and_store(a, kv_a, "a", prompt, range(n))
        await settle(a)
        assert tier_stats(a).blocks_written == n
        assert len(node_figures(tier_stats(a).details, "blocks_written")) == 3
        # The other offloader (its own pool, its own GPU KV) loads it bit-exact.
        assert await lookup_load(b, kv_b, "b", prompt, range(n)) == n * BS
        stats = tier_stats(b)
        assert stats.blocks_promoted == n
        assert stats.failed_checks == 0
        assert len(node_figures(stats.details, "hits")) == 3
        check(a)
        check(b)
    async with KVOffloader(config(tiers, model_id="other", num_cpu_blocks=32), kv_b) as c:
        assert await lookup_load(c, kv_b, "c", prompt, range(n)) == 0
        await settle(c)
        assert tier_stats(c).blocks_read == 0


@pytest.mark.parametrize("n", [48, 112])
async def test_a_burst_that_fits_the_queue_is_written_whole_for_a_second_offloader(
    redis_cluster_urls: list[str], prefix: str, n: int
) -> None:
    # The defaults, except a queue that holds the larger burst: 16-block batches, seven
    # writers, two write pipelines per node. Three batches at once used to find a node's
    # two pipelines busy and skip a third of the blocks.
    tiers = [cluster_tier(redis_cluster_urls, prefix, max_queued_writes=max(64, n))]
    prompt = tokens(70 + n, n)
    kv_a = make_kv(num_blocks=n)
    async with KVOffloader(config(tiers, num_cpu_blocks=n + 8), kv_a) as a:
        await compute_and_store(a, kv_a, "w", prompt, range(n))
        await settle(a)
        stats = tier_stats(a)
        assert stats.blocks_written == n
        assert stats.writes_skipped_full == 0
        assert stats.writes_dropped == 0
        assert stats.writes_failed == 0
        assert stats.details["writes_lost"] == 0
        assert len(node_figures(stats.details, "blocks_written")) == 3
        check(a)
    # A second offloader, state of its own (pool, tier client, GPU KV), the same cluster.
    kv_b = make_kv(num_blocks=n)
    async with KVOffloader(config(tiers, num_cpu_blocks=n + 8), kv_b) as b:
        hashes = b.hash_prompt(prompt)
        assert b.lookup("t", hashes, len(prompt), allow_defer=True) is None  # promoting
        await settle(b)
        b.finish("t")
        assert await lookup_load(b, kv_b, "r", prompt, range(n)) == n * BS  # bit-exact
        stats = tier_stats(b)
        assert stats.blocks_promoted == n
        assert stats.failed_checks == 0
        check(b)


async def test_a_full_write_queue_skips_and_counts_in_the_statistics_and_metrics(
    redis_cluster_urls: list[str], prefix: str
) -> None:
    from prometheus_client import CollectorRegistry, generate_latest  # noqa: PLC0415

    from kvoffload.metrics import OffloaderCollector  # noqa: PLC0415

    n = 48
    tiers = [cluster_tier(redis_cluster_urls, prefix, max_queued_writes=8)]
    kv = make_kv(num_blocks=n)
    async with KVOffloader(config(tiers, num_cpu_blocks=n + 8), kv) as off:
        await compute_and_store(off, kv, "w", tokens(80, n), range(n))
        await settle(off)
        stats = tier_stats(off)
        # One store of 48 blocks meets a queue of 8: 40 skipped, counted, 8 written.
        assert stats.writes_skipped_full == n - 8
        assert stats.blocks_written == 8
        assert stats.writes_dropped == 0
        assert stats.max_writes_held == 8
        registry = CollectorRegistry()
        registry.register(OffloaderCollector(off.statistics))
        text = generate_latest(registry).decode()
        labels = 'kind="redis-cluster",tier="redis-cluster0"'
        assert f"kvoffload_tier_writes_skipped_full_total{{{labels}}} 40.0" in text, text
        assert f"kvoffload_tier_writes_dropped_total{{{labels}}} 0.0" in text
        check(off)


async def test_per_node_figures_reach_the_prometheus_collector(
    redis_cluster_urls: list[str], prefix: str
) -> None:
    from prometheus_client import CollectorRegistry, generate_latest  # noqa: PLC0415

    from kvoffload.metrics import OffloaderCollector  # noqa: PLC0415

    kv = make_kv()
    async with KVOffloader(config([cluster_tier(redis_cluster_urls, prefix)]), kv) as off:
        prompt = tokens(5, 6)
        await compute_and_store(off, kv, "a", prompt, range(6))
        await settle(off)
        assert await load_again(off, kv, "b", prompt, range(6, 12)) == 6 * BS
        registry = CollectorRegistry()
        registry.register(OffloaderCollector(off.statistics))
        text = generate_latest(registry).decode()
        details = tier_stats(off).details
        for node, hits in node_figures(details, "hits").items():
            sample = (
                f'kvoffload_tier_detail{{detail="node.{node}.hits",kind="redis-cluster",'
                f'tier="redis-cluster0"}} {float(hits)}'
            )
            assert sample in text, (sample, text[:2000])
        assert 'detail="budget_exceeded"' in text


async def test_a_corrupted_value_on_one_node_is_never_served_and_is_deleted(
    redis_cluster_urls: list[str], prefix: str
) -> None:
    from redis.asyncio.cluster import RedisCluster  # noqa: PLC0415

    kv = make_kv()
    async with KVOffloader(config([cluster_tier(redis_cluster_urls, prefix)]), kv) as off:
        prompt = tokens(3, 4)
        hashes = await compute_and_store(off, kv, "a", prompt, range(4))
        await settle(off)
        key = the_tier(off).key(hashes[2])
        client = RedisCluster.from_url(redis_cluster_urls[0])
        try:
            value = bytearray(await client.get(key))
            value[500] ^= 0x01  # one bit of the payload, in place on its node
            await client.set(key, bytes(value))
            await off.reset()
            assert await lookup_load(off, kv, "b", prompt, range(10, 14)) == 2 * BS
            assert tier_stats(off).failed_checks == 1
            assert await client.exists(key) == 0
        finally:
            await client.aclose()
        assert off.pool.get_cached(hashes[2]) is None
        check(off)


async def test_a_key_of_another_type_is_a_miss_deleted_and_counted_on_the_tier(
    redis_cluster_urls: list[str], prefix: str
) -> None:
    from redis.asyncio.cluster import RedisCluster  # noqa: PLC0415

    ns = b"\6" * 32
    hashes = [BlockHash(bytes([i + 90]) * 32) for i in range(3)]
    data = [bytes([i + 1]) * 1024 for i in range(3)]
    tier = cluster_tier_class()(
        redis_cluster_urls, block_nbytes=1024, namespace=ns, key_prefix=prefix
    )
    await tier.open()
    client = RedisCluster.from_url(redis_cluster_urls[0])
    try:
        writes = [
            BlockWrite(h, encode_header(ns, h, d), memoryview(bytearray(d)))
            for h, d in zip(hashes, data, strict=True)
        ]
        assert await tier.put([writes[0], writes[2]]) == 2
        await client.rpush(tier.key(hashes[1]), b"not a block")  # a list, not a string
        bufs = [memoryview(bytearray(1024)) for _ in range(3)]
        reads = await tier.get(hashes, bufs)
        assert reads[1] is None
        assert reads[0] is not None
        assert bytes(bufs[0]) == data[0]
        assert reads[2] is not None
        assert bytes(bufs[2]) == data[2]
        assert await client.exists(tier.key(hashes[1])) == 0  # deleted
        assert tier.statistics()["bad_replies"] == 1
        assert await tier.get([hashes[1]], bufs[1:2]) == [None]  # a plain miss now
        assert tier.statistics()["bad_replies"] == 1
    finally:
        await client.aclose()
        await tier.close()


async def test_a_key_of_another_type_ends_the_deferral_and_the_hit_stops_at_it(
    redis_cluster_urls: list[str], prefix: str
) -> None:
    from redis.asyncio.cluster import RedisCluster  # noqa: PLC0415

    kv = make_kv()
    async with KVOffloader(config([cluster_tier(redis_cluster_urls, prefix)]), kv) as off:
        prompt = tokens(4, 4)
        hashes = await compute_and_store(off, kv, "a", prompt, range(4))
        await settle(off)
        key = the_tier(off).key(hashes[2])
        client = RedisCluster.from_url(redis_cluster_urls[0])
        try:
            await client.delete(key)
            await client.rpush(key, b"x")  # a list under block 2's key
            await off.reset()
            answers = []
            for _ in range(20):
                answers.append(off.lookup("b", hashes, len(prompt), allow_defer=True))
                if answers[-1] is not None:
                    break
                await settle(off)
            # Block 2 is a miss: the first lookup waits for the promotion of 0..1 (and
            # finds 2 bad), the next one answers the promoted run; it never asks again
            # forever.
            assert answers[-1] == 2 * BS, answers
            assert await client.exists(key) == 0
        finally:
            await client.aclose()
        off.release("b")
        stats = tier_stats(off)
        assert stats.details["bad_replies"] == 1
        assert stats.blocks_promoted == 3  # the blocks before and after the foreign key
        assert stats.healthy
        assert stats.errors == 0
        assert off.statistics().scheduler.deferrals_bounded == 0  # ended by the fix itself
        off.finish("b")
        check(off)


async def test_settings_reach_the_tier_and_need_an_op_timeout_above_the_budgets() -> None:
    from kvoffload.errors import ConfigError  # noqa: PLC0415

    urls = ["redis://user:secret@127.0.0.1:7000"]
    kv = make_kv()
    off = KVOffloader(config([cluster_tier(urls, "p:", lookup_budget_ms=20)]), kv)
    assert off is not None
    with pytest.raises(ConfigError, match="op_timeout_s"):
        config([cluster_tier(urls, "p:", write_budget_ms=5000, op_timeout_s=2)])
    with pytest.raises(ConfigError, match="host and a port"):
        config([cluster_tier(["redis://127.0.0.1"], "p:")])
    tier = cluster_tier_class()(urls, block_nbytes=1024, namespace=b"\0" * 32)
    assert "secret" not in repr(tier)
    assert "secret" not in str(tier.statistics())


def split_at_other_owner(off: KVOffloader, hashes: list[BlockHash]) -> tuple[int, str]:
    """The first block whose primary differs from block 0's, and that primary."""
    first = owner(off, hashes[0])
    for i, block_hash in enumerate(hashes):
        if owner(off, block_hash) != first:
            return i, owner(off, block_hash)
    pytest.fail("every block on one primary")  # 3 * (1/3)**(n-1): does not happen


async def test_a_paused_primary_costs_its_breaker_failures_then_misses_at_once(
    own_cluster_factory: Factory, prefix: str
) -> None:
    # No failover during the pause: the cluster's node timeout is longer than the test.
    cluster = own_cluster_factory(node_timeout_ms=60_000)
    kv = make_kv()
    n = 16
    # A paused node never answers: without the budget every operation aimed at it would
    # wait for node_timeout_ms (10 s) and run past op_timeout_s (2 s), marking the whole
    # tier unhealthy. The budget ends each operation first; after breaker_failures
    # timeouts the node's keys are misses at once, with no request sent (backoff 60 s).
    tiers = [
        fault_tier(
            cluster.urls,
            prefix,
            node_timeout_ms=10_000,
            op_timeout_s=2,
            lookup_budget_ms=200,
            write_budget_ms=200,
            breaker_backoff_ms=60_000,
            breaker_backoff_max_ms=60_000,
        )
    ]
    async with KVOffloader(config(tiers, num_cpu_blocks=32), kv) as off:
        prompt = tokens(10, n)
        hashes = await compute_and_store(off, kv, "a", prompt, range(n))
        await settle(off)
        k, sick = split_at_other_owner(off, hashes)
        cluster.pause(port_of(sick))
        try:
            for i in range(5):
                # Served from the healthy nodes: the leading run before the sick node's block.
                assert await load_again(off, kv, f"p{i}", prompt, range(n, 2 * n)) == k * BS
            await compute_and_store(off, kv, "w", tokens(11, n), range(n))
            await settle(off)
            details = tier_stats(off).details
            node = f"node.{sick}."
            assert details[node + "breaker_open"] is True
            assert details[node + "breaker_trips"] == 1
            assert details[node + "timeouts"] == 2  # breaker_failures, then no request
            assert details[node + "skipped_open"] >= 3
            assert details["budget_exceeded"] >= 2
            # The sick node's blocks of the second store were not written: counted.
            assert tier_stats(off).writes_dropped >= 1
            healthy = [name for name in node_figures(details, "hits") if name != sick]
            assert healthy
            stats = tier_stats(off)
            assert stats.healthy
            assert stats.errors == 0  # op_timeout_s never ran out
            assert stats.failed_checks == 0
            check(off)
        finally:
            cluster.resume(port_of(sick))
    # After the resume a fresh offloader (breaker closed) reads every block again.
    async with KVOffloader(config(tiers, num_cpu_blocks=32), kv) as off:
        await until_hit(off, kv, prompt, range(n), n * BS)
        assert tier_stats(off).failed_checks == 0


async def test_a_paused_node_comes_back_through_the_half_open_probe(
    own_cluster_factory: Factory, prefix: str
) -> None:
    cluster = own_cluster_factory(node_timeout_ms=60_000)
    kv = make_kv()
    n = 16
    tiers = [fault_tier(cluster.urls, prefix, node_timeout_ms=10_000, op_timeout_s=2)]
    async with KVOffloader(config(tiers, num_cpu_blocks=32), kv) as off:
        prompt = tokens(12, n)
        hashes = await compute_and_store(off, kv, "a", prompt, range(n))
        await settle(off)
        k, sick = split_at_other_owner(off, hashes)
        cluster.pause(port_of(sick))
        try:
            for i in range(3):
                assert await load_again(off, kv, f"p{i}", prompt, range(n, 2 * n)) == k * BS
            await wait_until(lambda: tier_stats(off).details[f"node.{sick}.breaker_trips"] >= 1)
        finally:
            cluster.resume(port_of(sick))
        await until_hit(off, kv, prompt, range(n, 2 * n), n * BS)
        details = tier_stats(off).details
        assert details[f"node.{sick}.breaker_open"] is False
        # Each failed probe reopened the breaker after one timeout, never more.
        trips = int(details[f"node.{sick}.breaker_trips"])
        assert details[f"node.{sick}.timeouts"] == 2 + trips - 1
        stats = tier_stats(off)
        assert stats.errors == 0
        assert stats.failed_checks == 0
        check(off)


def first_missing(off: KVOffloader, port: int, hashes: list[BlockHash], sick: str) -> int:
    """The first block the dead primary ``sick`` owned whose key node ``port`` (its
    promoted replica) does not hold; ``len(hashes)`` when it holds them all."""
    tier = the_tier(off)
    for i, block_hash in enumerate(hashes):
        if owner(off, block_hash) not in (sick, f"127.0.0.1:{port}"):
            continue
        reply = command(port, "EXISTS", tier.key(block_hash).decode())
        assert reply in (b":0\r\n", b":1\r\n"), reply  # a primary's answer, not MOVED
        if reply == b":0\r\n":
            return i
    return len(hashes)


@pytest.mark.parametrize("synced", [True, False])
async def test_a_primary_killed_fails_over_and_its_slots_return(
    own_cluster_factory: Factory, prefix: str, synced: bool
) -> None:
    cluster = own_cluster_factory(node_timeout_ms=1000)
    kv = make_kv()
    n = 16
    tiers = [fault_tier(cluster.urls, prefix)]
    async with KVOffloader(config(tiers, num_cpu_blocks=32), kv) as off:
        prompt = tokens(20, n)
        hashes = await compute_and_store(off, kv, "a", prompt, range(n))
        await settle(off)
        k, sick = split_at_other_owner(off, hashes)
        replica = cluster.replica_of(port_of(sick))
        if synced:
            cluster.wait_replicas_synced()
            cluster.kill(port_of(sick))
        else:
            # The replica misses the last writes: paused, its link cut (a stopped
            # process still receives into its socket buffer, and would apply what it
            # got when resumed), the writes land, then its primary dies.
            cluster.pause(replica)
            assert command(port_of(sick), "CLIENT", "KILL", "TYPE", "replica") == b":1\r\n"
            prompt = tokens(21, n)
            hashes = await compute_and_store(off, kv, "b", prompt, range(n))
            await settle(off)
            k = next(i for i, h in enumerate(hashes) if owner(off, h) == sick)
            cluster.kill(port_of(sick))
            cluster.resume(replica)
        # While the cluster fails over: the engine is served from the CPU pool and the
        # healthy nodes; the dead primary's keys are misses, never errors.
        assert await load_again(off, kv, "during", prompt, range(n, 2 * n)) == k * BS
        await anyio.to_thread.run_sync(cluster.wait_ok)
        if synced:
            # Every key survived on the promoted replica: the whole prompt comes back.
            await until_hit(off, kv, prompt, range(n, 2 * n), n * BS)
        else:
            # The keys the failover lost are misses (never errors); stored again, they
            # hit again.
            await anyio.to_thread.run_sync(cluster.wait_promoted, replica)
            assert first_missing(off, replica, hashes, sick) == k  # the failover lost them
            await until_hit(off, kv, prompt, range(n, 2 * n), k * BS)
            # Stored again once the tier's slot map names the new primary (before, the
            # dead one's blocks are skipped: its breaker is open). Lookups refresh the
            # map; until then, and after, they still miss there.
            with anyio.fail_after(40):
                while owner(off, hashes[k]) != f"127.0.0.1:{replica}":
                    rid = f"map-{uuid.uuid4().hex[:8]}"
                    assert await load_again(off, kv, rid, prompt, range(n, 2 * n)) == k * BS
                    await anyio.sleep(0.1)
            await compute_and_store(off, kv, "again", prompt, range(n))
            await until_hit(off, kv, prompt, range(n, 2 * n), n * BS)
        details = tier_stats(off).details
        assert details["slot_map_refreshes"] >= 1
        assert owner(off, hashes[k]) == f"127.0.0.1:{replica}"
        stats = tier_stats(off)
        assert stats.healthy
        assert stats.errors == 0
        assert stats.failed_checks == 0
        check(off)


@pytest.mark.parametrize("full_coverage", [False, True])
async def test_a_shard_lost_whole_leaves_the_others_serving(
    own_cluster_factory: Factory, prefix: str, full_coverage: bool
) -> None:
    cluster = own_cluster_factory(node_timeout_ms=1000, full_coverage=full_coverage)
    kv = make_kv()
    n = 16
    tiers = [fault_tier(cluster.urls, prefix)]
    async with KVOffloader(config(tiers, num_cpu_blocks=32), kv) as off:
        prompt = tokens(30, n)
        hashes = await compute_and_store(off, kv, "a", prompt, range(n))
        await settle(off)
        k, sick = split_at_other_owner(off, hashes)
        replica = cluster.replica_of(port_of(sick))
        cluster.kill(replica)
        cluster.kill(port_of(sick))
        # With require-full-coverage the other nodes answer CLUSTERDOWN once they see
        # the shard fail; without it they keep serving their own slots.
        with anyio.fail_after(30):
            while True:
                hit = await load_again(
                    off, kv, f"lost-{uuid.uuid4().hex[:8]}", prompt, range(n, 2 * n)
                )
                assert hit <= k * BS
                if hit == (0 if full_coverage else k * BS) and (
                    not full_coverage or tier_stats(off).details["cluster_down"]
                ):
                    break
                await anyio.sleep(0.1)
        stats = tier_stats(off)
        assert stats.healthy
        assert stats.errors == 0
        # Back: the shard's nodes restart empty (no persistence), the cluster recovers,
        # and what is stored again hits again everywhere.
        cluster.restart(replica)
        cluster.restart(port_of(sick))
        await anyio.to_thread.run_sync(cluster.wait_ok)
        await compute_and_store(off, kv, "again", prompt, range(n))
        await until_hit(off, kv, prompt, range(n, 2 * n), n * BS)
        stats = tier_stats(off)
        assert stats.failed_checks == 0
        check(off)


# -- the tier state machine, on a cluster with a node fault ---------------------------------


class ClusterTierMachine(TierMachine):
    """`TierMachine` with a Redis Cluster tier: values corrupted in place on their node and
    nodes paused and resumed replace the disk tier's file faults."""

    cluster: RedisClusterProcs

    @initialize(cpu_blocks=st.integers(3, 10), queue=st.integers(1, 8))
    def setup(self, cpu_blocks: int, queue: int) -> None:  # type: ignore[override]
        self.prefix = f"kvsm:{uuid.uuid4().hex[:12]}:"
        self.paused: set[int] = set()
        tier = fault_tier(
            self.cluster.urls,
            self.prefix,
            max_queued_writes=queue,
            max_in_flight=2,
            max_batch_blocks=3,
            node_timeout_ms=5000,
            op_timeout_s=2,
            lookup_budget_ms=50,
            write_budget_ms=200,
            retry_initial_s=0.01,
            retry_max_s=0.02,
        )
        cfg = config([tier], num_cpu_blocks=cpu_blocks)
        self.portal_cm = start_blocking_portal("asyncio")
        self.portal = self.portal_cm.__enter__()
        self.off_cm = self.portal.wrap_async_context_manager(KVOffloader(cfg, self.kv))
        self.off = self.off_cm.__enter__()
        self.o.hints.clock = lambda: self.now  # the hint rules run on the machine's clock

    def teardown(self) -> None:
        for port in self.paused:
            self.cluster.resume(port)
        self.paused.clear()
        super().teardown()

    def corrupt_tier_block(self) -> None:  # type: ignore[override]
        """Not a rule here (the disk tier's file)."""

    def delete_tier_file(self) -> None:  # type: ignore[override]
        """Not a rule here (the disk tier's file)."""

    @rule(pick=st.integers(0, 1 << 30))
    def corrupt_cluster_value(self, pick: int) -> None:
        if self.paused:
            return
        self.call(settle, self.o)
        from redis.cluster import RedisCluster  # noqa: PLC0415

        client = RedisCluster.from_url(self.cluster.urls[0], socket_timeout=2)
        try:
            keys = sorted(client.scan_iter(match=f"{self.prefix}*", target_nodes="primaries"))
            if not keys:
                return
            key = keys[pick % len(keys)]
            value = client.get(key)
            if value is None:
                return
            data = bytearray(value)
            data[pick % len(data)] ^= 0x10  # header or payload
            client.set(key, bytes(data))
        finally:
            client.close()

    @rule(pick=st.integers(0, 5))
    def pause_node(self, pick: int) -> None:
        port = sorted(self.cluster.nodes)[pick]
        if port not in self.paused:
            self.cluster.pause(port)
            self.paused.add(port)

    @rule()
    def resume_nodes(self) -> None:
        for port in self.paused:
            self.cluster.resume(port)
        self.paused.clear()


def test_the_tier_state_machine_on_a_cluster(own_cluster_factory: Factory) -> None:
    # The nodes never fail over: a pause is shorter than the cluster's node timeout.
    ClusterTierMachine.cluster = own_cluster_factory(node_timeout_ms=60_000)
    run_state_machine_as_test(
        ClusterTierMachine,
        settings=settings(
            max_examples=8,
            stateful_step_count=15,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )


async def test_a_manual_failover_is_followed_through_moved(
    own_cluster_factory: Factory, prefix: str
) -> None:
    cluster = own_cluster_factory(node_timeout_ms=1000)
    kv = make_kv()
    n = 8
    # No refresh would come in time: the new owner is learnt from MOVED alone.
    tiers = [fault_tier(cluster.urls, prefix, refresh_interval_ms=3_600_000)]
    async with KVOffloader(config(tiers, num_cpu_blocks=32), kv) as off:
        prompt = tokens(40, n)
        hashes = await compute_and_store(off, kv, "a", prompt, range(n))
        await settle(off)
        old = owner(off, hashes[0])
        replica = cluster.replica_of(port_of(old))
        cluster.wait_replicas_synced()
        # A graceful failover: the replica takes the slots over, the old primary turns
        # replica and answers MOVED; the tier's slot map still names the old primary.
        assert b"+OK" in command(replica, "CLUSTER", "FAILOVER")
        with anyio.fail_after(30):
            while port_of(old) in await anyio.to_thread.run_sync(cluster.primaries):
                await anyio.sleep(0.05)
        await anyio.to_thread.run_sync(cluster.wait_ok)
        assert owner(off, hashes[0]) == old  # stale
        assert await load_again(off, kv, "b", prompt, range(n, 2 * n)) == n * BS
        details = tier_stats(off).details
        assert details[f"node.{old}.redirections"] >= 1
        assert owner(off, hashes[0]) == f"127.0.0.1:{replica}"
        assert details["slot_map_refreshes"] == 0
        stats = tier_stats(off)
        assert stats.errors == 0
        assert stats.failed_checks == 0


async def test_reads_from_replicas_and_from_a_replica_while_its_primary_is_paused(
    own_cluster_factory: Factory, prefix: str
) -> None:
    cluster = own_cluster_factory(node_timeout_ms=60_000)
    kv = make_kv()
    n = 16
    tiers = [
        fault_tier(
            cluster.urls,
            prefix,
            read_from_replicas=True,
            node_timeout_ms=10_000,
            op_timeout_s=2,
            lookup_budget_ms=500,  # room for new connections to the replicas on a busy host
            write_budget_ms=200,
            breaker_backoff_ms=60_000,
            breaker_backoff_max_ms=60_000,
        )
    ]
    async with KVOffloader(config(tiers, num_cpu_blocks=32), kv) as off:
        prompt = tokens(50, n)
        hashes = await compute_and_store(off, kv, "a", prompt, range(n))
        await settle(off)
        cluster.wait_replicas_synced()
        replicas = {f"127.0.0.1:{cluster.replica_of(port_of(owner(off, h)))}" for h in hashes}
        # Redis names a replica in CLUSTER SLOTS once it holds data: the tier asks again
        # until it sees them, and then every replica serves some of the reads (turns).
        with anyio.fail_after(30):
            while not replicas <= set(node_figures(tier_stats(off).details, "hits")):
                rid = f"r-{uuid.uuid4().hex[:8]}"
                assert await load_again(off, kv, rid, prompt, range(n, 2 * n)) <= n * BS
        await until_hit(off, kv, prompt, range(n, 2 * n), n * BS)
        # A primary paused: after its breaker opens, its keys are read from its replica.
        sick = owner(off, hashes[0])
        before = int(tier_stats(off).details[f"node.{sick}.timeouts"])
        cluster.pause(port_of(sick))
        try:
            with anyio.fail_after(30):
                while not tier_stats(off).details[f"node.{sick}.breaker_open"]:
                    await load_again(off, kv, f"s-{uuid.uuid4().hex[:8]}", prompt, range(n, 2 * n))
            got = await load_again(off, kv, "after", prompt, range(n, 2 * n))
            details = tier_stats(off).details
            assert got == n * BS, str(
                (
                    sick,
                    {k: v for k, v in details.items() if "latency" not in k and "bytes" not in k},
                )
            )
            assert details[f"node.{sick}.timeouts"] == before + 2  # breaker_failures
            stats = tier_stats(off)
            assert stats.errors == 0
            assert stats.failed_checks == 0
        finally:
            cluster.resume(port_of(sick))


def stored_on_owner(off: KVOffloader, block_hash: BlockHash) -> bool:
    """Whether a block's key exists on its primary (asked directly, not through the tier)."""
    key = the_tier(off).key(block_hash).decode()
    return command(port_of(owner(off, block_hash)), "EXISTS", key) == b":1\r\n"


async def test_a_slow_node_does_not_hold_the_other_nodes_writes(
    own_cluster_factory: Factory, prefix: str
) -> None:
    cluster = own_cluster_factory(node_timeout_ms=60_000)
    kv = make_kv()
    n = 12
    # One write pipeline per node, and a long write budget: a write to the paused node
    # holds that node's one slot for seconds.
    tiers = [
        fault_tier(
            cluster.urls,
            prefix,
            node_timeout_ms=20_000,
            write_budget_ms=20_000,
            op_timeout_s=30,
            max_writes_per_node=1,
            max_in_flight=4,
            breaker_failures=100,
        )
    ]
    async with KVOffloader(config(tiers, num_cpu_blocks=64), kv) as off:
        tier = the_tier(off)
        first = off.hash_prompt(tokens(60, n))
        sick = owner(off, first[0])
        cluster.pause(port_of(sick))
        try:
            await compute_and_store(off, kv, "a", tokens(60, n), range(n))
            await off.drain()
            healthy = [h for h in first if owner(off, h) != sick]
            assert healthy
            # The first write-down's pipelines to the healthy nodes are done (their write
            # slots free again) while the one to the paused node is stuck.
            await wait_until(
                lambda: (
                    tier.node_state(sick).writes_in_flight == 1
                    and all(tier.node_state(owner(off, h)).writes_in_flight == 0 for h in healthy)
                )
            )
            # The next write-down writes the others' blocks now; the busy node's wait
            # for its write slot.
            hashes = await compute_and_store(off, kv, "b", tokens(61, n), range(n))
            await off.drain()
            mine = [h for h in hashes if owner(off, h) == sick]
            others = [h for h in hashes if owner(off, h) != sick]
            assert mine
            assert others
            await wait_until(lambda: tier.node_state(sick).write_waits >= 1)
            # On their nodes while the first write still holds the sick node's slot.
            await wait_until(lambda: all(stored_on_owner(off, h) for h in others))
            assert tier.node_state(sick).writes_in_flight == 1  # still stuck
        finally:
            cluster.resume(port_of(sick))
        await settle(off)
        stats = tier_stats(off)
        # Once the node answers, its waiting blocks are written too: nothing skipped.
        assert stats.blocks_written == 2 * n
        assert stats.writes_dropped == 0
        assert stats.writes_skipped_full == 0
        assert stats.errors == 0
        check(off)


def test_the_tier_bench_runs_against_the_cluster(
    capsys: pytest.CaptureFixture[str], redis_cluster_urls: list[str]
) -> None:
    from kvoffload.bench.__main__ import main  # noqa: PLC0415

    argv = ["tier", "--kind", "redis-cluster", "--startup-nodes", ",".join(redis_cluster_urls)]
    assert main([*argv, "--block-kib", "64", "--total-mib", "1", "--reps", "1"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.startswith("redis-cluster ")]
    assert [(r[1], r[2]) for r in rows] == [("64Ki", "store"), ("64Ki", "load")]
    for row in rows:
        assert all(float(x) > 0 for x in row[3:6])
