"""The ``redis-cluster`` kind of ``python -m kvoffload.bench tier``."""

from __future__ import annotations

import argparse
import sys
import uuid
from collections.abc import Sequence

from kvoffload.bench._tier_common import NS, against_bare_redis
from kvoffload.hashing import BlockHash

__all__ = ["redis_cluster"]


async def redis_cluster(
    args: argparse.Namespace,
    nbytes: int,
    hashes: Sequence[BlockHash],
    src: Sequence[memoryview],
    dst: Sequence[memoryview],
) -> list[tuple[str, float, float, float]]:
    """`RedisClusterTier` against a bare pipelined ``RedisCluster``, same bytes, same run."""
    from redis.asyncio.cluster import RedisCluster  # noqa: PLC0415 - optional extra

    from kvoffload.tiers.redis_cluster import RedisClusterTier  # noqa: PLC0415

    urls = [u.strip() for u in args.startup_nodes.split(",") if u.strip()]
    n = len(hashes)
    prefix = f"kvoffload-bench:{uuid.uuid4().hex[:8]}:"
    budget_s = args.budget_ms / 1000
    tier = RedisClusterTier(
        urls,
        block_nbytes=nbytes,
        namespace=NS,
        key_prefix=prefix + "tier:",
        node_timeout_s=budget_s,
        lookup_budget_s=budget_s,
        write_budget_s=budget_s,
        max_reads_per_node=args.concurrency,
        max_writes_per_node=args.concurrency,
        threads=args.concurrency,
    )
    await tier.open()
    bare = RedisCluster.from_url(urls[0], max_connections=args.concurrency + 2)
    await bare.initialize()
    keys = [f"{prefix}bare:{i}".encode() for i in range(n)]
    keys2 = [f"{prefix}bare2:{i}".encode() for i in range(n)]

    async def reset() -> None:
        async with bare.pipeline(transaction=False) as pipe:
            for key in (*keys, *keys2):
                pipe.delete(key)
            await pipe.execute()
        await tier.delete(hashes)

    try:
        rows = await against_bare_redis(
            args,
            n,
            nbytes,
            tier=tier,
            bare=bare,
            keys=(keys, keys2),
            hashes=hashes,
            src=src,
            dst=dst,
            reset=reset,
        )
        stats = tier.statistics()
        print(
            f"# redis-cluster: {stats['nodes']} nodes, timeouts={stats['timeouts']} "
            f"budget_exceeded={stats['budget_exceeded']}",
            file=sys.stderr,
        )
    finally:
        await reset()
        await bare.aclose()
        await tier.close()
    return rows
