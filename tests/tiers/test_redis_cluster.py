"""RedisClusterTier on real six-node clusters: sharing, namespaces, corruption, faults."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Mapping

import anyio
import pytest
from cluster_helpers import RedisClusterProcs
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
    values: dict[str, object] = {"kind": "redis-cluster", "startup_nodes": urls, "key_prefix": prefix}
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
