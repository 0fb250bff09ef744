"""The worker side copies each KV cache group's own pages, bytes exact, in vLLM's shared
allocation.

vLLM allocates one ``int8`` buffer and gives every layer of every group a view of it;
groups overlay each other from byte 0, so layer ``l`` of one group and layer ``l`` of
another are the same bytes, and a block id belongs to one group at a time. The tensors
here are shaped, typed and strided exactly as vLLM 0.32 registers them on CPU (see
docs/groups.md, "Worker side: the tensors"); a worker connector is built from the same
`KVCacheConfig`s as ``test_groups.py`` and driven with hand-made plans.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from harness import TestConnector, vllm_config
from test_groups import DEEPSEEK_V3, GEMMA3_HMA, QWEN3_NEXT_HMA, attn, config, full, sliding
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.kv_cache_interface import KVCacheConfig

from kvoffload.errors import ConfigError, LayoutMismatchError
from kvoffload.integrations.vllm.metadata import (
    GroupTransfer,
    KVOffloadConnectorMetadata,
    KVOffloadWorkerMetadata,
)
from kvoffload.integrations.vllm.worker_groups import GroupedWorkerSide
from kvoffload.integrations.vllm.worker_side import WorkerSide
from kvoffload.transfer.plan import LoadPlan, StorePlan

NUM_BLOCKS = 256


def alias(
    buffer: torch.Tensor, shape: tuple[int, ...], strides: tuple[int, ...], dtype: torch.dtype
) -> torch.Tensor:
    """A view of ``buffer`` (int8) as vLLM's ``create_kv_cache_views`` makes it."""
    return buffer.view(dtype).as_strided(shape, strides)


def gemma3_tensors() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Four groups of one layer each, all over the same 256 pages of 8192 bytes."""
    buffer = torch.randint(-128, 128, (NUM_BLOCKS * 8192,), dtype=torch.int8)
    view = alias(buffer, (NUM_BLOCKS, 1, 32, 64), (2048, 2048, 64, 1), torch.float32)
    return buffer, {attn(str(i)): view for i in range(4)}


def qwen3_next_tensors() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Three gated delta net states (int8, padded, not contiguous) and one bfloat16
    attention layer, all over the same 256 pages of 36864 bytes."""
    buffer = torch.randint(-128, 128, (NUM_BLOCKS * 36864,), dtype=torch.int8)
    state = alias(buffer, (NUM_BLOCKS, 1, 1, 35072), (36864, 35072, 35072, 1), torch.int8)
    assert not state.is_contiguous()
    attention = alias(buffer, (NUM_BLOCKS, 1, 288, 64), (18432, 18432, 64, 1), torch.bfloat16)
    kv = {f"model.layers.{i}.linear_attn": state for i in range(3)}
    kv[attn("3")] = attention
    return buffer, kv


def deepseek_tensors() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """MLA (layout LBNHC): two layers, each its own 256 pages of 36864 bytes."""
    buffer = torch.randint(-128, 128, (2 * NUM_BLOCKS * 36864,), dtype=torch.int8)
    layers = {}
    for i in range(2):
        part = buffer[i * NUM_BLOCKS * 36864 : (i + 1) * NUM_BLOCKS * 36864]
        layers[attn(str(i))] = alias(
            part, (NUM_BLOCKS, 1, 32, 576), (18432, 576, 576, 1), torch.bfloat16
        )
    return buffer, layers


def two_and_one_layer_tensors() -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """A sliding-window group of two layers and a full group of one: the full group's
    layer shares the first tensor with the window group's first layer."""
    buffers = [torch.randint(-128, 128, (NUM_BLOCKS * 8192,), dtype=torch.int8) for _ in range(2)]
    views = [alias(b, (NUM_BLOCKS, 1, 32, 64), (2048, 2048, 64, 1), torch.float32) for b in buffers]
    return buffers, {attn("0"): views[0], attn("1"): views[1], attn("2"): views[0]}


