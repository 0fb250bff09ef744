from __future__ import annotations

import gc
import itertools
import logging
import mmap
import os
import threading
import warnings
from pathlib import Path

import pytest
import torch

from kvoffload.config import KVLayout
from kvoffload.errors import ClosedError, ForkedProcessError, HostMemoryError
from kvoffload.storage import host_buffer
from kvoffload.storage.host_buffer import HostKVBuffer, pin_chunk_ranges

PAGE = mmap.PAGESIZE
GIB = 1 << 30


def small_layout(**overrides: object) -> KVLayout:
    values: dict[str, object] = {
        "num_layers": 3,
        "num_kv_heads": 2,
        "head_size": 4,
        "dtype": "float16",
        "block_size": 4,
    }
    values.update(overrides)
    return KVLayout(**values)


def page_layout() -> KVLayout:
    """One block is exactly one 4 KiB-multiple: 2 layers * 2 * 16 * 4 * 8 * 2 bytes."""
    return KVLayout(num_layers=2, num_kv_heads=4, head_size=8, dtype="float16", block_size=16)


class FakeRegistrar:
    """Records registrations; can fail on the ``fail_at``-th one (0-based)."""

    def __init__(self, fail_at: int | None = None, fail_unregister: bool = False) -> None:
        self.fail_at = fail_at
        self.fail_unregister = fail_unregister
        self.registered: list[tuple[int, int]] = []
        self.unregistered: list[int] = []
        self.threads: set[int] = set()

    def register(self, ptr: int, nbytes: int) -> None:
        self.threads.add(threading.get_ident())
        if self.fail_at is not None and len(self.registered) == self.fail_at:
            raise RuntimeError("cudaErrorInvalidValue: invalid argument")
        self.registered.append((ptr, nbytes))

    def unregister(self, ptr: int) -> None:
        self.unregistered.append(ptr)
        if self.fail_unregister:
            raise RuntimeError("cudaErrorHostMemoryNotRegistered")

    @property
    def pinned(self) -> set[int]:
        return {p for p, _ in self.registered} - set(self.unregistered)


