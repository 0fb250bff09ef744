"""KVOffloader with a disk tier: cascade on store, promotion on lookup, integrity, faults."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import anyio
import pytest
from tier_helpers import (
    BS,
    check,
    compute_and_store,
    config,
    layout,
    lookup_load,
    make_kv,
    patch_file,
    settle,
    tier_stats,
    tokens,
    wait_until,
)

from kvoffload.errors import ConfigError
from kvoffload.offloader import KVOffloader
from kvoffload.testing import ControllableCopyEngine
from kvoffload.tiers.manager import TierManager

pytestmark = pytest.mark.anyio

NBYTES = layout().bytes_per_block


def disk(path: Path, **kw: object) -> dict[str, object]:
    values: dict[str, object] = {"kind": "disk", "path": str(path), "capacity_bytes": "4MiB"}
    values.update(kw)
    return values


async def test_store_cascades_and_promotion_serves_after_reset(tmp_path: Path) -> None:
    kv = make_kv()
    async with KVOffloader(config([disk(tmp_path / "kv.bin")]), kv) as off:
        prompt = tokens(1, 6)
        await compute_and_store(off, kv, "a", prompt, range(6))
        await settle(off)
        check(off)
        stats = tier_stats(off)
        assert stats.blocks_written == 6
        assert stats.bytes_written == 6 * NBYTES
        assert await off.reset()
        assert off.pool.num_cached == 0
        # Without allow_defer the first lookup answers from CPU (nothing) and starts the
        # promotion; once it landed, the hit covers the whole prompt.
        assert off.lookup("probe", off.hash_prompt(prompt), len(prompt)) == 0
        off.release("probe")
        await settle(off)
        assert await lookup_load(off, kv, "b", prompt, range(10, 16), allow_defer=False) == 6 * BS
        stats = tier_stats(off)
        assert stats.blocks_read == 6
        assert stats.blocks_promoted == 6
        assert stats.failed_checks == 0
        check(off)


async def test_allow_defer_waits_for_the_promotion(tmp_path: Path) -> None:
    kv = make_kv()
    async with KVOffloader(config([disk(tmp_path / "kv.bin")]), kv) as off:
        prompt = tokens(2, 5)
        hashes = await compute_and_store(off, kv, "a", prompt, range(5))
        await settle(off)
        await off.reset()
        assert off.lookup("b", hashes, len(prompt), allow_defer=True) is None
        assert off.tiers is not None
        assert off.tiers.is_promoting(hashes[0])
        check(off)
        assert await lookup_load(off, kv, "b", prompt, range(20, 25)) == 5 * BS
        assert off.statistics().tiers.deferred_lookups >= 1  # type: ignore[union-attr]
        check(off)


async def test_partial_cpu_hit_is_extended_from_the_tier(tmp_path: Path) -> None:
    kv = make_kv()
    async with KVOffloader(config([disk(tmp_path / "kv.bin")]), kv) as off:
        prompt = tokens(3, 6)
        hashes = await compute_and_store(off, kv, "a", prompt, range(6))
        await settle(off)
        # Drop blocks 3..5 from CPU only: the CPU run stops at 3, the tier has the rest.
        for block_hash in hashes[3:]:
            block = off.pool.get_cached(block_hash)
            assert block is not None
            off.pool.unpublish(block)
        assert await lookup_load(off, kv, "b", prompt, range(6, 12)) == 6 * BS
        assert tier_stats(off).blocks_promoted == 3
        check(off)


async def test_persistent_disk_serves_a_new_process(tmp_path: Path) -> None:
    path = tmp_path / "kv.bin"
    kv = make_kv()
    prompt = tokens(4, 4)
    async with KVOffloader(config([disk(path, persist=True)]), kv) as off:
        await compute_and_store(off, kv, "a", prompt, range(4))
        await settle(off)
    assert path.exists()
    kv2 = make_kv()
    async with KVOffloader(config([disk(path, persist=True)]), kv2) as off:
        assert await lookup_load(off, kv2, "b", prompt, range(4, 8)) == 4 * BS
        assert tier_stats(off).blocks_promoted == 4
    # A different namespace never sees those blocks.
    async with KVOffloader(config([disk(path, persist=True)], model_id="other"), kv2) as off:
        assert await lookup_load(off, kv2, "c", prompt, range(4, 8)) == 0
        assert tier_stats(off).blocks_read == 0


async def test_corrupted_block_is_never_served(tmp_path: Path) -> None:
    path = tmp_path / "kv.bin"
    kv = make_kv()
    async with KVOffloader(config([disk(path)]), kv) as off:
        prompt = tokens(5, 4)
        hashes = await compute_and_store(off, kv, "a", prompt, range(4))
        await settle(off)
        tier = off.tiers.tiers[0]  # type: ignore[union-attr]
        slot = tier._index[hashes[2]]  # type: ignore[attr-defined]
        offset = tier._offset(slot) + 77  # type: ignore[attr-defined]
        patch_file(path, offset, lambda old: bytes([old[0] ^ 0x01]))
        await off.reset()
        # The hit stops before the bad block; the engine recomputes from there.
        assert await lookup_load(off, kv, "b", prompt, range(8, 12)) == 2 * BS
        stats = tier_stats(off)
        assert stats.failed_checks == 1
        assert await tier.exists([hashes[2]]) == 0  # deleted from the tier
        assert off.pool.get_cached(hashes[2]) is None
        check(off)


async def test_deleted_file_keeps_serving_from_cpu_then_recovers(tmp_path: Path) -> None:
    path = tmp_path / "kv.bin"
    kv = make_kv()
    cfg = config([disk(path, retry_initial_s=0.02, retry_max_s=0.05)])
    async with KVOffloader(cfg, kv) as off:
        await compute_and_store(off, kv, "a", tokens(6, 2), range(2))
        await settle(off)
        path.unlink()
        path.mkdir()  # the tier cannot come back while this sits at its path
        await compute_and_store(off, kv, "b", tokens(7, 2), range(2, 4))
        await settle(off)
        stats = tier_stats(off)
        assert not stats.healthy
        assert stats.errors >= 1
        assert "replaced" in stats.last_error
        # The engine keeps working from the CPU pool.
        assert await lookup_load(off, kv, "c", tokens(7, 2), range(4, 6)) == 2 * BS
        await compute_and_store(off, kv, "d", tokens(8, 2), range(6, 8))
        assert tier_stats(off).writes_skipped_unhealthy >= 2
        path.rmdir()
        await wait_until(lambda: tier_stats(off).healthy)
        assert tier_stats(off).recoveries == 1
        written = tier_stats(off).blocks_written
        await compute_and_store(off, kv, "e", tokens(9, 3), range(8, 11))
        await settle(off)
        assert tier_stats(off).blocks_written == written + 3
        await off.reset()
        assert await lookup_load(off, kv, "f", tokens(9, 3), range(12, 15)) == 3 * BS
        check(off)


async def test_unopenable_tier_starts_unhealthy(tmp_path: Path) -> None:
    kv = make_kv()
    cfg = config([disk(tmp_path / "missing-dir" / "kv.bin", retry_initial_s=0.02)])
    async with KVOffloader(cfg, kv) as off:
        assert not tier_stats(off).healthy
        assert tier_stats(off).unhealthy_events == 1
        assert "cannot open" in tier_stats(off).last_error
        prompt = tokens(10, 2)
        await compute_and_store(off, kv, "a", prompt, range(2))
        assert await lookup_load(off, kv, "b", prompt, range(2, 4)) == 2 * BS
        (tmp_path / "missing-dir").mkdir()
        await wait_until(lambda: tier_stats(off).healthy)
        check(off)


async def test_reset_during_promotion_publishes_nothing(tmp_path: Path) -> None:
    kv = make_kv()
    async with KVOffloader(config([disk(tmp_path / "kv.bin")]), kv) as off:
        prompt = tokens(11, 4)
        hashes = await compute_and_store(off, kv, "a", prompt, range(4))
        await settle(off)
        await off.reset()
        assert off.lookup("b", hashes, len(prompt), allow_defer=True) is None
        await off.reset()
        await settle(off)
        assert off.pool.num_cached == 0
        check(off)


async def test_write_downs_hold_refs_and_respect_the_bound(tmp_path: Path) -> None:
    kv = make_kv()
    gate = anyio.Event()
    cfg = config([disk(tmp_path / "kv.bin", max_queued_writes=3, max_in_flight=2)])
    async with KVOffloader(cfg, kv) as off:
        tiers = off.tiers
        assert isinstance(tiers, TierManager)
        tier = tiers.tiers[0]
        real_put = tier.put

        async def slow_put(blocks):  # type: ignore[no-untyped-def]
            await gate.wait()
            return await real_put(blocks)

        tier.put = slow_put  # type: ignore[method-assign]
        await compute_and_store(off, kv, "a", tokens(12, 5), range(5))
        await off.drain()
        stats = tier_stats(off)
        assert stats.writes_held == 3
        assert stats.writes_skipped_full == 2
        # A block being written is invisible to lookups of the tier until its write ended.
        assert await tier.exists(off.hash_prompt(tokens(12, 5))) == 0
        check(off)  # the three held blocks are counted as referenced
        assert off.pool.num_free == 16 - 3
        # Loads still proceed while writes are stuck.
        assert await lookup_load(off, kv, "b", tokens(12, 5), range(5, 10)) == 5 * BS
        gate.set()
        await settle(off)
        stats = tier_stats(off)
        assert stats.blocks_written == 3
        assert stats.max_writes_held == 3
        assert off.pool.num_free == 16
        check(off)


async def test_tiers_need_the_offloaders_host_buffer(tmp_path: Path) -> None:
    kv = make_kv()
    with pytest.raises(ConfigError, match="host buffer"):
        async with KVOffloader(
            config([disk(tmp_path / "kv.bin")]), kv, copy_engine=ControllableCopyEngine()
        ):
            pass


async def test_close_releases_every_ref(tmp_path: Path) -> None:
    kv = make_kv()
    gate = anyio.Event()
    off = KVOffloader(config([disk(tmp_path / "kv.bin")]), kv)
    async with off:
        tier = off.tiers.tiers[0]  # type: ignore[union-attr]
        real_put = tier.put

        async def slow_put(blocks):  # type: ignore[no-untyped-def]
            await gate.wait()
            return await real_put(blocks)

        tier.put = slow_put  # type: ignore[method-assign]
        await compute_and_store(off, kv, "a", tokens(13, 4), range(4))
        await off.drain()
        assert tier_stats(off).writes_held == 4
    assert off.pool.num_free == off.pool.num_blocks
    assert off.tiers.statistics().refs_held == 0  # type: ignore[union-attr]
    assert not (tmp_path / "kv.bin").exists()


async def test_promotion_never_evicts_a_pinned_block(tmp_path: Path) -> None:
    kv = make_kv()
    async with KVOffloader(config([disk(tmp_path / "kv.bin")], num_cpu_blocks=4), kv) as off:
        a = tokens(14, 4)
        await compute_and_store(off, kv, "a", a, range(4))
        await settle(off)
        await off.reset()
        b = tokens(15, 4)
        hashes_b = await compute_and_store(off, kv, "b", b, range(4, 8))
        await settle(off)
        assert off.lookup("pin", hashes_b, len(b)) == 4 * BS  # pins all four CPU blocks
        assert off.lookup("x", off.hash_prompt(a), len(a)) == 0
        await settle(off)
        stats = off.statistics().tiers
        assert stats is not None
        assert stats.promotions_no_space == 1
        assert all(off.pool.get_cached(h) is not None for h in hashes_b)
        check(off)
        off.release("pin")
        off.finish("pin")
        off.finish("x")
        assert await lookup_load(off, kv, "y", a, range(8, 12)) == 4 * BS
        check(off)


async def test_close_during_a_promotion_releases_its_blocks(tmp_path: Path) -> None:
    kv = make_kv()
    gate = anyio.Event()
    off = KVOffloader(config([disk(tmp_path / "kv.bin")]), kv)
    async with off:
        prompt = tokens(16, 4)
        hashes = await compute_and_store(off, kv, "a", prompt, range(4))
        await settle(off)
        await off.reset()
        tier = off.tiers.tiers[0]  # type: ignore[union-attr]
        real_get = tier.get

        async def stuck_get(block_hashes, into):  # type: ignore[no-untyped-def]
            await gate.wait()
            return await real_get(block_hashes, into)

        tier.get = stuck_get  # type: ignore[method-assign]
        assert off.lookup("b", hashes, len(prompt), allow_defer=True) is None
        await wait_until(lambda: off.tiers.statistics().refs_held == 4)  # type: ignore[union-attr]
        check(off)
    assert off.pool.num_free == off.pool.num_blocks
    assert off.pool.num_cached == 0
    assert off.tiers.statistics().refs_held == 0  # type: ignore[union-attr]


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_cascade_and_promotion_on_trio(tmp_path: Path) -> None:
    kv = make_kv()
    async with KVOffloader(config([disk(tmp_path / "kv.bin")]), kv) as off:
        prompt = tokens(17, 3)
        await compute_and_store(off, kv, "a", prompt, range(3))
        await settle(off)
        await off.reset()
        assert await lookup_load(off, kv, "b", prompt, range(3, 6)) == 3 * BS
        assert tier_stats(off).blocks_promoted == 3
        check(off)


@pytest.fixture
def read_only_dir(tmp_path: Path) -> Iterator[tuple[Path, Callable[[bool], None]]]:
    """A directory on a bind mount this test can switch between read-only and read-write."""
    src, dst = tmp_path / "src", tmp_path / "mnt"
    src.mkdir()
    dst.mkdir()
    bind = ["mount", "--bind", str(src), str(dst)]
    if shutil.which("mount") is None or subprocess.run(bind, check=False).returncode:
        pytest.skip("cannot bind-mount here (needs mount and CAP_SYS_ADMIN)")

    def set_read_only(read_only: bool) -> None:
        mode = "ro" if read_only else "rw"
        subprocess.run(["mount", "-o", f"remount,bind,{mode}", str(dst)], check=True)

    try:
        yield dst, set_read_only
    finally:
        subprocess.run(["umount", str(dst)], check=False)


async def test_read_only_file_system_keeps_the_tier_out_until_writable(
    read_only_dir: tuple[Path, Callable[[bool], None]],
) -> None:
    directory, set_read_only = read_only_dir
    set_read_only(True)
    kv = make_kv()
    cfg = config([disk(directory / "kv.bin", retry_initial_s=0.02, retry_max_s=0.05)])
    async with KVOffloader(cfg, kv) as off:
        stats = tier_stats(off)
        assert not stats.healthy
        assert "EROFS" in stats.last_error
        prompt = tokens(18, 2)
        await compute_and_store(off, kv, "a", prompt, range(2))
        assert await lookup_load(off, kv, "b", prompt, range(2, 4)) == 2 * BS
        assert tier_stats(off).writes_skipped_unhealthy == 2
        set_read_only(False)
        await wait_until(lambda: tier_stats(off).healthy)
        await compute_and_store(off, kv, "c", tokens(19, 2), range(4, 6))
        await settle(off)
        assert tier_stats(off).blocks_written == 2
        check(off)