TWO_AND_ONE = config(([attn("0"), attn("1")], sliding()), ([attn("2")], full()))


@pytest.fixture
def connectors() -> Iterator[list[TestConnector]]:
    built: list[TestConnector] = []
    yield built
    for conn in built:
        conn.shutdown()


def worker(model_dir: Path, kv_config: KVCacheConfig, built: list[TestConnector]) -> TestConnector:
    vllm = vllm_config(
        model_dir,
        {"num_cpu_blocks": 8},
        num_gpu_blocks=NUM_BLOCKS,
        connector="TestConnector",
        module="harness",
    )
    vllm.cache_config.block_size = 32  # the specs' block size
    TestConnector.next_rank = 0
    conn = TestConnector(vllm, KVConnectorRole.WORKER, kv_config)
    built.append(conn)
    return conn


_keys = iter(range(10**6))


def store(group: int, gpu: list[int], cpu: list[int]) -> GroupTransfer:
    plan = StorePlan(
        plan_id=next(_keys),
        kind="store",
        gpu_block_ids=tuple(gpu),
        cpu_block_ids=tuple(cpu),
        request_ids=("r",),
        block_hashes=tuple(bytes([group, i]) * 16 for i in range(len(gpu))),
    )
    return GroupTransfer(next(_keys), group, plan)


def load(group: int, cpu: list[int], gpu: list[int], rid: str = "r") -> GroupTransfer:
    plan = LoadPlan(
        plan_id=next(_keys),
        kind="load",
        gpu_block_ids=tuple(gpu),
        cpu_block_ids=tuple(cpu),
        request_ids=(rid,),
        request_id=rid,
        num_tokens=32 * len(gpu),
    )
    return GroupTransfer(next(_keys), group, plan)


def run(conn: TestConnector, meta: KVOffloadConnectorMetadata) -> dict[int, bool]:
    """One step of the worker: loads, (no forward), stores; the reports it sends."""
    conn.bind_connector_metadata(meta)
    conn.start_load_kv(None)  # type: ignore[arg-type]
    conn.wait_for_save()
    side = conn.worker_side
    assert side is not None
    side.wait_idle()
    conn.clear_connector_metadata()
    report = conn.build_connector_worker_meta()
    assert report is None or isinstance(report, KVOffloadWorkerMetadata)
    return {} if report is None else {k: v[0] for k, v in report.reports.items()}


def pages(tensor: torch.Tensor, page: int, block: int) -> torch.Tensor:
    """The bytes of ``block``'s page of ``tensor`` (in its whole allocation)."""
    start = tensor.storage_offset() * tensor.element_size() + block * page
    raw = torch.empty(0, dtype=torch.uint8)
    raw.set_(tensor.untyped_storage(), start, (page,), (1,))
    return raw.clone()


