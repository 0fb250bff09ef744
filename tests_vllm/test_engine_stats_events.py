"""End to end: kvoffload's figures in a real vLLM engine's Prometheus metrics, and its KV
events through vLLM's ZMQ event publisher, for a dense model and a hybrid one.

Each engine runs with vLLM's statistics on (its Prometheus logger writes the process's
default registry, the one vLLM's ``/metrics`` serves) and with ``kv_events_config``
publishing on a loopback ZMQ endpoint that a subscriber in the test reads. The scraped
figures must equal the connector's own statistics; every ``BlockStored`` with medium
``"CPU"`` must name a hash (and group) vLLM's own ``BlockStored`` gave the same block, and
with a disk tier, every ``BlockStored`` with medium ``"DISK"`` one the CPU pool's gave.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgspec
import prometheus_client
import pytest
import zmq
from engine_runs import (
    connector_of,
    engine,
    kvoffload_config,
    run_conversations,
    worker_connector_of,
)
from hybrid_runs import converse
from models import CASES, engine_kwargs, started, write_model
from vllm.distributed.kv_events import BlockStored, KVEventBatch

from kvoffload.integrations.vllm.scheduler_side import SchedulerSide

pytestmark = pytest.mark.engine

_QUIET_S = 1.0
"""The subscriber stops reading after this long without a message."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Subscriber:
    """A ZMQ subscriber of vLLM's event publisher, on loopback."""

    def __init__(self, socket_: zmq.Socket[bytes]) -> None:
        self._sub = socket_
        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.events: list[Any] = []

    def drain(self) -> list[Any]:
        """Read until the publisher has been quiet for `_QUIET_S`; every event so far."""
        while self._sub.poll(int(_QUIET_S * 1000)):
            _topic, _seq, payload = self._sub.recv_multipart()
            self.events.extend(self._decoder.decode(payload).events)
        return self.events


@contextmanager
def subscriber(port: int) -> Iterator[Subscriber]:
    """Subscribe to the publisher of a started engine (`events_config`)."""
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVHWM, 0)  # keep every batch until read
    sub.connect(f"tcp://127.0.0.1:{port}")
    time.sleep(0.5)  # ZMQ's slow joiner: let the subscription reach the publisher
    try:
        yield Subscriber(sub)
    finally:
        sub.close(linger=0)
        context.term()


def stored(events: list[Any], medium: str) -> set[tuple[int | None, Any]]:
    """``(group, hash)`` of every ``BlockStored`` of ``medium``."""
    return {
        (e.group_idx, h)
        for e in events
        if isinstance(e, BlockStored) and e.medium == medium
        for h in e.block_hashes
    }


def scraped(name: str, **labels: str) -> float:
    """The sum of the default registry's samples named ``name`` with ``labels``."""
    total = 0.0
    for family in prometheus_client.REGISTRY.collect():
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def events_config(port: int) -> dict[str, Any]:
    """vLLM's publisher binds a wildcard endpoint and connects to a host one; a
    subscriber binding the host end received nothing from a connecting publisher here,
    so the publisher binds and the subscriber connects over loopback."""
    return {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{port}",
    }


def test_a_dense_engine_shows_kvoffload_s_figures_and_publishes_its_blocks(
    model_dir: Path,
) -> None:
    port = free_port()
    config = kvoffload_config({"num_cpu_blocks": 256})
    with (
        engine(
            model_dir,
            config,
            kv_events_config=events_config(port),
            disable_log_stats=False,
        ) as llm,
        subscriber(port) as sub,
    ):
        run = run_conversations(llm)
        events = sub.drain()
        own = run.stats
        side = connector_of(llm).scheduler_side
        pool = side.scheduler.ledger("g0").pool.statistics()
    assert own.loaded_tokens > 0
    assert scraped("kvoffload_scheduler_loaded_tokens_total") == own.loaded_tokens
    assert scraped("kvoffload_scheduler_stored_blocks_total") == own.stored_blocks
    assert scraped("kvoffload_scheduler_hit_tokens_total") == own.hit_tokens
    assert scraped("kvoffload_scheduler_miss_tokens_total") == own.miss_tokens
    for reason, count in own.lookup_misses.items():
        assert scraped("kvoffload_lookup_misses_total", reason=reason.value) == count
    assert scraped("kvoffload_pool_cached_blocks") == pool.num_cached
    assert scraped("kvoffload_poller_completed_total", rank="0") > 0

    cpu, gpu = stored(events, "CPU"), stored(events, "GPU")
    assert 0 < len(cpu) <= own.stored_blocks  # a block stored again: the same hash
    assert cpu <= gpu
    assert {g for g, _ in cpu} == {0}