@pytest.fixture
def fresh_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pageable fallback warns once per process: make this test the first."""
    monkeypatch.setattr(host_buffer, "_warned_pageable", False)


# -- shapes and views ----------------------------------------------------------------------


def test_sizes_and_shapes() -> None:
    layout = small_layout()
    buf = HostKVBuffer(layout, 5, pin_memory="never")
    per_block = layout.bytes_per_block
    assert per_block == 3 * 2 * 4 * 2 * 4 * 2
    assert buf.layout is layout
    assert buf.num_blocks == 5
    assert buf.nbytes == 5 * per_block
    assert buf.raw.shape == (5 * per_block,)
    assert buf.raw.dtype == torch.uint8
    assert buf.blocks.shape == (5, 3, 2, 4, 2, 4)
    assert buf.blocks.dtype == torch.float16
    assert buf.block(2).shape == (3, 2, 4, 2, 4)
    assert buf.layer(1).shape == (5, 2, 4, 2, 4)
    assert buf.block_bytes(4).shape == (per_block,)
    assert not buf.is_pinned
    assert buf.num_pinned_chunks == 0
    assert bool((buf.raw == 0).all())
    buf.close()


def test_block_views_are_contiguous_byte_ranges() -> None:
    layout = small_layout()
    buf = HostKVBuffer(layout, 4, pin_memory="never")
    base = buf.raw.data_ptr()
    size = layout.bytes_per_block
    for i in range(4):
        assert buf.block(i).is_contiguous()
        assert buf.block(i).data_ptr() == base + i * size
        assert buf.block_bytes(i).is_contiguous()
        assert buf.block_bytes(i).data_ptr() == base + i * size
        assert buf.block_bytes(i).numel() == size
    buf.close()


def test_writing_a_block_view_changes_exactly_its_bytes() -> None:
    layout = small_layout()
    buf = HostKVBuffer(layout, 4, pin_memory="never")
    size = layout.bytes_per_block
    buf.block(2).fill_(1.5)
    nonzero = torch.nonzero(buf.raw).flatten()
    assert int(nonzero.min()) >= 2 * size
    assert int(nonzero.max()) < 3 * size
    assert bool((buf.blocks[2] == 1.5).all())
    assert bool((buf.blocks[[0, 1, 3]] == 0).all())
    # the same bytes through the byte view
    expected = torch.full((size // 2,), 1.5, dtype=torch.float16).view(torch.uint8)
    assert torch.equal(buf.block_bytes(2), expected)
    buf.close()


def test_layer_view_is_strided_over_blocks() -> None:
    layout = small_layout()
    buf = HostKVBuffer(layout, 4, pin_memory="never")
    layer = buf.layer(1)
    assert not layer.is_contiguous()
    assert layer.stride(0) * layer.element_size() == layout.bytes_per_block
    layer[3].fill_(2.0)
    assert bool((buf.block(3)[1] == 2.0).all())
    assert bool((buf.block(3)[0] == 0).all())
    assert bool((buf.block(3)[2] == 0).all())
    assert bool((buf.blocks[:3] == 0).all())
    assert layer.data_ptr() == buf.raw.data_ptr() + layout.bytes_per_layer_block
    buf.close()


def test_size_is_exact_with_no_rounding() -> None:
    layout = small_layout()  # 384-byte blocks: 7 of them are not a power of two
    buf = HostKVBuffer(layout, 7, pin_memory="never")
    assert buf.raw.numel() == 7 * layout.bytes_per_block
    buf.close()


@pytest.mark.parametrize("n", [0, -2])
def test_bad_num_blocks(n: int) -> None:
    with pytest.raises(ValueError, match=f"num_blocks must be >= 1, got {n}"):
        HostKVBuffer(small_layout(), n, pin_memory="never")


@pytest.mark.parametrize("chunk", [0, (256 * GIB) + 1])
def test_bad_pin_chunk_bytes(chunk: int) -> None:
    with pytest.raises(ValueError, match="pin_chunk_bytes must be in"):
        HostKVBuffer(small_layout(), 1, pin_memory="never", pin_chunk_bytes=chunk)


# -- close --------------------------------------------------------------------------------


def test_close_is_idempotent_and_use_after_close_raises() -> None:
    registrar = FakeRegistrar()
    buf = HostKVBuffer(page_layout(), 8, registrar=registrar, pin_chunk_bytes=3 * PAGE)
    assert buf.is_pinned
    buf.close()
    assert registrar.pinned == set()
    calls = list(registrar.unregistered)
    buf.close()
    assert registrar.unregistered == calls
    assert not buf.is_pinned
    for use in (
        lambda: buf.blocks,
        lambda: buf.raw,
        lambda: buf.block(0),
        lambda: buf.block_bytes(0),
        lambda: buf.layer(0),
    ):
        with pytest.raises(ClosedError, match="HostKVBuffer is closed"):
            use()
    assert buf.nbytes == 8 * page_layout().bytes_per_block


def test_close_keeps_unpinning_when_one_unregister_fails(caplog: pytest.LogCaptureFixture) -> None:
    registrar = FakeRegistrar(fail_unregister=True)
    buf = HostKVBuffer(page_layout(), 8, registrar=registrar, pin_chunk_bytes=2 * PAGE)
    n = buf.num_pinned_chunks
    assert n == 4
    with caplog.at_level(logging.WARNING, logger="kvoffload"):
        buf.close()
    assert len(registrar.unregistered) == n
    failures = [r for r in caplog.records if "host_unregister_failed" in r.getMessage()]
    assert len(failures) == n


# -- pinning ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("blocks", "chunk"),
    [(8, 3 * PAGE), (8, 3 * PAGE + 100), (8, 100), (7, 2 * PAGE), (1, GIB), (16, 16 * PAGE)],
)
def test_pinning_chunks_are_aligned_bounded_and_cover_once(blocks: int, chunk: int) -> None:
    registrar = FakeRegistrar()
    layout = page_layout()
    buf = HostKVBuffer(layout, blocks, registrar=registrar, pin_chunk_bytes=chunk)
    base = buf.raw.data_ptr()
    regs = registrar.registered
    assert buf.is_pinned
    assert buf.num_pinned_chunks == len(regs)
    assert base % PAGE == 0
    limit = max(PAGE, chunk - chunk % PAGE)
    position = base
    for ptr, size in regs:
        assert ptr % PAGE == 0
        assert 0 < size <= limit
        assert ptr == position  # contiguous, no gap, no overlap
        position += size
    assert position == base + buf.nbytes
    assert [(p - base, s) for p, s in regs] == pin_chunk_ranges(buf.nbytes, chunk)
    buf.close()
    assert sorted(registrar.unregistered) == sorted(p for p, _ in regs)


@pytest.mark.parametrize("k", [0, 1, 3])
def test_fm48_pin_failure_on_chunk_k_unpins_and_raises(k: int) -> None:
    registrar = FakeRegistrar(fail_at=k)
    with pytest.raises(HostMemoryError, match=f"pinning chunk {k} ") as info:
        HostKVBuffer(
            page_layout(), 8, pin_memory="always", registrar=registrar, pin_chunk_bytes=2 * PAGE
        )
    assert len(registrar.registered) == k
    assert sorted(registrar.unregistered) == sorted(p for p, _ in registrar.registered)
    assert registrar.pinned == set()
    assert "invalid argument" in str(info.value)
    assert isinstance(info.value.__cause__, RuntimeError)


@pytest.mark.parametrize("k", [0, 2])
@pytest.mark.usefixtures("fresh_warning")
def test_fm48_pin_failure_with_auto_falls_back_with_one_warning(
    k: int, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.DEBUG, logger="kvoffload"):
        registrar = FakeRegistrar(fail_at=k)
        buf = HostKVBuffer(
            page_layout(), 8, pin_memory="auto", registrar=registrar, pin_chunk_bytes=2 * PAGE
        )
        assert not buf.is_pinned
        assert buf.num_pinned_chunks == 0
        assert registrar.pinned == set()
        assert len(registrar.unregistered) == k
        buf.block(1).fill_(3.0)  # pageable memory still works
        assert bool((buf.block(1) == 3.0).all())
        buf.close()
        # a second fallback in the same process does not warn again
        again = HostKVBuffer(
            page_layout(), 2, pin_memory="auto", registrar=FakeRegistrar(fail_at=0)
        )
        again.close()
    warnings_logged = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings_logged) == 1
    message = warnings_logged[0].getMessage()
    assert message.startswith("event=host_buffer_pageable")
    assert f"chunk {k}" in message
    assert warnings_logged[0].name == "kvoffload.storage"


def test_never_does_not_pin_even_with_a_registrar() -> None:
    registrar = FakeRegistrar()
    buf = HostKVBuffer(page_layout(), 4, pin_memory="never", registrar=registrar)
    assert registrar.registered == []
    assert not buf.is_pinned
    buf.close()
    assert registrar.unregistered == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_always_without_cuda_or_registrar_raises() -> None:
    with pytest.raises(HostMemoryError, match="pin_memory='always' but CUDA is not available"):
        HostKVBuffer(small_layout(), 2, pin_memory="always")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
@pytest.mark.usefixtures("fresh_warning")
def test_auto_without_cuda_is_pageable_and_quiet(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kvoffload"):
        buf = HostKVBuffer(small_layout(), 2)
    assert not buf.is_pinned
    assert caplog.records == []
    buf.close()


# -- FM-49: never one giant registration ----------------------------------------------------


def _reject_512g(ptr: int, nbytes: int) -> None:
    """Like cudaHostRegister on the affected drivers: 512 GiB or more fails."""
    if nbytes >= 512 * GIB:
        raise RuntimeError(f"cudaHostRegister({ptr:#x}, {nbytes}): invalid argument")


@pytest.mark.parametrize("chunk", [1 << 20, GIB, 3 * GIB + 5, 128 * GIB, 256 * GIB])
def test_fm49_600_gib_is_registered_in_chunks_below_512_gib(chunk: int) -> None:
    nbytes = 600 * GIB
    ranges = pin_chunk_ranges(nbytes, chunk, page_size=4096)
    for offset, size in ranges:
        _reject_512g(offset, size)
        assert size <= 256 * GIB
        assert size <= chunk
        assert offset % 4096 == 0
    assert sum(size for _, size in ranges) == nbytes
    assert all(a + s == b for (a, s), (b, _) in itertools.pairwise(ranges))
    assert ranges[0][0] == 0


def test_fm49_chunk_above_256_gib_is_refused() -> None:
    with pytest.raises(ValueError, match="pin_chunk_bytes must be in"):
        pin_chunk_ranges(600 * GIB, 512 * GIB)


def test_pin_chunk_ranges_edges() -> None:
    assert pin_chunk_ranges(0, GIB) == []
    assert pin_chunk_ranges(10, GIB) == [(0, 10)]
    assert pin_chunk_ranges(3 * PAGE, PAGE) == [(0, PAGE), (PAGE, PAGE), (2 * PAGE, PAGE)]
    # below a page: one page per chunk, never a misaligned offset
    assert pin_chunk_ranges(2 * PAGE, 100) == [(0, PAGE), (PAGE, PAGE)]
    assert pin_chunk_ranges(5000, 4096, page_size=4096) == [(0, 4096), (4096, 904)]
    with pytest.raises(ValueError, match="nbytes"):
        pin_chunk_ranges(-1, GIB)
    with pytest.raises(ValueError, match="page_size"):
        pin_chunk_ranges(1, GIB, page_size=0)


# -- FM-50: the memory used is the memory asked for ------------------------------------------


def _rss_bytes() -> int:
    status = Path("/proc/self/status")
    for line in status.read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS line")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc")
def test_fm50_rss_grows_by_the_request_only() -> None:
    layout = KVLayout(num_layers=4, num_kv_heads=8, head_size=128, dtype="float16", block_size=16)
    num_blocks = (256 << 20) // layout.bytes_per_block
    request = num_blocks * layout.bytes_per_block
    assert request == 256 << 20
    torch.zeros(1 << 16).fill_(1.0)  # warm up torch's kernels and threads
    gc.collect()
    before = _rss_bytes()
    buf = HostKVBuffer(layout, num_blocks, pin_memory="never")
    buf.raw.fill_(0x5A)
    grown = _rss_bytes() - before
    assert grown <= 1.05 * request, (grown, request)
    assert grown >= 0.95 * request, (grown, request)  # every page really was written
    buf.close()
    del buf
    gc.collect()
    assert _rss_bytes() - before < 0.05 * request  # close() gave the memory back


# -- FM-52: fork ----------------------------------------------------------------------------


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_fm52_use_in_a_forked_child_raises() -> None:
    buf = HostKVBuffer(small_layout(), 2, pin_memory="never")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork of a threaded process
        pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 3
        try:
            buf.block(0)
            code = 1
        except ForkedProcessError as exc:
            code = 0 if str(os.getpid()) in str(exc) else 4
        except BaseException:
            code = 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert buf.block(0).shape == (3, 2, 4, 2, 4)  # the parent is unaffected
    buf.close()


# -- async construction ---------------------------------------------------------------------


@pytest.mark.asyncio
async def test_create_builds_in_a_worker_thread() -> None:
    registrar = FakeRegistrar()
    buf = await HostKVBuffer.create(
        page_layout(), 4, pin_memory="always", registrar=registrar, pin_chunk_bytes=PAGE
    )
    assert buf.is_pinned
    assert buf.num_pinned_chunks == 4
    assert registrar.threads
    assert threading.get_ident() not in registrar.threads
    buf.close()


@pytest.mark.asyncio
async def test_create_raises_the_same_errors() -> None:
    with pytest.raises(HostMemoryError, match="pinning chunk 1"):
        await HostKVBuffer.create(
            page_layout(),
            4,
            pin_memory="always",
            registrar=FakeRegistrar(fail_at=1),
            pin_chunk_bytes=PAGE,
        )


def test_available_host_memory_reads_this_machine() -> None:
    available = host_buffer.available_host_memory()
    if not Path("/proc/meminfo").exists():
        pytest.skip("no /proc/meminfo")
    assert available is not None
    assert 0 < available < 1 << 50


def test_a_buffer_larger_than_available_memory_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # FM-50: the size is validated against MemAvailable / the cgroup limit up front.
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_size=8, dtype="float16", block_size=4)
    need = 10 * layout.bytes_per_block
    monkeypatch.setattr(host_buffer, "available_host_memory", lambda: need - 1)
    with pytest.raises(HostMemoryError, match=rf"{need} bytes .* exceeds the {need - 1} bytes"):
        HostKVBuffer(layout, 10, pin_memory="never")
    monkeypatch.setattr(host_buffer, "available_host_memory", lambda: need)
    HostKVBuffer(layout, 10, pin_memory="never").close()


def test_cgroup_limit_counts_when_lower(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    values = {
        "/proc/meminfo": "MemTotal: 100 kB\nMemAvailable:    8000000 kB\n",
        "/sys/fs/cgroup/memory.max": "3000000\n",
        "/sys/fs/cgroup/memory.current": "1000000\n",
    }
    real_open = open

    def fake_open(path, *args, **kwargs):  # type: ignore[no-untyped-def]
        if path in values:
            target = tmp_path / Path(path).name
            target.write_text(values[path])
            return real_open(target, *args, **kwargs)
        if str(path).startswith(("/proc/", "/sys/")):
            raise OSError(path)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr("builtins.open", fake_open)
    assert host_buffer.available_host_memory() == 2_000_000
    values["/sys/fs/cgroup/memory.max"] = "max\n"
    assert host_buffer.available_host_memory() == 8_000_000 * 1024
