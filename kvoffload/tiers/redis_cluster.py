"""`RedisClusterTier`: one key per block on a Redis or Valkey cluster (the ``redis`` extra).

The blocks, keys, namespacing, prefix and expiry are the single-node tier's (`RedisTier`):
one ``SET`` per block whose value is the header followed by the payload, so a write a
failover lost is absent, never half there. What the cluster adds is routing and a bounded
cost for a sick node:

* Each batch is split by hash slot (``keyslot``) onto the nodes of the client's slot map,
  and each node gets one pipeline per batch, all nodes at once.
* Every node has a circuit breaker: ``breaker_failures`` consecutive failures (an error,
  a timeout, the budget running out while the node was still busy) open it, and while it
  is open the node's keys are misses at once; after a backoff one operation probes it.
* A lookup operation (probe, read, delete) waits at most ``lookup_budget_ms`` for the
  nodes, a write-down batch at most ``write_budget_ms``; nodes still busy then are
  cancelled and their keys are misses (or lost writes), counted as timeouts.
* ``MOVED`` updates the slot map for that slot and the command is sent once more to the
  new owner; ``ASK`` is followed once with ``ASKING``; ``CLUSTERDOWN``/``TRYAGAIN`` are
  misses. The whole slot map is refreshed at most once per ``refresh_interval_ms``, when
  a node failed or a breaker is open, inside the operation's budget. The client itself
  never retries.
* Writes to one node hold at most ``max_writes_per_node`` pipelines; a write-down whose
  node has none free waits for one (``write_waits``), node by node and within the write
  budget, so a burst is written as the pipelines free up and a slow node holds only its
  own blocks, never the other nodes' writes. What bounds the writes is the manager's
  write-down queue (``max_queued_writes``): a write-down is skipped only when it is full.
* A ``GET`` reply that is an error (a key of another type: ``WRONGTYPE``) is a miss for
  that key alone; the key is deleted and counted (``bad_replies``), the single-node
  tier's rule (`sort_replies()`).

A missing or unreadable block is a miss; `TierError` is raised only when no node of the
cluster can be used. Runs on asyncio (``redis.asyncio`` with the hiredis parser).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from typing import Any, final
from urllib.parse import unquote, urlsplit

from kvoffload._extras import needs_extra

try:
    from redis.asyncio.cluster import ClusterNode, RedisCluster
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff
    from redis.cluster import LoadBalancingStrategy
    from redis.exceptions import RedisError
except ImportError as exc:  # pragma: no cover - exercised without the extra
    raise ImportError(needs_extra("kvoffload.tiers.redis_cluster", "redis")) from exc

import anyio

from kvoffload._logging import get_logger
from kvoffload.errors import TierError
from kvoffload.hashing import BlockHash
from kvoffload.tier_config import redact_url as redact
from kvoffload.tiers._cluster_nodes import BreakerState, NodeState
from kvoffload.tiers._cluster_routing import ClusterRouter
from kvoffload.tiers._redis_values import (
    make_key_prefix,
    pack_values,
    sort_replies,
    unpack_values,
)
from kvoffload.tiers._threads import IoThreads
from kvoffload.tiers.base import BlockRead, BlockWrite

__all__ = ["RedisClusterTier"]

_log = get_logger("tiers.redis_cluster")


@final
class RedisClusterTier:
    """A `SecondaryTier` on a Redis Cluster (Redis 7) or a Valkey 8 cluster.

    Args:
        startup_nodes: ``redis://[user:password@]host:port`` of some nodes.
        block_nbytes: size of one block's payload.
        namespace: the 32-byte namespace digest (part of every key).
        key_prefix: prefix of every key.
        ttl_s: expiry of each key in seconds (``None``: none).
        read_from_replicas: read from replicas too (round robin per operation), and from a
            replica while its primary's breaker is open.
        node_timeout_s: socket connect and read timeout of one node.
        lookup_budget_s: longest one probe, read or delete waits for the nodes.
        write_budget_s: longest one write-down batch waits for the nodes.
        breaker_failures: consecutive failures that open a node's breaker.
        breaker_backoff_s: wait before an open breaker's first probe.
        breaker_backoff_max_s: longest wait between probes.
        refresh_interval_s: shortest time between slot map refreshes.
        max_reads_per_node: read pipelines in flight to one node.
        max_writes_per_node: write pipelines in flight to one node (beyond: they wait).
        threads: worker threads that build and unpack values.
        name: the name in statistics and logs.
    """

    def __init__(
        self,
        startup_nodes: Sequence[str],
        *,
        block_nbytes: int,
        namespace: bytes,
        key_prefix: str = "kvoffload:",
        ttl_s: int | None = None,
        read_from_replicas: bool = False,
        node_timeout_s: float = 0.2,
        lookup_budget_s: float = 0.05,
        write_budget_s: float = 1.0,
        breaker_failures: int = 3,
        breaker_backoff_s: float = 0.5,
        breaker_backoff_max_s: float = 10.0,
        refresh_interval_s: float = 1.0,
        max_reads_per_node: int = 4,
        max_writes_per_node: int = 2,
        threads: int = 4,
        name: str = "redis-cluster",
    ) -> None:
        if not startup_nodes:
            raise TierError(f"redis cluster tier {name!r}: no startup nodes")
        self._urls = tuple(startup_nodes)
        self._nbytes = block_nbytes
        self._prefix = make_key_prefix(key_prefix, namespace)
        self._ttl = ttl_s
        self._replicas = read_from_replicas
        self._node_timeout = node_timeout_s
        self._lookup_budget = lookup_budget_s
        self._write_budget = write_budget_s
        self._max_reads = max_reads_per_node
        self._max_writes = max_writes_per_node
        self._name = name
        self._router = ClusterRouter(
            name=name,
            read_from_replicas=read_from_replicas,
            breaker=(breaker_failures, breaker_backoff_s, max(breaker_backoff_max_s, 0.0)),
            refresh_interval_s=refresh_interval_s,
            max_reads_per_node=max_reads_per_node,
            max_writes_per_node=max_writes_per_node,
            warm_up_s=write_budget_s,
        )
        self._threads = IoThreads(threads, f"kvoffload-redis-cluster-{name}")
        self._closed = False
        self._writes_lost = 0
        self._bad_replies = 0

    def __repr__(self) -> str:
        nodes = ",".join(redact(u) for u in self._urls)
        return f"RedisClusterTier(name={self._name!r}, startup_nodes={nodes!r})"

    @property
    def name(self) -> str:
        """The tier's name."""
        return self._name

    def key(self, block_hash: BlockHash) -> bytes:
        """The key a block is stored under."""
        return self._prefix + block_hash.hex().encode()

    def node_state(self, name: str) -> NodeState:
        """The breaker and counters of node ``host:port`` (created on first use)."""
        return self._router.node_state(name)

    def _get_client(self) -> RedisCluster:
        return self._router.get_client()

    # -- lifecycle -------------------------------------------------------------------------

    def _make_client(self) -> RedisCluster:
        nodes = []
        username = password = None
        ssl = False
        for url in self._urls:
            parts = urlsplit(url)
            if parts.hostname is None or parts.port is None:
                raise TierError(f"redis cluster tier {self._name!r}: bad url {redact(url)!r}")
            nodes.append(ClusterNode(parts.hostname, parts.port))
            username = username or (unquote(parts.username) if parts.username else None)
            password = password or (unquote(parts.password) if parts.password else None)
            ssl = ssl or parts.scheme == "rediss"
        per_node = self._max_reads + self._max_writes + 2
        return RedisCluster(
            startup_nodes=nodes,
            username=username,
            password=password,
            ssl=ssl,
            require_full_coverage=False,
            # Only so that connections send READONLY (reads from replicas); the tier
            # picks the node of each key itself.
            load_balancing_strategy=LoadBalancingStrategy.ROUND_ROBIN if self._replicas else None,
            max_connections=per_node,
            retry=Retry(NoBackoff(), 0),
            socket_timeout=self._node_timeout,
            socket_connect_timeout=self._node_timeout,
            socket_keepalive=True,
        )

    async def open(self) -> None:
        """Create the client and learn the slot map from a startup node.

        Raises:
            TierError: the event loop is not asyncio's (trio), or no startup node answered
                with a slot map (the manager retries with backoff).
        """
        try:
            asyncio.get_running_loop()
        except RuntimeError as exc:
            raise TierError(
                f"redis cluster tier {self._name!r} runs on asyncio only (redis.asyncio); "
                "this event loop is not asyncio's"
            ) from exc
        if self._router.client is None:
            self._router.client = self._make_client()
        try:
            await self._router.client.initialize()
        except RedisError as exc:
            raise TierError(
                f"redis cluster tier {self._name!r}: no slot map from the startup nodes: {exc}"
            ) from exc
        self._router.last_refresh = time.monotonic()
        self._router.mapped()
        await self._router.warm_up()

    async def ping(self) -> None:
        """Refresh the slot map and ``PING`` every primary; close the breakers of those
        that answer.

        Raises:
            TierError: no primary answered.
        """
        client = self._router.get_client()
        try:
            await client.nodes_manager.initialize()
            self._router.refreshes += 1
            self._router.mapped()
        except RedisError as exc:
            self._router.refresh_failures += 1
            raise TierError(f"redis cluster tier {self._name!r}: no slot map: {exc}") from exc
        finally:
            self._router.last_refresh = time.monotonic()
        answered = 0

        async def one(node: ClusterNode) -> None:
            nonlocal answered
            self._router.seen.setdefault(id(node), node)
            try:
                await node.execute_command("PING")
            except (RedisError, OSError):
                return
            self._router.node_state(node.name).reset_breaker()
            answered += 1

        async with anyio.create_task_group() as tg:
            for node in client.get_primaries():
                tg.start_soon(one, node)
        if not answered:
            raise TierError(f"redis cluster tier {self._name!r}: no primary answered PING")

    async def close(self) -> None:
        """Close every node's connections. Idempotent."""
        if self._closed:
            return
        self._closed = True
        client, self._router.client = self._router.client, None
        self._threads.shutdown()
        if client is not None:
            try:
                await client.aclose()
            finally:
                with anyio.CancelScope(shield=True):
                    for node in self._router.seen.values():
                        for connection in list(node._connections):
                            await connection.disconnect(nowait=True)
                self._router.seen.clear()

    # -- the SecondaryTier operations ------------------------------------------------------

    async def _read(
        self, keys: list[bytes], verb: bytes
    ) -> tuple[list[Any], list[NodeState | None]]:
        batches, _ = self._router.route(keys, read=True, advance=verb == b"GET")
        self._router.check_any_node(batches, len(keys))
        for batch in batches.values():
            batch.commands = [(verb, keys[p]) for p in batch.positions]
        return await self._router.execute(batches, self._lookup_budget, read=True, n=len(keys))

    async def exists(self, block_hashes: Sequence[BlockHash]) -> int:
        """The leading run of ``block_hashes`` whose keys exist (one pipeline per node)."""
        if not block_hashes:
            return 0
        found, _ = await self._read([self.key(h) for h in block_hashes], b"EXISTS")
        n = 0
        for present in found:
            if present is not True and not (type(present) is int and present > 0):
                break  # 0, a miss (a node that did not answer) or an error reply
            n += 1
        return n

    async def get(
        self, block_hashes: Sequence[BlockHash], into: Sequence[memoryview]
    ) -> list[BlockRead | None]:
        """``GET`` blocks (one pipeline per node) and copy their payloads into ``into``.

        A key on a node that failed, timed out or whose breaker is open is a miss, like a
        missing key. A cancelled call may have written any part of the buffers.
        """
        if len(block_hashes) != len(into):
            raise ValueError(f"{len(block_hashes)} hashes but {len(into)} buffers")
        if not block_hashes:
            return []
        keys = [self.key(h) for h in block_hashes]
        replies, served = await self._read(keys, b"GET")
        values, bad = sort_replies(self._name, keys, replies)
        if bad:
            # The single-node tier's rule: each such key is a miss, deleted and counted.
            self._bad_replies += len(bad)
            try:
                await self.delete([block_hashes[p] for p in bad])
            except (RedisError, OSError, TierError) as exc:  # the next read finds it again
                _log.warning("redis_bad_key_not_deleted", tier=self._name, error=repr(exc))
        for value, state in zip(values, served, strict=True):
            if state is None:
                continue  # not answered: counted as the node's timeout, error or skip
            if value is None:
                state.misses += 1
            else:
                state.hits += 1
                state.bytes_read += len(value)
        return await self._threads.run(unpack_values, values, into)

    async def put(self, blocks: Sequence[BlockWrite]) -> int:
        """``SET`` each block (header and payload as one value), one pipeline per primary.

        Blocks of a node whose breaker is open are skipped; a node whose write pipelines
        are all busy is waited for (the other nodes' blocks go meanwhile); writes not
        done when the write budget ends, waiting or running, are lost (each is one
        ``SET``: present whole or absent). The manager counts the blocks not stored
        (``writes_dropped``).

        Returns:
            Blocks the nodes acknowledged.
        """
        if not blocks:
            return 0
        keys = [self.key(b.block_hash) for b in blocks]
        batches, _ = self._router.route(keys, read=False)
        self._router.check_any_node(batches, len(keys))
        if not batches:
            return 0
        order = [p for batch in batches.values() for p in batch.positions]
        values = await self._threads.run(pack_values, [blocks[p] for p in order])
        value_of = dict(zip(order, values, strict=True))
        ex: tuple[Any, ...] = (b"EX", self._ttl) if self._ttl else ()
        for batch in batches.values():
            batch.write = True
            batch.commands = [(b"SET", keys[p], value_of[p], *ex) for p in batch.positions]
        try:
            replies, _ = await self._router.execute(
                batches, self._write_budget, read=False, n=len(keys)
            )
        finally:
            for batch in batches.values():
                self._router.release_write_slot(batch)
        stored = 0
        for batch in batches.values():
            for p in batch.positions:
                if replies[p] in (b"OK", "OK", True):
                    stored += 1
                    batch.state.blocks_written += 1
                    batch.state.bytes_written += len(value_of[p])
                else:
                    self._writes_lost += 1
        return stored

    async def delete(self, block_hashes: Sequence[BlockHash]) -> None:
        """``DEL`` the blocks' keys on their primaries (within the lookup budget)."""
        if not block_hashes:
            return
        keys = [self.key(h) for h in block_hashes]
        batches, _ = self._router.route(keys, read=False)
        for batch in batches.values():
            batch.commands = [(b"DEL", keys[p]) for p in batch.positions]
        await self._router.execute(batches, self._lookup_budget, read=False, n=len(keys))

    # -- observation -----------------------------------------------------------------------

    def statistics(self) -> Mapping[str, int | float | str | bool]:
        """Tier-wide figures (``bad_replies``: keys of another type, each a miss and
        deleted), then ``node.<host:port>.<figure>`` for every node seen (hits, misses,
        timeouts, breaker trips and state, redirections, write waits, bytes, latency)."""
        states = list(self._router.nodes.values())
        out: dict[str, int | float | str | bool] = {
            "startup_nodes": ",".join(redact(u) for u in self._urls),
            "key_prefix": self._prefix.decode(),
            "ttl_s": self._ttl or 0,
            "read_from_replicas": self._replicas,
            "lookup_budget_ms": round(self._lookup_budget * 1000, 3),
            "write_budget_ms": round(self._write_budget * 1000, 3),
            "nodes": len(states),
            "nodes_breaker_open": sum(s.state is not BreakerState.CLOSED for s in states),
            "budget_exceeded": self._router.budget_exceeded,
            "uncovered_keys": self._router.uncovered,
            "slot_map_refreshes": self._router.refreshes,
            "slot_map_refresh_failures": self._router.refresh_failures,
            "writes_lost": self._writes_lost,
            "bad_replies": self._bad_replies,
            "operations": self._router.ops,
            "operation_seconds": self._router.op_seconds,
            "operation_max_seconds": self._router.op_max_seconds,
        }
        for figure in (
            "hits",
            "misses",
            "timeouts",
            "errors",
            "cluster_down",
            "breaker_trips",
            "redirections",
            "skipped_open",
            "write_waits",
            "bytes_read",
            "bytes_written",
        ):
            out[figure] = sum(getattr(s, figure) for s in states)
        for state in sorted(states, key=lambda s: s.name):
            for figure, value in state.figures().items():
                out[f"node.{state.name}.{figure}"] = value
        return out