@pytest.mark.parametrize(
    ("kv_config", "tensors", "page", "group"),
    [
        (GEMMA3_HMA, gemma3_tensors, 8192, 1),
        (GEMMA3_HMA, gemma3_tensors, 8192, 3),
        (QWEN3_NEXT_HMA, qwen3_next_tensors, 36864, 0),
        (QWEN3_NEXT_HMA, qwen3_next_tensors, 36864, 3),
    ],
    ids=["gemma3-window", "gemma3-full", "qwen3-next-state", "qwen3-next-attention"],
)
def test_a_group_round_trip_is_bytes_exact_and_touches_only_its_own_pages(
    model_dir: Path,
    connectors: list[TestConnector],
    kv_config: KVCacheConfig,
    tensors: object,
    page: int,
    group: int,
) -> None:
    conn = worker(model_dir, kv_config, connectors)
    buffer, kv = tensors()  # type: ignore[operator]
    conn.register_kv_caches(kv)
    side = conn.worker_side
    assert isinstance(side, GroupedWorkerSide)
    assert sorted(side.groups) == [0, 1, 2, 3]
    before = buffer.clone()
    reports = run(
        conn, KVOffloadConnectorMetadata(group_stores=(s := store(group, [3, 7], [0, 1]),))
    )
    assert reports == {s.key: True}
    assert torch.equal(buffer, before)  # a store reads only
    host = side.groups[group].host
    assert host is not None
    (name,) = [n for n in side.groups[group].layer_names]
    assert torch.equal(host.block_bytes(0).view(torch.uint8), pages(kv[name], page, 3))
    assert torch.equal(host.block_bytes(1).view(torch.uint8), pages(kv[name], page, 7))
    # Load them into blocks 10 and 11: exactly those two pages change, to 3's and 7's.
    reports = run(
        conn, KVOffloadConnectorMetadata(group_loads=(ld := load(group, [0, 1], [10, 11]),))
    )
    assert reports == {ld.key: True}
    expect = before.view(NUM_BLOCKS, page).clone()
    expect[10], expect[11] = expect[3], expect[7]
    assert torch.equal(buffer.view(NUM_BLOCKS, page), expect)
    assert side.bytes_loaded[group] == side.bytes_stored[group] == 2 * page


def test_a_copy_of_one_group_never_changes_another_groups_layers(
    model_dir: Path, connectors: list[TestConnector]
) -> None:
    conn = worker(model_dir, TWO_AND_ONE, connectors)
    buffers, kv = two_and_one_layer_tensors()
    conn.register_kv_caches(kv)
    before = [b.clone() for b in buffers]
    run(conn, KVOffloadConnectorMetadata(group_stores=(store(1, [5], [0]), store(0, [6], [0]))))
    run(conn, KVOffloadConnectorMetadata(group_loads=(load(1, [0], [20]),)))
    # The full group (one layer, the first tensor) changed page 20 of that tensor only.
    first = before[0].view(NUM_BLOCKS, 8192).clone()
    first[20] = first[5]
    assert torch.equal(buffers[0].view(NUM_BLOCKS, 8192), first)
    assert torch.equal(buffers[1], before[1])
    run(conn, KVOffloadConnectorMetadata(group_loads=(load(0, [0], [30]),)))
    # The window group (two layers) changed page 30 of both tensors.
    first[30] = first[6]
    second = before[1].view(NUM_BLOCKS, 8192).clone()
    second[30] = second[6]
    assert torch.equal(buffers[0].view(NUM_BLOCKS, 8192), first)
    assert torch.equal(buffers[1].view(NUM_BLOCKS, 8192), second)


def test_mla_pages_round_trip_bytes_exact_as_one_opaque_group(
    model_dir: Path, connectors: list[TestConnector]
) -> None:
    conn = worker(model_dir, DEEPSEEK_V3, connectors)
    side = conn.worker_side
    assert isinstance(side, WorkerSide)
    assert side.opaque
    assert (side.layout.dtype, side.layout.bytes_per_layer_block) == ("uint8", 36864)
    buffer, kv = deepseek_tensors()
    conn.register_kv_caches(kv)
    before = buffer.clone()
    plan = StorePlan(
        plan_id=1,
        kind="store",
        gpu_block_ids=(4,),
        cpu_block_ids=(2,),
        request_ids=("r",),
        block_hashes=(b"h" * 32,),
    )
    assert run(conn, KVOffloadConnectorMetadata(group_stores=(GroupTransfer(1, 0, plan),))) == {
        1: True
    }
    back = LoadPlan(
        plan_id=2,
        kind="load",
        gpu_block_ids=(9,),
        cpu_block_ids=(2,),
        request_ids=("r",),
        request_id="r",
        num_tokens=32,
    )
    assert run(conn, KVOffloadConnectorMetadata(group_loads=(GroupTransfer(2, 0, back),))) == {
        2: True
    }
    expect = before.view(2, NUM_BLOCKS, 36864).clone()
    expect[:, 9] = expect[:, 4]
    assert torch.equal(buffer.view(2, NUM_BLOCKS, 36864), expect)


