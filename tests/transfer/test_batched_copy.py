"""The CPU copy path's batching: host order, merged pieces, shares over threads, exact bytes.

Every test here compares bytes, never a duration: which blocks land where (both
directions, scattered, adjacent and permuted id sets, duplicated sources), that nothing
else is touched, and that the shares of a split copy cover exactly the bytes of the whole.
"""

from __future__ import annotations

import contextlib
import random
import threading

import anyio
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transfer_helpers import bits, gpu_block, load_plan, make_layout, random_kv, store_plan

from kvoffload.config import KVLayout
from kvoffload.storage.host_buffer import HostKVBuffer
from kvoffload.transfer import (
    BlockMover,
    CompletionPoller,
    CudaCopyEngine,
    ThreadCopyEngine,
    TransferPlan,
)
from kvoffload.transfer import thread_engine as thread_engine_module
from kvoffload.transfer.gather import (
    NATIVE,
    STREAMING,
    Segment,
    copy_segments,
    copy_table,
    cpu_runs,
    host_order,
    split_segments,
    split_table,
)

_SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _host_blocks(layout: KVLayout, host: HostKVBuffer) -> torch.Tensor:
    return host.blocks.view(host.num_blocks, layout.num_layers, -1)


def _gpu_bytes(layout: KVLayout, kv: list[torch.Tensor], layer: int, block: int) -> torch.Tensor:
    return bits(gpu_block(layout, kv, layer, block)).flatten()


def _host_bytes(layout: KVLayout, host: HostKVBuffer, layer: int, block: int) -> torch.Tensor:
    return bits(_host_blocks(layout, host)[block, layer]).flatten()


def _check_copied(
    layout: KVLayout,
    plan: TransferPlan,
    kv: list[torch.Tensor],
    kv_before: list[torch.Tensor],
    host: HostKVBuffer,
    host_before: torch.Tensor,
) -> None:
    """Each destination block holds its source's bytes; every other byte is unchanged."""
    before = HostKVBuffer(layout, host.num_blocks, pin_memory="never")
    try:
        before.raw.copy_(host_before)
        for layer in range(layout.num_layers):
            for g, c in zip(plan.gpu_block_ids, plan.cpu_block_ids, strict=True):
                if plan.kind == "store":
                    want = _gpu_bytes(layout, kv_before, layer, g)
                    assert torch.equal(_host_bytes(layout, host, layer, c), want), (layer, g, c)
                else:
                    want = _host_bytes(layout, before, layer, c)
                    assert torch.equal(_gpu_bytes(layout, kv, layer, g), want), (layer, g, c)
            if plan.kind == "store":
                assert torch.equal(bits(kv[layer]), bits(kv_before[layer]))
                others = sorted(set(range(host.num_blocks)) - set(plan.cpu_block_ids))
                for c in others:
                    want = _host_bytes(layout, before, layer, c)
                    assert torch.equal(_host_bytes(layout, host, layer, c), want)
            else:
                others = sorted(set(range(kv_blocks(layout, kv))) - set(plan.gpu_block_ids))
                for g in others:
                    want = _gpu_bytes(layout, kv_before, layer, g)
                    assert torch.equal(_gpu_bytes(layout, kv, layer, g), want)
        if plan.kind == "load":
            assert torch.equal(host.raw, host_before)
    finally:
        before.close()


def kv_blocks(layout: KVLayout, kv: list[torch.Tensor]) -> int:
    return layout.num_gpu_blocks(kv)