def test_a_hybrid_engine_shows_each_group_and_publishes_each_group_s_blocks(
    tmp_path: Path,
) -> None:
    case = CASES["gemma3"]
    port = free_port()
    kwargs = engine_kwargs(
        write_model(tmp_path / "gemma3", case),
        case,
        gpu_blocks=48,
        max_model_len=640,
        max_num_batched_tokens=128,
        kv_transfer_config=kvoffload_config({"num_cpu_blocks": 64}),
        kv_events_config=events_config(port),
        disable_log_stats=False,
    )
    with started(**kwargs) as llm, subscriber(port) as sub:
        converse(llm, turn_tokens=150)
        events = sub.drain()
        side = connector_of(llm).scheduler_side
        assert isinstance(side, SchedulerSide)
        per_group = side.scheduler.statistics()
        own = side.statistics().scheduler
        index = {g.name: i for i, g in enumerate(side.groups)}
    assert own is not None
    assert own.loaded_tokens > 0
    assert scraped("kvoffload_scheduler_loaded_tokens_total") == own.loaded_tokens
    for name, group in per_group.items():
        assert scraped("kvoffload_group_stored_blocks_total", group=name) == group.stored_blocks
        assert scraped("kvoffload_group_loaded_blocks_total", group=name) == group.loaded_blocks

    cpu, gpu = stored(events, "CPU"), stored(events, "GPU")
    # The full-attention group: vLLM published every block it cached, kvoffload's CPU
    # copies carry the same (group, hash).
    full = {i for i, g in enumerate(side.groups) if g.kind == "full"}
    assert full
    assert {(g, h) for g, h in cpu if g in full} <= gpu
    # A window group: vLLM publishes only the blocks its own cache keeps reachable, and
    # kvoffload may hold others; every hash is vLLM's hash of that prefix (the groups
    # share one block size, so the hash vLLM gave the full group's block there).
    assert {h for g, h in cpu if g not in full} <= {h for _, h in gpu}
    for name, group in per_group.items():
        published = {h for g, h in cpu if g == index[name]}
        # A block evicted and stored again is published again under the same hash.
        assert 0 < len(published) <= group.stored_blocks


def test_a_dense_engine_publishes_the_blocks_it_wrote_down_to_a_tier(
    model_dir: Path, tmp_path: Path
) -> None:
    port = free_port()
    disk = {"kind": "disk", "path": str(tmp_path / "kv.bin"), "capacity_bytes": 16 << 20}
    config = kvoffload_config({"num_cpu_blocks": 256, "tiers": [disk]})
    with (
        engine(
            model_dir,
            config,
            kv_events_config=events_config(port),
            disable_log_stats=False,
        ) as llm,
        subscriber(port) as sub,
    ):
        run = run_conversations(llm)
        events = sub.drain()
        (worker,) = worker_connector_of(llm).worker_side.tiers.parts.values()
        (tier,) = worker.statistics()
    cpu, gpu, written = stored(events, "CPU"), stored(events, "GPU"), stored(events, "DISK")
    # The blocks written down to the disk tier, published with its medium, under the
    # hashes vLLM and the CPU pool gave the same blocks (the last turn's write-downs may
    # end after the engine's last step, so not every block the tier holds).
    assert written
    assert written <= cpu <= gpu
    assert len(written) <= tier.blocks_written <= run.stats.stored_blocks
    print(
        f"\n{len(written)} blocks published as written down to the disk tier "
        f"({tier.blocks_written} written, {len(cpu)} published on CPU)"
    )
