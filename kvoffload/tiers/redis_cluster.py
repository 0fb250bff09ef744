"""`RedisClusterTier`: one key per block on a Redis or Valkey cluster (``kvoffload[redis]``).

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
* Writes to one node hold at most ``max_writes_per_node`` pipelines; a write-down that
  finds them busy skips that node's blocks (counted), so a slow node cannot hold the
  others' writes.

A missing or unreadable block is a miss; `TierError` is raised only when no node of the
cluster can be used. Runs on asyncio (``redis.asyncio`` with the hiredis parser).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, final
from urllib.parse import unquote, urlsplit

try:
    from redis.asyncio.cluster import ClusterNode, RedisCluster
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff
    from redis.cluster import LoadBalancingStrategy
    from redis.exceptions import (
        AskError,
        ClusterDownError,
        MovedError,
        RedisError,
        ResponseError,
        TryAgainError,
    )
    from redis.exceptions import TimeoutError as RedisTimeoutError
except ImportError as exc:  # pragma: no cover - exercised without the extra
    raise ImportError(
        "kvoffload.tiers.redis_cluster needs the redis extra: pip install 'kvoffload[redis]'"
    ) from exc

import anyio

from kvoffload._logging import get_logger
from kvoffload.errors import TierError
from kvoffload.hashing import BlockHash
from kvoffload.tiers._cluster_nodes import BreakerState, NodeState
from kvoffload.tiers._redis_values import make_key_prefix, pack_values, redact, unpack_values
from kvoffload.tiers._threads import IoThreads
from kvoffload.tiers.base import BlockRead, BlockWrite

__all__ = ["RedisClusterTier"]

_log = get_logger("tiers.redis_cluster")

_MISS: Any = None


@dataclass(slots=True)
class _Batch:
    """The commands of one operation bound for one node."""

    node: ClusterNode
    state: NodeState
    positions: list[int] = field(default_factory=list)
    commands: list[tuple[Any, ...]] = field(default_factory=list)
    asking: bool = False
    holds_write_slot: bool = False


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
        max_writes_per_node: write pipelines in flight to one node (beyond: skipped).
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
        self._breaker = (breaker_failures, breaker_backoff_s, max(breaker_backoff_max_s, 0.0))
        self._refresh_interval = refresh_interval_s
        self._max_reads = max_reads_per_node
        self._max_writes = max_writes_per_node
        self._name = name
        self._client: RedisCluster | None = None
        self._nodes: dict[str, NodeState] = {}
        # Every ClusterNode a pipeline went to: the client drops nodes from its caches on a
        # refresh while their connections may still be open; close() closes them all.
        self._seen: dict[int, ClusterNode] = {}
        self._threads = IoThreads(threads, f"kvoffload-redis-cluster-{name}")
        self._closed = False
        self._rr = 0
        self._refresh_wanted = False
        self._last_refresh = 0.0
        # Reading from replicas, and the slot map names a shard without one (Redis lists
        # only replicas that hold data): ask again, once per interval.
        self._replicas_missing = False
        # Primary name -> its replicas in the last slot map that named any: Redis may leave
        # a replica out of CLUSTER SLOTS while its primary is unreachable, just when the
        # replica is wanted.
        self._known_replicas: dict[str, list[ClusterNode]] = {}
        # Tier-wide counters (the per-node ones live in NodeState).
        self._budget_exceeded = 0
        self._uncovered = 0
        self._refreshes = 0
        self._refresh_failures = 0
        self._writes_lost = 0
        self._ops = 0
        self._op_seconds = 0.0
        self._op_max_seconds = 0.0

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

    def _get_client(self) -> RedisCluster:
        if self._client is None:
            raise TierError(f"redis cluster tier {self._name!r} is not open")
        return self._client

    def node_state(self, name: str) -> NodeState:
        """The breaker and counters of node ``host:port`` (created on first use)."""
        state = self._nodes.get(name)
        if state is None:
            failures, backoff, backoff_max = self._breaker
            state = NodeState(
                name=name,
                failures_to_open=failures,
                backoff_initial_s=backoff,
                backoff_max_s=max(backoff_max, backoff),
                reads=anyio.Semaphore(self._max_reads),
                max_writes=self._max_writes,
                tier=self._name,
            )
            self._nodes[name] = state
        return state

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
        if self._client is None:
            self._client = self._make_client()
        try:
            await self._client.initialize()
        except RedisError as exc:
            raise TierError(
                f"redis cluster tier {self._name!r}: no slot map from the startup nodes: {exc}"
            ) from exc
        self._last_refresh = time.monotonic()
        self._mapped()
        await self._warm_up()

    async def _warm_up(self) -> None:
        """Open one connection to every node the tier may read from, so that the first
        lookups do not spend their budget on connecting (failures are left to the
        breakers)."""
        client = self._get_client()
        nodes = client.get_nodes() if self._replicas else client.get_primaries()

        async def one(node: ClusterNode) -> None:
            self._seen.setdefault(id(node), node)
            with contextlib.suppress(RedisError, OSError):
                await node.execute_command("PING")

        # Within the write budget, which op_timeout_s exceeds: a paused node cannot make
        # the open itself time out.
        with anyio.move_on_after(self._write_budget):
            async with anyio.create_task_group() as tg:
                for node in nodes:
                    tg.start_soon(one, node)

    def _mapped(self) -> None:
        """The slot map was (re)loaded."""
        if self._replicas and self._client is not None:
            shards = {id(v): v for v in self._client.nodes_manager.slots_cache.values()}
            self._replicas_missing = any(len(nodes) < 2 for nodes in shards.values())
            for nodes in shards.values():
                if len(nodes) > 1:
                    self._known_replicas[nodes[0].name] = list(nodes[1:])

    async def ping(self) -> None:
        """Refresh the slot map and ``PING`` every primary; close the breakers of those
        that answer.

        Raises:
            TierError: no primary answered.
        """
        client = self._get_client()
        try:
            await client.nodes_manager.initialize()
            self._refreshes += 1
            self._mapped()
        except RedisError as exc:
            self._refresh_failures += 1
            raise TierError(f"redis cluster tier {self._name!r}: no slot map: {exc}") from exc
        finally:
            self._last_refresh = time.monotonic()
        answered = 0

        async def one(node: ClusterNode) -> None:
            nonlocal answered
            self._seen.setdefault(id(node), node)
            try:
                await node.execute_command("PING")
            except (RedisError, OSError):
                return
            self.node_state(node.name).reset_breaker()
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
        client, self._client = self._client, None
        self._threads.shutdown()
        if client is not None:
            try:
                await client.aclose()
            finally:
                with anyio.CancelScope(shield=True):
                    for node in self._seen.values():
                        for connection in list(node._connections):
                            await connection.disconnect(nowait=True)
                self._seen.clear()

    # -- routing ---------------------------------------------------------------------------

    def _route(
        self, keys: Sequence[bytes], *, read: bool, advance: bool = False
    ) -> tuple[dict[str, _Batch], list[NodeState]]:
        """Group keys by the node that serves them; returns the batches and, per key whose
        node's breaker is open, that node (its key is a miss).

        With replica reads the shard's nodes take turns; a probe and the read after it go
        to the same node (only a read, ``advance``, moves the turn on), so a replica that
        lags its primary does not turn a probe's hit into a read miss."""
        client = self._get_client()
        slots = client.nodes_manager.slots_cache
        keyslot = client.keyslot
        use_replicas = read and self._replicas
        turn = self._rr
        if advance and use_replicas:
            self._rr += 1
        allowed: dict[str, bool] = {}
        batches: dict[str, _Batch] = {}
        skipped: list[NodeState] = []
        for position, key in enumerate(keys):
            nodes = slots.get(keyslot(key))
            if not nodes:
                self._uncovered += 1
                continue
            if use_replicas and len(nodes) == 1:
                nodes = [*nodes, *self._known_replicas.get(nodes[0].name, ())]
            if use_replicas and len(nodes) > 1:
                at = turn % len(nodes)
                candidates = [*nodes[at:], *nodes[:at]]
            else:
                candidates = nodes[:1]
            chosen = None
            for node in candidates:
                ok = allowed.get(node.name)
                if ok is None:
                    ok = allowed[node.name] = self.node_state(node.name).allow()
                if ok:
                    chosen = node
                    break
            if chosen is None:
                state = self.node_state(candidates[0].name)
                state.skipped_open += 1
                skipped.append(state)
                continue
            batch = batches.get(chosen.name)
            if batch is None:
                batch = batches[chosen.name] = _Batch(chosen, self.node_state(chosen.name))
            batch.positions.append(position)
        # A probe that was taken but routed nothing (every key went elsewhere) is given back.
        for name, ok in allowed.items():
            state = self._nodes[name]
            if ok and name not in batches and state.state is BreakerState.HALF_OPEN:
                state.probing = False
        return batches, skipped

    def _check_any_node(self, batches: Mapping[str, _Batch], n: int) -> None:
        """Raise `TierError` when keys were asked for and no node of the cluster is usable."""
        if batches or not n:
            return
        client = self._get_client()
        primaries = client.get_primaries()
        if not primaries or all(
            self.node_state(p.name).state is BreakerState.OPEN for p in primaries
        ):
            raise TierError(
                f"redis cluster tier {self._name!r}: no usable node "
                f"({len(primaries)} primaries, every breaker open)"
            )

    # -- running pipelines -----------------------------------------------------------------

    async def _execute(
        self, batches: dict[str, _Batch], budget_s: float, *, read: bool, n: int
    ) -> tuple[list[Any], list[NodeState | None]]:
        """Run every batch's pipeline at once within ``budget_s`` and follow redirections
        once. Returns one reply per position (a value, or ``None``: a miss) and the node
        that gave it."""
        replies: list[Any] = [_MISS] * n
        served: list[NodeState | None] = [None] * n
        running: dict[int, tuple[NodeState, float]] = {}
        start = time.perf_counter()
        with anyio.move_on_after(budget_s) as scope:
            async with anyio.create_task_group() as tg:
                # Beside the pipelines, not before them: a refresh stuck on a sick startup
                # node costs this operation its budget, never the healthy nodes' replies.
                sick = self._refresh_due()
                if sick is not None:
                    tg.start_soon(self._refresh, sick or None)
                redirected = await self._round(batches, replies, served, running, read=read)
                if redirected:
                    await self._round(redirected, replies, served, running, read=read, last=True)
        if scope.cancelled_caught:
            self._budget_exceeded += 1
            now = time.perf_counter()
            for state, began in running.values():
                state.failed(now - began, "budget ran out", timeout=True)
                self._refresh_wanted = True
        seconds = time.perf_counter() - start
        self._ops += 1
        self._op_seconds += seconds
        self._op_max_seconds = max(self._op_max_seconds, seconds)
        return replies, served

    async def _round(
        self,
        batches: Mapping[str, _Batch],
        replies: list[Any],
        served: list[NodeState | None],
        running: dict[int, tuple[NodeState, float]],
        *,
        read: bool,
        last: bool = False,
    ) -> dict[str, _Batch]:
        redirected: dict[str, _Batch] = {}

        async def one(batch: _Batch) -> None:
            got = await self._pipeline(batch, running, read=read)
            if got is None:
                return
            for position, command, reply in zip(batch.positions, batch.commands, got, strict=True):
                if isinstance(reply, AskError) and not last:  # MovedError is an AskError
                    await self._redirect(reply, batch, position, command, redirected)
                elif isinstance(reply, (ClusterDownError, TryAgainError)):
                    batch.state.cluster_down += 1
                    self._refresh_wanted = True
                elif isinstance(reply, ResponseError):
                    batch.state.last_error = str(reply)
                else:
                    replies[position] = reply
                    served[position] = batch.state

        async with anyio.create_task_group() as tg:
            for batch in batches.values():
                tg.start_soon(one, batch)
        return redirected

    async def _redirect(
        self,
        error: AskError,
        batch: _Batch,
        position: int,
        command: tuple[Any, ...],
        redirected: dict[str, _Batch],
    ) -> None:
        client = self._get_client()
        batch.state.redirections += 1
        if isinstance(error, MovedError):
            await client.nodes_manager.move_slot(error)
        target = client.nodes_manager.get_node(host=error.host, port=error.port)
        if target is None:
            return
        state = self.node_state(target.name)
        if state.state is not BreakerState.CLOSED:
            state.skipped_open += 1
            return
        asking = not isinstance(error, MovedError)
        key = f"{target.name}|{asking}"
        again = redirected.get(key)
        if again is None:
            again = redirected[key] = _Batch(target, state, asking=asking)
        again.positions.append(position)
        again.commands.append(command)

    async def _pipeline(
        self, batch: _Batch, running: dict[int, tuple[NodeState, float]], *, read: bool
    ) -> list[Any] | None:
        """Send a batch's commands on one connection of its node; read every reply.

        Returns:
            The replies (an error reply is its exception), or ``None`` if the node failed
            (counted against its breaker). A cancelled pipeline's connection is closed,
            so a late reply is never read as another command's.
        """
        state = batch.state
        self._seen.setdefault(id(batch.node), batch.node)
        commands: list[tuple[Any, ...]] = []
        for command in batch.commands:
            if batch.asking:
                commands.append((b"ASKING",))
            commands.append(command)
        if read:
            await state.reads.acquire()
        token = id(batch)
        began = time.perf_counter()
        running[token] = (state, began)
        try:
            connection = batch.node.acquire_connection()
            try:
                await connection.send_packed_command(
                    connection.pack_commands(commands), check_health=False
                )
                got: list[Any] = []
                for _ in commands:
                    try:
                        got.append(await connection.read_response())
                    except ResponseError as exc:
                        got.append(exc)
            except BaseException:
                with anyio.CancelScope(shield=True):
                    await connection.disconnect(nowait=True)
                raise
            finally:
                batch.node.release(connection)
        except (RedisError, OSError) as exc:
            running.pop(token, None)
            state.failed(
                time.perf_counter() - began,
                f"{type(exc).__name__}: {exc}",
                timeout=isinstance(exc, RedisTimeoutError),
            )
            self._refresh_wanted = True
            return None
        else:
            running.pop(token, None)
            state.succeeded(time.perf_counter() - began)
            return got[1::2] if batch.asking else got
        finally:
            if read:
                state.reads.release()
            # A node's write slot is free once its own pipeline ended, not when the
            # slowest node of the batch did.
            self._release_write_slot(batch)

    @staticmethod
    def _release_write_slot(batch: _Batch) -> None:
        if batch.holds_write_slot:
            batch.holds_write_slot = False
            batch.state.writes_in_flight -= 1

    def _refresh_due(self) -> str | None:
        """Whether to refresh the slot map now (a node failed or a breaker is open, and the
        interval passed): ``None`` if not, else the name of a node to ask last ("" if none)."""
        sick = [s.name for s in self._nodes.values() if s.state is not BreakerState.CLOSED]
        now = time.monotonic()
        wanted = self._refresh_wanted or self._replicas_missing or sick
        if not wanted or now - self._last_refresh < self._refresh_interval:
            return None
        self._last_refresh = now
        self._refresh_wanted = False
        return sick[0] if sick else ""

    async def _refresh(self, ask_last: str | None) -> None:
        """Ask the startup nodes for the slot map (the one with an open breaker last)."""
        try:
            await self._get_client().nodes_manager.initialize(last_failed_node_name=ask_last)
        except RedisError as exc:
            self._refresh_failures += 1
            self._refresh_wanted = True
            _log.debug("slot_map_refresh_failed", tier=self._name, error=repr(exc))
        except BaseException:
            self._refresh_wanted = True
            raise
        else:
            self._refreshes += 1
            self._mapped()

    # -- the SecondaryTier operations ------------------------------------------------------

    async def _read(
        self, keys: list[bytes], verb: bytes
    ) -> tuple[list[Any], list[NodeState | None]]:
        batches, _ = self._route(keys, read=True, advance=verb == b"GET")
        self._check_any_node(batches, len(keys))
        for batch in batches.values():
            batch.commands = [(verb, keys[p]) for p in batch.positions]
        return await self._execute(batches, self._lookup_budget, read=True, n=len(keys))

    async def exists(self, block_hashes: Sequence[BlockHash]) -> int:
        """The leading run of ``block_hashes`` whose keys exist (one pipeline per node)."""
        if not block_hashes:
            return 0
        found, _ = await self._read([self.key(h) for h in block_hashes], b"EXISTS")
        n = 0
        for present in found:
            if not present:
                break
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
        values: list[bytes | None] = [r if isinstance(r, bytes) else None for r in replies]
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

        Blocks of a node whose breaker is open, or whose write pipelines are all busy,
        are skipped; writes still running when the write budget ends are lost (each is
        one ``SET``: present whole or absent).

        Returns:
            Blocks the nodes acknowledged.
        """
        if not blocks:
            return 0
        keys = [self.key(b.block_hash) for b in blocks]
        batches, _ = self._route(keys, read=False)
        self._check_any_node(batches, len(keys))
        taken: dict[str, _Batch] = {}
        for name, batch in batches.items():
            state = batch.state
            if state.writes_in_flight >= state.max_writes:
                state.writes_skipped_busy += len(batch.positions)
                if state.state is BreakerState.HALF_OPEN:
                    state.probing = False
                continue
            state.writes_in_flight += 1
            batch.holds_write_slot = True
            taken[name] = batch
        try:
            if not taken:
                return 0
            order = [p for batch in taken.values() for p in batch.positions]
            values = await self._threads.run(pack_values, [blocks[p] for p in order])
            value_of = dict(zip(order, values, strict=True))
            ex: tuple[Any, ...] = (b"EX", self._ttl) if self._ttl else ()
            for batch in taken.values():
                batch.commands = [(b"SET", keys[p], value_of[p], *ex) for p in batch.positions]
            replies, _ = await self._execute(taken, self._write_budget, read=False, n=len(keys))
        finally:
            for batch in taken.values():
                self._release_write_slot(batch)
        stored = 0
        for batch in taken.values():
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
        batches, _ = self._route(keys, read=False)
        for batch in batches.values():
            batch.commands = [(b"DEL", keys[p]) for p in batch.positions]
        await self._execute(batches, self._lookup_budget, read=False, n=len(keys))

    # -- observation -----------------------------------------------------------------------

    def statistics(self) -> Mapping[str, int | float | str | bool]:
        """Tier-wide figures, then ``node.<host:port>.<figure>`` for every node seen
        (hits, misses, timeouts, breaker trips and state, redirections, bytes, latency)."""
        states = list(self._nodes.values())
        out: dict[str, int | float | str | bool] = {
            "startup_nodes": ",".join(redact(u) for u in self._urls),
            "key_prefix": self._prefix.decode(),
            "ttl_s": self._ttl or 0,
            "read_from_replicas": self._replicas,
            "lookup_budget_ms": round(self._lookup_budget * 1000, 3),
            "write_budget_ms": round(self._write_budget * 1000, 3),
            "nodes": len(states),
            "nodes_breaker_open": sum(s.state is not BreakerState.CLOSED for s in states),
            "budget_exceeded": self._budget_exceeded,
            "uncovered_keys": self._uncovered,
            "slot_map_refreshes": self._refreshes,
            "slot_map_refresh_failures": self._refresh_failures,
            "writes_lost": self._writes_lost,
            "operations": self._ops,
            "operation_seconds": self._op_seconds,
            "operation_max_seconds": self._op_max_seconds,
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
            "writes_skipped_busy",
            "bytes_read",
            "bytes_written",
        ):
            out[figure] = sum(getattr(s, figure) for s in states)
        for state in sorted(states, key=lambda s: s.name):
            for figure, value in state.figures().items():
                out[f"node.{state.name}.{figure}"] = value
        return out