@st.composite
def _cases(draw: st.DrawFn) -> tuple[KVLayout, int, int, TransferPlan, int]:
    layout = make_layout(
        kind=draw(st.sampled_from(["blocks_first", "kv_first"])),
        dtype=draw(st.sampled_from(["uint8", "float16", "float32", "bfloat16"])),
        layers=draw(st.integers(1, 3)),
        heads=draw(st.integers(1, 3)),
        head=draw(st.integers(1, 5)),
        block_size=draw(st.integers(1, 3)),
    )
    num_gpu = draw(st.integers(1, 12))
    num_cpu = draw(st.integers(1, 12))
    kind = draw(st.sampled_from(["store", "load"]))
    n = draw(st.integers(0, min(num_gpu, num_cpu)))
    shape = draw(st.sampled_from(["scattered", "adjacent", "permuted-adjacent"]))
    dst_space = num_cpu if kind == "store" else num_gpu
    src_space = num_gpu if kind == "store" else num_cpu
    if shape == "scattered":
        dst = draw(st.permutations(range(dst_space)))[:n]
        # sources may repeat (one block stored to two CPU blocks, say)
        src = [draw(st.integers(0, src_space - 1)) for _ in range(n)]
    else:
        d0 = draw(st.integers(0, dst_space - n))
        s0 = draw(st.integers(0, src_space - n))
        pairs = [(d0 + i, s0 + i) for i in range(n)]
        if shape == "permuted-adjacent":
            pairs = draw(st.permutations(pairs))
        dst, src = [d for d, _ in pairs], [s for _, s in pairs]
    gpu, cpu = (src, dst) if kind == "store" else (dst, src)
    plan = store_plan(gpu, cpu) if kind == "store" else load_plan(gpu, cpu)
    parts = draw(st.integers(1, 4))
    return layout, num_gpu, num_cpu, plan, parts


@_SETTINGS
@given(_cases())
def test_segments_and_their_shares_move_exactly_the_plan(
    case: tuple[KVLayout, int, int, TransferPlan, int],
) -> None:
    layout, num_gpu, num_cpu, plan, parts = case
    kv = random_kv(layout, num_gpu, seed=plan.plan_id)
    kv_before = [t.clone() for t in kv]
    host = HostKVBuffer(layout, num_cpu, pin_memory="never")
    try:
        host.raw.copy_(torch.randint(0, 256, (host.nbytes,), dtype=torch.uint8))
        host_before = host.raw.clone()
        mover = BlockMover(layout, kv, host)
        segments = mover.segments(plan)
        assert sum(size for _, _, size in segments) == mover.nbytes(plan)
        shares = split_segments(segments, parts)
        assert len(shares) <= parts
        for share in shares:
            copy_segments(share)
        _check_copied(layout, plan, kv, kv_before, host, host_before)
    finally:
        host.close()


@pytest.mark.skipif(not STREAMING, reason="kvoffload._streamcopy not built")
@_SETTINGS
@given(_cases())
def test_segment_table_shares_streamed_move_exactly_the_plan(
    case: tuple[KVLayout, int, int, TransferPlan, int],
) -> None:
    # The engine's large-copy path: the table cut into shares, each one streaming batch.
    layout, num_gpu, num_cpu, plan, parts = case
    kv = random_kv(layout, num_gpu, seed=plan.plan_id)
    kv_before = [t.clone() for t in kv]
    host = HostKVBuffer(layout, num_cpu, pin_memory="never")
    try:
        host.raw.copy_(torch.randint(0, 256, (host.nbytes,), dtype=torch.uint8))
        host_before = host.raw.clone()
        mover = BlockMover(layout, kv, host)
        for share in split_table(mover.segment_table(plan), parts):
            copy_table(share, stream=True)
        _check_copied(layout, plan, kv, kv_before, host, host_before)
    finally:
        host.close()


