"""The cluster tier's routing: keys to nodes by hash slot, one pipeline per node, budgets.

`ClusterRouter` owns the ``RedisCluster`` client (its slot map and per-node connections),
the `NodeState` of every node (breaker, limits, counters) and the slot map refreshes;
`RedisClusterTier` builds commands and reads their replies. See ``redis_cluster.py``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, final

import anyio
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.exceptions import (
    AskError,
    ClusterDownError,
    MovedError,
    RedisError,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import TimeoutError as RedisTimeoutError

from kvoffload._logging import get_logger
from kvoffload.errors import TierError
from kvoffload.tiers._cluster_nodes import BreakerState, NodeState

__all__ = ["Batch", "ClusterRouter"]

_log = get_logger("tiers.redis_cluster")

_MISS: Any = None


@dataclass(slots=True)
class Batch:
    """The commands of one operation bound for one node."""

    node: ClusterNode
    state: NodeState
    positions: list[int] = field(default_factory=list)
    commands: list[tuple[Any, ...]] = field(default_factory=list)
    asking: bool = False
    write: bool = False  # a write-down's: its pipeline takes one of the node's write slots
    holds_write_slot: bool = False


@final
class ClusterRouter:
    """Routes one tier's keys to the cluster's nodes and runs their pipelines.

    Args:
        name: the tier's name (in errors and logs).
        read_from_replicas: reads may go to replicas.
        breaker: ``(failures to open, first backoff s, longest backoff s)``.
        refresh_interval_s: shortest time between slot map refreshes.
        max_reads_per_node: read pipelines in flight to one node.
        max_writes_per_node: write pipelines in flight to one node.
        warm_up_s: longest `warm_up()` waits.
    """

    def __init__(
        self,
        *,
        name: str,
        read_from_replicas: bool,
        breaker: tuple[int, float, float],
        refresh_interval_s: float,
        max_reads_per_node: int,
        max_writes_per_node: int,
        warm_up_s: float,
    ) -> None:
        self._name = name
        self._replicas = read_from_replicas
        self._breaker = breaker
        self._refresh_interval = refresh_interval_s
        self._max_reads = max_reads_per_node
        self._max_writes = max_writes_per_node
        self._write_budget = warm_up_s
        self.client: RedisCluster | None = None
        self.nodes: dict[str, NodeState] = {}
        # Every ClusterNode a pipeline went to: the client drops nodes from its caches on a
        # refresh while their connections may still be open; the tier's close closes them.
        self.seen: dict[int, ClusterNode] = {}
        self._rr = 0
        self._refresh_wanted = False
        self.last_refresh = 0.0
        # Reading from replicas, and the slot map names a shard without one (Redis lists
        # only replicas that hold data): ask again, once per interval.
        self._replicas_missing = False
        # Primary name -> its replicas in the last slot map that named any: Redis may leave
        # a replica out of CLUSTER SLOTS while its primary is unreachable, just when the
        # replica is wanted.
        self._known_replicas: dict[str, list[ClusterNode]] = {}
        self.budget_exceeded = 0
        self.uncovered = 0
        self.refreshes = 0
        self.refresh_failures = 0
        self.ops = 0
        self.op_seconds = 0.0
        self.op_max_seconds = 0.0

    def get_client(self) -> RedisCluster:
        if self.client is None:
            raise TierError(f"redis cluster tier {self._name!r} is not open")
        return self.client

    def node_state(self, name: str) -> NodeState:
        """The breaker and counters of node ``host:port`` (created on first use)."""
        state = self.nodes.get(name)
        if state is None:
            failures, backoff, backoff_max = self._breaker
            state = NodeState(
                name=name,
                failures_to_open=failures,
                backoff_initial_s=backoff,
                backoff_max_s=max(backoff_max, backoff),
                reads=anyio.Semaphore(self._max_reads),
                writes=anyio.Semaphore(self._max_writes),
                tier=self._name,
            )
            self.nodes[name] = state
        return state

    async def warm_up(self) -> None:
        """Open one connection to every node the tier may read from, so that the first
        lookups do not spend their budget on connecting (failures are left to the
        breakers)."""
        client = self.get_client()
        nodes = client.get_nodes() if self._replicas else client.get_primaries()

        async def one(node: ClusterNode) -> None:
            self.seen.setdefault(id(node), node)
            with contextlib.suppress(RedisError, OSError):
                await node.execute_command("PING")

        # Within the write budget, which op_timeout_s exceeds: a paused node cannot make
        # the open itself time out.
        with anyio.move_on_after(self._write_budget):
            async with anyio.create_task_group() as tg:
                for node in nodes:
                    tg.start_soon(one, node)

    def mapped(self) -> None:
        """The slot map was (re)loaded."""
        if self._replicas and self.client is not None:
            shards = {id(v): v for v in self.client.nodes_manager.slots_cache.values()}
            self._replicas_missing = any(len(nodes) < 2 for nodes in shards.values())
            for nodes in shards.values():
                if len(nodes) > 1:
                    self._known_replicas[nodes[0].name] = list(nodes[1:])

    def route(
        self, keys: Sequence[bytes], *, read: bool, advance: bool = False
    ) -> tuple[dict[str, Batch], list[NodeState]]:
        """Group keys by the node that serves them; returns the batches and, per key whose
        node's breaker is open, that node (its key is a miss).

        With replica reads the shard's nodes take turns; a probe and the read after it go
        to the same node (only a read, ``advance``, moves the turn on), so a replica that
        lags its primary does not turn a probe's hit into a read miss."""
        client = self.get_client()
        slots = client.nodes_manager.slots_cache
        keyslot = client.keyslot
        use_replicas = read and self._replicas
        turn = self._rr
        if advance and use_replicas:
            self._rr += 1
        allowed: dict[str, bool] = {}
        batches: dict[str, Batch] = {}
        skipped: list[NodeState] = []
        for position, key in enumerate(keys):
            nodes = slots.get(keyslot(key))
            if not nodes:
                self.uncovered += 1
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
                batch = batches[chosen.name] = Batch(chosen, self.node_state(chosen.name))
            batch.positions.append(position)
        # A probe that was taken but routed nothing (every key went elsewhere) is given back.
        for name, ok in allowed.items():
            state = self.nodes[name]
            if ok and name not in batches and state.state is BreakerState.HALF_OPEN:
                state.probing = False
        return batches, skipped

    def check_any_node(self, batches: Mapping[str, Batch], n: int) -> None:
        """Raise `TierError` when keys were asked for and no node of the cluster is usable."""
        if batches or not n:
            return
        client = self.get_client()
        primaries = client.get_primaries()
        if not primaries or all(
            self.node_state(p.name).state is BreakerState.OPEN for p in primaries
        ):
            raise TierError(
                f"redis cluster tier {self._name!r}: no usable node "
                f"({len(primaries)} primaries, every breaker open)"
            )

    async def execute(
        self, batches: dict[str, Batch], budget_s: float, *, read: bool, n: int
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
                sick = self.refresh_due()
                if sick is not None:
                    tg.start_soon(self._refresh, sick or None)
                redirected = await self._round(batches, replies, served, running, read=read)
                if redirected:
                    await self._round(redirected, replies, served, running, read=read, last=True)
        if scope.cancelled_caught:
            self.budget_exceeded += 1
            now = time.perf_counter()
            for state, began in running.values():
                state.failed(now - began, "budget ran out", timeout=True)
                self._refresh_wanted = True
        seconds = time.perf_counter() - start
        self.ops += 1
        self.op_seconds += seconds
        self.op_max_seconds = max(self.op_max_seconds, seconds)
        return replies, served

    async def _round(
        self,
        batches: Mapping[str, Batch],
        replies: list[Any],
        served: list[NodeState | None],
        running: dict[int, tuple[NodeState, float]],
        *,
        read: bool,
        last: bool = False,
    ) -> dict[str, Batch]:
        redirected: dict[str, Batch] = {}

        async def one(batch: Batch) -> None:
            got = await self._pipeline(batch, running, read=read)
            if got is None:
                return
            for position, command, reply in zip(batch.positions, batch.commands, got, strict=True):
                if isinstance(reply, AskError):  # MovedError is an AskError
                    if not last:  # redirected once at most: then a miss
                        await self._redirect(reply, batch, position, command, redirected)
                elif isinstance(reply, (ClusterDownError, TryAgainError)):
                    batch.state.cluster_down += 1
                    self._refresh_wanted = True
                else:
                    # An error reply (WRONGTYPE: a key of another type) is the key's own
                    # answer: the tier decides what it means (see `sort_replies()`).
                    if isinstance(reply, ResponseError):
                        batch.state.last_error = str(reply)
                    replies[position] = reply
                    served[position] = batch.state

        async with anyio.create_task_group() as tg:
            for batch in batches.values():
                tg.start_soon(one, batch)
        return redirected

    async def _redirect(
        self,
        error: AskError,
        batch: Batch,
        position: int,
        command: tuple[Any, ...],
        redirected: dict[str, Batch],
    ) -> None:
        client = self.get_client()
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
            again = redirected[key] = Batch(target, state, asking=asking)
        again.positions.append(position)
        again.commands.append(command)

    async def _pipeline(
        self, batch: Batch, running: dict[int, tuple[NodeState, float]], *, read: bool
    ) -> list[Any] | None:
        """Send a batch's commands on one connection of its node; read every reply.

        Returns:
            The replies (an error reply is its exception), or ``None`` if the node failed
            (counted against its breaker). A cancelled pipeline's connection is closed,
            so a late reply is never read as another command's.
        """
        state = batch.state
        self.seen.setdefault(id(batch.node), batch.node)
        commands: list[tuple[Any, ...]] = []
        for command in batch.commands:
            if batch.asking:
                commands.append((b"ASKING",))
            commands.append(command)
        if read:
            await state.reads.acquire()
        elif batch.write:
            # A write waits for one of the node's write slots (within the operation's
            # budget: still waiting when it ends, its blocks are not written, and the
            # node is not blamed for it).
            if state.writes.value == 0:
                state.write_waits += 1
            await state.writes.acquire()
            state.writes_in_flight += 1
            batch.holds_write_slot = True
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
            self.release_write_slot(batch)

    @staticmethod
    def release_write_slot(batch: Batch) -> None:
        if batch.holds_write_slot:
            batch.holds_write_slot = False
            batch.state.writes_in_flight -= 1
            batch.state.writes.release()

    def refresh_due(self) -> str | None:
        """Whether to refresh the slot map now (a node failed or a breaker is open, and the
        interval passed): ``None`` if not, else the name of a node to ask last ("" if none)."""
        sick = [s.name for s in self.nodes.values() if s.state is not BreakerState.CLOSED]
        now = time.monotonic()
        wanted = self._refresh_wanted or self._replicas_missing or sick
        if not wanted or now - self.last_refresh < self._refresh_interval:
            return None
        self.last_refresh = now
        self._refresh_wanted = False
        return sick[0] if sick else ""

    async def _refresh(self, ask_last: str | None) -> None:
        """Ask the startup nodes for the slot map (the one with an open breaker last)."""
        try:
            await self.get_client().nodes_manager.initialize(last_failed_node_name=ask_last)
        except RedisError as exc:
            self.refresh_failures += 1
            self._refresh_wanted = True
            _log.debug("slot_map_refresh_failed", tier=self._name, error=repr(exc))
        except BaseException:
            self._refresh_wanted = True
            raise
        else:
            self.refreshes += 1
            self.mapped()