def test_async_loads_report_the_request_once_every_group_loaded(
    model_dir: Path, connectors: list[TestConnector]
) -> None:
    conn = worker(model_dir, QWEN3_NEXT_HMA, connectors)
    conn.register_kv_caches(qwen3_next_tensors()[1])
    run(
        conn,
        KVOffloadConnectorMetadata(group_stores=tuple(store(g, [g + 1], [0]) for g in range(4))),
    )
    loads = tuple(load(g, [0], [100 + g], rid="q") for g in range(4))
    run(conn, KVOffloadConnectorMetadata(group_loads=loads, async_loads=True))
    results = conn.get_transfer_results(set())
    assert (results.finished_recving, results.failed_recving) == ({"q"}, set())
    assert conn.get_finished(set()) == (None, None)


def test_a_failed_load_of_one_group_fails_the_request(
    model_dir: Path, connectors: list[TestConnector]
) -> None:
    conn = worker(model_dir, GEMMA3_HMA, connectors)
    conn.register_kv_caches(gemma3_tensors()[1])
    run(conn, KVOffloadConnectorMetadata(group_stores=(store(0, [1], [0]), store(3, [2], [0]))))
    TestConnector.fail_kinds = {"load"}
    try:
        loads = (load(0, [0], [40]), load(3, [0], [41]))
        reports = run(conn, KVOffloadConnectorMetadata(group_loads=loads))
    finally:
        TestConnector.fail_kinds = set()
    assert reports == {loads[0].key: False, loads[1].key: False}
    # vLLM takes a multi-group model's load failures per request, never as block ids.
    assert conn.get_block_ids_with_load_errors() == set()
    results = conn.get_transfer_results(set())
    assert (results.finished_recving, results.failed_recving) == ({"r"}, {"r"})


def test_a_tensor_that_is_not_block_major_pages_is_refused_by_name(
    model_dir: Path, connectors: list[TestConnector]
) -> None:
    conn = worker(model_dir, GEMMA3_HMA, connectors)
    _, kv = gemma3_tensors()
    kv[attn("2")] = torch.zeros((2, NUM_BLOCKS, 32, 32))  # K/V first: not block-major
    with pytest.raises(LayoutMismatchError, match=r"layer 'model\.layers\.2\.self_attn\.attn'"):
        conn.register_kv_caches(kv)


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"store_mode": "lazy"}, "store_mode='lazy'"),
        ({"lazy_offload_blocks": 2}, "lazy_offload_blocks=2"),
    ],
)
def test_lazy_stores_are_refused_for_a_multi_group_model(
    model_dir: Path, extra: dict[str, object], named: str
) -> None:
    vllm = vllm_config(
        model_dir,
        {"num_cpu_blocks": 8, **extra},
        num_gpu_blocks=NUM_BLOCKS,
        connector="TestConnector",
        module="harness",
    )
    vllm.cache_config.block_size = 32
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(
            ConfigError, match=rf"several KV cache groups cannot honour.*{re.escape(named)}"
        ):
            TestConnector(vllm, role, GEMMA3_HMA)


def test_the_store_settings_are_accepted_for_a_multi_group_model(model_dir: Path) -> None:
    """``restore_evicted``, ``max_store_blocks_per_step`` and ``store_admission`` are
    honoured with several groups (tests_vllm/test_scheduler_groups.py observes them)."""
    extra = {
        "restore_evicted": True,
        "max_store_blocks_per_step": 8,
        "store_admission": "seen_twice",
    }
    vllm = vllm_config(
        model_dir,
        {"num_cpu_blocks": 8, **extra},
        num_gpu_blocks=NUM_BLOCKS,
        connector="TestConnector",
        module="harness",
    )
    vllm.cache_config.block_size = 32
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        TestConnector(vllm, role, GEMMA3_HMA).shutdown()