@_SETTINGS
@given(
    sizes=st.lists(st.integers(1, 9), max_size=8),
    parts=st.integers(1, 6),
)
def test_shares_cover_every_byte_once_in_order(sizes: list[int], parts: int) -> None:
    # segments at made-up addresses: the shares must map the same bytes, in the same order
    segments: list[Segment] = []
    dst, src = 1000, 50_000
    for size in sizes:
        segments.append((dst, src, size))
        dst, src = dst + size + 7, src + 3 * size
    shares = split_segments(segments, parts)

    def byte_map(segs: list[Segment]) -> list[tuple[int, int]]:
        return [(d + i, s + i) for d, s, size in segs for i in range(size)]

    assert byte_map([seg for share in shares for seg in share]) == byte_map(segments)
    assert len(shares) <= parts
    assert all(size > 0 for share in shares for _, _, size in share)
    total = sum(sizes)
    if shares:  # equal shares, to within one segment's cut
        assert max(sum(s for _, _, s in share) for share in shares) <= -(-total // parts) + 1


def test_split_segments_refuses_no_parts() -> None:
    with pytest.raises(ValueError, match="parts"):
        split_segments([(0, 0, 1)], 0)


@pytest.mark.parametrize("kind", ["store", "load"])
@pytest.mark.parametrize("layout_kind", ["blocks_first", "kv_first"])
def test_segments_walk_the_host_front_to_back(host_factory, kind, layout_kind) -> None:
    layout = make_layout(kind=layout_kind, layers=4)
    kv = random_kv(layout, 32)
    mover = BlockMover(layout, kv, host_factory(layout, 32))
    rng = random.Random(3)
    gpu, cpu = rng.sample(range(32), 12), rng.sample(range(32), 12)
    plan = store_plan(gpu, cpu) if kind == "store" else load_plan(gpu, cpu)
    segments = mover.segments(plan)
    host_side = [seg[0] if kind == "store" else seg[1] for seg in segments]
    assert host_side == sorted(host_side)
    assert len(set(host_side)) == len(host_side)


@pytest.mark.parametrize("kind", ["store", "load"])
def test_pieces_adjacent_on_both_sides_are_one_segment(host_factory, kind) -> None:
    # One layer: consecutive blocks are adjacent in the layer tensor and in the host buffer.
    layout = make_layout(layers=1)
    kv = random_kv(layout, 32)
    mover = BlockMover(layout, kv, host_factory(layout, 32))
    pairs = [(5 + i, 20 + i) for i in range(8)]
    random.Random(1).shuffle(pairs)
    gpu, cpu = [g for g, _ in pairs], [c for _, c in pairs]
    plan = store_plan(gpu, cpu) if kind == "store" else load_plan(gpu, cpu)
    assert [size for _, _, size in mover.segments(plan)] == [8 * layout.bytes_per_block]


def test_host_order_sorts_pairs_by_cpu_id() -> None:
    plan = store_plan([7, 1, 4, 1], [30, 10, 20, 11])
    assert host_order(plan) == ((1, 1, 4, 7), (10, 11, 20, 30))
    assert host_order(store_plan([], [])) == ((), ())


@pytest.mark.anyio
@pytest.mark.parametrize("path", ["claimed chunks", "fixed shares"])
@pytest.mark.parametrize("layout_kind", ["blocks_first", "kv_first"])
@pytest.mark.parametrize("threads", [1, 2, 3, 5])
async def test_thread_engine_shares_by_host_range_bit_exact(
    host_factory, monkeypatch, path, layout_kind, threads
) -> None:
    # Every copy is split (threshold 0), also one too small to give each thread a block:
    # with the native copy into claimed chunks (small ones, cutting pieces), without it
    # (no C compiler at install) into fixed shares.
    monkeypatch.setattr(thread_engine_module, "_PARALLEL_MIN_BYTES", 0)
    if path == "fixed shares":
        monkeypatch.setattr(thread_engine_module, "NATIVE", False)
        monkeypatch.setattr(thread_engine_module, "STREAMING", False)
    elif not NATIVE:
        pytest.skip("kvoffload._streamcopy not built")
    else:
        monkeypatch.setattr(thread_engine_module, "_CHUNK_BYTES", 7)
    layout = make_layout(kind=layout_kind, layers=3, heads=1, head=3, block_size=1)
    n = 24
    kv = random_kv(layout, n, seed=threads)
    original = [t.clone() for t in kv]
    host = host_factory(layout, n)
    engine = ThreadCopyEngine(layout, kv, host, copy_threads=threads)
    rng = random.Random(threads)
    cases = [
        (rng.sample(range(n), 10), rng.sample(range(n), 10), rng.sample(range(n), 10)),
        ([4], [9], [2]),  # one block: fewer pieces than threads for some layouts
        (list(range(8)), list(range(10, 18)), list(range(16, 24))),  # adjacent everywhere
    ]
    poller = CompletionPoller(lambda t: None, poll_interval_s=0.001)
    async with anyio.create_task_group() as tg:
        await tg.start(poller.run)
        for src, cpu, dst in cases:
            for plan in (store_plan(src, cpu), load_plan(dst, cpu)):
                task = engine.submit(plan)
                poller.track(task)
                await task
            for layer in range(layout.num_layers):
                for a, b in zip(src, dst, strict=True):
                    assert torch.equal(
                        bits(gpu_block(layout, kv, layer, b)),
                        bits(gpu_block(layout, original, layer, a)),
                    )
            for t, o in zip(kv, original, strict=True):  # restore for the next case
                t.copy_(o)
        tg.cancel_scope.cancel()
    await engine.aclose()


class _Event:
    def record(self, stream: object = None) -> None:
        pass

    def query(self) -> bool:
        return True


class _Stream:
    def wait_event(self, event: object) -> None:
        pass


class _Backend:
    """Streams and events that do nothing: the copies run on CPU tensors at once."""

    def new_stream(self, *, priority: int) -> _Stream:
        return _Stream()

    def lowest_priority(self) -> int:
        return 0

    def new_event(self) -> _Event:
        return _Event()

    def current_stream(self) -> _Stream:
        return _Stream()

    def use_stream(self, stream: object) -> contextlib.AbstractContextManager[object]:
        return contextlib.nullcontext()


@pytest.mark.parametrize("kind", ["store", "load"])
def test_cuda_engine_copies_permuted_adjacent_cpu_ids_as_one_host_run(
    host_factory, monkeypatch, kind
) -> None:
    # The CUDA path batches in host order too: CPU ids consecutive in any order are one
    # host copy per chunk (fake streams; the data ops run on CPU tensors).
    seen: list[tuple[int, ...]] = []
    name = "store_staged" if kind == "store" else "load_staged"
    original = getattr(BlockMover, name)

    def spy(self, gpu_ids, cpu_ids, *args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(tuple(cpu_ids))
        return original(self, gpu_ids, cpu_ids, *args, **kwargs)

    monkeypatch.setattr(BlockMover, name, spy)
    layout = make_layout()
    kv = random_kv(layout, 16)
    engine = CudaCopyEngine(layout, kv, host_factory(layout, 16), backend=_Backend())
    cpu = [9, 7, 8, 11, 10, 6]
    gpu = [0, 1, 2, 3, 4, 5]
    engine.submit(store_plan(gpu, cpu) if kind == "store" else load_plan(gpu, cpu))
    assert [len(cpu_runs(ids)) for ids in seen] == [1]


@pytest.mark.anyio
@pytest.mark.skipif(not NATIVE, reason="kvoffload._streamcopy not built")
async def test_a_copy_ends_without_a_helper_that_never_gets_to_run(host_factory, monkeypatch):
    # The helper thread is held busy (as a helper that never gets a core): the worker
    # claims every chunk itself and the copy ends, bit-exact, while the helper is still
    # held; with fixed shares it would wait for the helper's share.
    monkeypatch.setattr(thread_engine_module, "_PARALLEL_MIN_BYTES", 0)
    monkeypatch.setattr(thread_engine_module, "_CHUNK_BYTES", 1000)
    layout = make_layout(layers=3, heads=2, head=16, block_size=4)
    n = 12
    kv = random_kv(layout, n, seed=7)
    original = [t.clone() for t in kv]
    host = host_factory(layout, n)
    engine = ThreadCopyEngine(layout, kv, host, copy_threads=2)
    held = threading.Event()
    helpers = engine._helpers
    assert helpers is not None
    busy = helpers.submit(held.wait)
    src, cpu, dst = list(range(0, 10)), list(range(2, 12)), list(range(11, 1, -1))
    poller = CompletionPoller(lambda t: None, poll_interval_s=0.001)
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(poller.run)
            with anyio.fail_after(60):  # a guard against a hang, not a timing
                for plan in (store_plan(src, cpu), load_plan(dst, cpu)):
                    task = engine.submit(plan)
                    poller.track(task)
                    await task
            assert not busy.done()
            tg.cancel_scope.cancel()
    finally:
        held.set()
    await engine.aclose()
    for layer in range(layout.num_layers):
        for a, b in zip(src, dst, strict=True):
            assert torch.equal(
                bits(gpu_block(layout, kv, layer, b)), bits(gpu_block(layout, original, layer, a))
            )
