"""The streaming copy (``kvoffload._streamcopy``): exact bytes, and when the engine uses it.

`copy_table(..., stream=True)` runs a table of copies in one native call with
non-temporal stores (the bulk of each copy; a head up to a 64-byte boundary and a tail go
through ``memcpy``). These tests compare bytes for every size and alignment around those
boundaries, and check which copies the engine sends through it. Where the optional native
module is not built (no C compiler at install), the streaming tests skip, the fallback is
tested, and in CI on x86-64 its absence is a failure.
"""

from __future__ import annotations

import ctypes
import os
import platform
import random
import threading
from collections.abc import Iterator
from typing import Any

import anyio
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transfer_helpers import bits, gpu_block, load_plan, make_layout, random_kv, store_plan

from kvoffload.transfer import CompletionPoller, ThreadCopyEngine
from kvoffload.transfer import gather as gather_module
from kvoffload.transfer import thread_engine as thread_engine_module
from kvoffload.transfer.gather import NATIVE, STREAMING, SharedCopy, copy_table

needs_streaming = pytest.mark.skipif(not STREAMING, reason="kvoffload._streamcopy not built")
needs_native = pytest.mark.skipif(not NATIVE, reason="kvoffload._streamcopy not built")

_SETTINGS = settings(
    max_examples=60,
    deadline=None,
    # store_width is set once per test, for every example alike
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


@pytest.mark.skipif(
    not os.environ.get("CI") or platform.machine() not in ("x86_64", "AMD64"),
    reason="the native copy is required only in CI on x86-64",
)
def test_ci_builds_the_streaming_copy() -> None:
    # The extension is optional at install: without this a broken build would go unseen.
    assert STREAMING


@st.composite
def _batches(draw: Any) -> tuple[int, list[tuple[int, int, int]]]:
    """A buffer size and non-overlapping ``(dst_offset, src_offset, size)`` copies in it."""
    sizes = draw(
        st.lists(
            st.one_of(st.integers(0, 70), st.integers(250, 270), st.integers(1000, 5000)),
            min_size=1,
            max_size=6,
        )
    )
    gaps = draw(st.lists(st.integers(0, 65), min_size=2 * len(sizes), max_size=2 * len(sizes)))
    # destinations in the first half, sources in the second: no copy reads what one writes
    dst_offsets, src_offsets, at_dst, at_src = [], [], 0, 0
    for i, size in enumerate(sizes):
        at_dst += gaps[2 * i]
        at_src += gaps[2 * i + 1]
        dst_offsets.append(at_dst)
        src_offsets.append(at_src)
        at_dst += size
        at_src += size
    half = max(at_dst, at_src) + 64
    order = draw(st.permutations(range(len(sizes))))
    copies = [(dst_offsets[i], half + src_offsets[i], sizes[i]) for i in order]
    return 2 * half, copies


@pytest.fixture(params=["wide", "narrow"])
def store_width(request: pytest.FixtureRequest) -> Iterator[str]:
    """Both store widths of the native copy: 32 bytes (AVX2, where the CPU has it) and 16."""
    native = gather_module._streamcopy
    if native is None or not hasattr(native, "use_avx2"):
        pytest.skip("kvoffload._streamcopy not built (or built before use_avx2)")
    before = native.use_avx2(request.param == "wide")
    yield request.param
    native.use_avx2(before)


@needs_streaming
@_SETTINGS
@given(batch=_batches(), shift=st.integers(0, 63))
def test_streaming_copy_writes_exactly_the_segments(
    store_width: str, batch: tuple[int, list[tuple[int, int, int]]], shift: int
) -> None:
    buf, table, expected = _buffer_and_table(batch, shift)  # every alignment
    copy_table(table, stream=True)
    assert torch.equal(buf, expected)


def _buffer_and_table(
    batch: tuple[int, list[tuple[int, int, int]]], shift: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A random buffer, the table of ``batch``'s copies in it, and the buffer they make."""
    total, copies = batch
    rng = random.Random(total * 64 + shift)
    buf = torch.tensor([rng.randrange(256) for _ in range(total + 64)], dtype=torch.uint8)
    expected = buf.clone()
    base = buf.data_ptr() + shift
    table = torch.tensor([(base + d, base + s, n) for d, s, n in copies], dtype=torch.int64)
    for d, s, n in copies:
        expected[shift + d : shift + d + n] = expected[shift + s : shift + s + n].clone()
    return buf, table.view(-1, 3), expected


@needs_native
@_SETTINGS
@given(
    batch=_batches(),
    shift=st.integers(0, 63),
    chunk=st.one_of(st.integers(1, 300), st.integers(900, 6000)),
    threads=st.integers(1, 3),
    stream=st.booleans(),
)
def test_a_shared_copy_writes_every_byte_once_whoever_claims_it(
    store_width: str,
    batch: tuple[int, list[tuple[int, int, int]]],
    shift: int,
    chunk: int,
    threads: int,
    stream: bool,
) -> None:
    # Chunks cut pieces anywhere (odd sizes, unaligned); threads race for them.
    buf, table, expected = _buffer_and_table(batch, shift)
    shared = SharedCopy(table, chunk_bytes=chunk, stream=stream)
    counts: list[int] = []
    workers = [
        threading.Thread(target=lambda: counts.append(shared.run())) for _ in range(threads - 1)
    ]
    for worker in workers:
        worker.start()
    counts.append(shared.run())
    shared.wait()
    for worker in workers:
        worker.join()
    assert torch.equal(buf, expected)
    total = int(table[:, 2].sum())
    assert sum(counts) == -(-total // chunk)  # each chunk copied by exactly one thread
    assert shared.run() == 0  # a late thread finds nothing left and changes nothing
    assert torch.equal(buf, expected)


@needs_native
def test_a_shared_copy_of_nothing_is_done_at_once() -> None:
    for table in (
        torch.empty((0, 3), dtype=torch.int64),
        torch.tensor([[0, 0, 0], [0, 0, 0]], dtype=torch.int64),
    ):
        shared = SharedCopy(table, chunk_bytes=64, stream=True)
        shared.wait()  # returns: there is no last chunk to wait for
        assert shared.run() == 0


@needs_native
def test_the_native_shared_copy_refuses_a_malformed_batch() -> None:
    native = gather_module._streamcopy
    assert native is not None
    state = torch.zeros(2, dtype=torch.int64)
    table = torch.tensor([[0, 0, -1]], dtype=torch.int64)
    with pytest.raises(ValueError, match="count >= 0"):
        native.copy_claim(0, 1, 64, state.data_ptr(), True)
    with pytest.raises(ValueError, match="chunk_bytes 0"):
        native.copy_claim(table.data_ptr(), 0, 0, state.data_ptr(), True)
    with pytest.raises(ValueError, match="a state"):
        native.copy_claim(table.data_ptr(), 0, 64, 0, True)
    with pytest.raises(ValueError, match="negative size -1"):
        native.copy_claim(table.data_ptr(), 1, 64, state.data_ptr(), True)
    assert state.tolist() == [0, 0]  # nothing claimed
    with pytest.raises(ValueError, match="chunk_bytes must be >= 1, got 0"):
        SharedCopy(table, chunk_bytes=0, stream=True)


def test_a_native_copy_built_before_shared_copies_is_not_used_for_them() -> None:
    # A stale build (the Python files updated, the extension not rebuilt) has copy_at only:
    # the engine then takes fixed shares instead of failing every large copy.
    class _OldBuild:
        STREAMING = 1

        def copy_at(self, address: int, count: int) -> None:
            pass

    assert not gather_module._shares(_OldBuild())
    assert not gather_module._shares(None)
    assert gather_module._shares(gather_module._streamcopy) is NATIVE


def test_a_shared_copy_needs_the_native_copy(monkeypatch) -> None:
    monkeypatch.setattr(gather_module, "_streamcopy", None)
    with pytest.raises(RuntimeError, match="needs the native copy"):
        SharedCopy(torch.empty((0, 3), dtype=torch.int64), chunk_bytes=64, stream=False)


def test_without_streaming_copy_table_copies_the_same(monkeypatch) -> None:
    # The fallback where the native copy is not built: stream=True is one memmove a row.
    monkeypatch.setattr(gather_module, "STREAMING", False)
    monkeypatch.setattr(gather_module, "_streamcopy", None)
    buf = torch.arange(256, dtype=torch.int64).view(torch.uint8)
    expected = buf.clone()
    expected[:100] = expected[1000:1100].clone()
    expected[1500:1999] = expected[300:799].clone()
    p = buf.data_ptr()
    copy_table(torch.tensor([[p, p + 1000, 100], [p + 1500, p + 300, 499]]), stream=True)
    assert torch.equal(buf, expected)


@needs_streaming
def test_the_native_copy_refuses_a_malformed_batch() -> None:
    native = gather_module._streamcopy
    assert native is not None
    with pytest.raises(ValueError, match="count >= 0"):
        native.copy_at(0, 1)
    with pytest.raises(ValueError, match="count >= 0"):
        native.copy_at(1, -1)
    table = torch.tensor([[0, 0, -1]], dtype=torch.int64)
    with pytest.raises(ValueError, match="negative size -1"):
        native.copy_at(table.data_ptr(), 1)
    native.copy_at(0, 0)  # an empty table is nothing to do


class _Recorder:
    """Stands in for the native module: records each batch, then runs it."""

    STREAMING = 1

    def __init__(self, real: Any) -> None:
        self.real = real
        self.batches: list[int] = []  # bytes of each copy_at table
        self.claims: list[tuple[bool, int, int]] = []  # (stream, table bytes, chunks copied)
        self.active = 0  # copy_claim calls not returned yet (a helper may outlive its copy)
        self._lock = threading.Lock()

    def copy_at(self, address: int, count: int) -> None:
        rows = (ctypes.c_int64 * (3 * count)).from_address(address)
        self.batches.append(sum(rows[2::3]))
        self.real.copy_at(address, count)

    def copy_claim(
        self, address: int, count: int, chunk: int, state: int, stream: bool
    ) -> tuple[int, bool]:
        with self._lock:
            self.active += 1
        try:
            rows = (ctypes.c_int64 * (3 * count)).from_address(address)
            total = sum(rows[2::3])
            copied, last = self.real.copy_claim(address, count, chunk, state, stream)
            if copied:  # a helper that starts after the copy ended claims nothing
                self.claims.append((bool(stream), total, copied))
            return copied, last
        finally:
            with self._lock:
                self.active -= 1

    async def settle(self) -> None:
        """Wait until no call is running (the last chunk may end on the worker first)."""
        while self.active:
            await anyio.sleep(0.001)


@needs_streaming
@pytest.mark.anyio
@pytest.mark.parametrize("kind", ["blocks_first", "kv_first"])
@pytest.mark.parametrize("threads", [1, 2, 3])
async def test_large_copies_stream_small_ones_do_not(host_factory, monkeypatch, kind, threads):
    # 4 layers x 8 KiB pieces, 32 KiB a block; streaming from 16 blocks (512 KiB) on, and
    # every copy split over the threads.
    recorder = _Recorder(gather_module._streamcopy)
    monkeypatch.setattr(gather_module, "_streamcopy", recorder)
    monkeypatch.setattr(thread_engine_module, "_PARALLEL_MIN_BYTES", 0)
    monkeypatch.setattr(thread_engine_module, "_CHUNK_BYTES", 40_000)  # cuts pieces too
    layout = make_layout(kind=kind, layers=4, heads=4, head=64, block_size=8)
    monkeypatch.setattr(thread_engine_module, "_STREAM_MIN_BYTES", 16 * layout.bytes_per_block)
    n = 48
    kv = random_kv(layout, n, seed=threads)
    original = [t.clone() for t in kv]
    host = host_factory(layout, n)
    engine = ThreadCopyEngine(layout, kv, host, copy_threads=threads)
    rng = random.Random(threads)
    poller = CompletionPoller(lambda t: None, poll_interval_s=0.001)
    async with anyio.create_task_group() as tg:
        await tg.start(poller.run)
        for count, streams in ((15, False), (16, True), (40, True)):
            src, cpu, dst = (rng.sample(range(n), count) for _ in range(3))
            for plan in (store_plan(src, cpu), load_plan(dst, cpu)):
                recorder.batches.clear()
                recorder.claims.clear()
                task = engine.submit(plan)
                poller.track(task)
                await task
                await recorder.settle()
                nbytes = count * layout.bytes_per_block
                if threads == 1:  # one batch on the worker, streamed or not
                    assert recorder.batches == ([nbytes] if streams else [])
                    assert recorder.claims == []
                elif not NATIVE:  # a build without copy_claim: one fixed share per thread
                    assert sum(recorder.batches) == (nbytes if streams else 0)
                    assert len(recorder.batches) == (threads if streams else 0)
                else:  # shared: every claim streams or none, and the chunks cover the copy
                    assert recorder.batches == []
                    assert {(stream, total) for stream, total, _ in recorder.claims} == {
                        (streams, nbytes)
                    }
                    assert sum(c for _, _, c in recorder.claims) == -(-nbytes // 40_000)
            for layer in range(layout.num_layers):
                for a, b in zip(src, dst, strict=True):
                    assert torch.equal(
                        bits(gpu_block(layout, kv, layer, b)),
                        bits(gpu_block(layout, original, layer, a)),
                    )
            for t, o in zip(kv, original, strict=True):
                t.copy_(o)
        tg.cancel_scope.cancel()
    await engine.aclose()
