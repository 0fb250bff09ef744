"""`KvOffloadHiCacheStorage` with SGLang's real ``HiCacheStorage`` base, host pools (MHA and
MLA, layer-first and page-first), backend factory and cache-controller calls."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from conftest import PAGE, Factory, disk_tier, extra_config, make_pool, storage_config
from sglang.srt.managers.cache_controller import HiCacheController
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageExtraInfo
from sglang.srt.mem_cache.storage import StorageBackendFactory
from tier_helpers import RedisServer

from kvoffload.errors import ClosedError, ConfigError, TierError
from kvoffload.integrations.sglang import KvOffloadHiCacheStorage
from kvoffload.tier_config import parse_tier_settings
from kvoffload.tiers import TierBridge, engine_namespace
from kvoffload.tiers.disk_layout import file_bytes

POOLS = [(kind, layout) for kind in ("mha", "mla") for layout in ("layer_first", "page_first")]


def chain(name: str, n: int) -> list[str]:
    return [f"{name}-{i:04d}" for i in range(n)]


def indices(pages: list[int]) -> torch.Tensor:
    """Host-pool token indices of whole pages, as the cache controller passes them."""
    return torch.tensor([p * PAGE + t for p in pages for t in range(PAGE)], dtype=torch.int64)


def fill(pool: Any, pages: list[int], seed: int) -> list[torch.Tensor]:
    """Random data in host pages; returns a copy of each page."""
    gen = torch.Generator().manual_seed(seed)
    copies = []
    for p in pages:
        data = torch.rand(pool.get_dummy_flat_data_page().numel(), generator=gen)
        pool.set_from_flat_data_page(p * PAGE, data)
        copies.append(pool.get_data_page(p * PAGE, flat=True).clone())
    return copies


def page(pool: Any, p: int) -> torch.Tensor:
    return pool.get_data_page(p * PAGE, flat=True)


def controller(backend: HiCacheStorage) -> Any:
    """Just what HiCacheController's zero-copy page calls read of their controller."""
    return SimpleNamespace(storage_backend=backend)


def controller_set(backend: HiCacheStorage, keys: list[str], pages: list[int], **kw: Any) -> bool:
    info = HiCacheStorageExtraInfo(**kw)
    return HiCacheController._page_set_zero_copy(controller(backend), keys, indices(pages), info)  # type: ignore[arg-type]


def controller_get(backend: HiCacheStorage, keys: list[str], pages: list[int]) -> int:
    op = SimpleNamespace(request_id="r1")
    return HiCacheController._page_get_zero_copy(controller(backend), op, keys, indices(pages))  # type: ignore[arg-type]


@pytest.mark.parametrize(("kind", "layout"), POOLS, ids=[f"{k}-{lay}" for k, lay in POOLS])
def test_pages_round_trip_exactly(
    backend_factory: Factory, tmp_path: Path, kind: str, layout: str
) -> None:
    pool = make_pool(kind, layout)
    backend = backend_factory(pool, extra_config([disk_tier(tmp_path / "kv.bin")]))
    assert isinstance(backend, KvOffloadHiCacheStorage)
    keys = chain("a", 20)
    src = list(range(1, 21))
    written = fill(pool, src, seed=1)
    assert controller_set(backend, keys, src, prefix_keys=[])
    assert backend.batch_exists(keys) == 20
    dst = list(range(30, 50))
    for p in dst:
        pool.set_from_flat_data_page(p * PAGE, torch.zeros_like(written[0]))
    assert controller_get(backend, keys, dst) == 20
    for want, p in zip(written, dst, strict=True):
        assert torch.equal(page(pool, p), want)


def test_exists_counts_the_leading_run_only(backend_factory: Factory, tmp_path: Path) -> None:
    pool = make_pool("mha", "page_first")
    backend = backend_factory(pool, extra_config([disk_tier(tmp_path / "kv.bin")]))
    keys = chain("a", 10)
    fill(pool, list(range(10)), seed=2)
    assert backend.batch_set_v1(keys[:4], indices([0, 1, 2, 3])) == [True] * 4
    assert backend.batch_set_v1(keys[5:], indices([5, 6, 7, 8, 9])) == [True] * 5
    assert backend.batch_exists(keys) == 4  # the later pages do not count past the gap
    assert backend.batch_exists(keys[5:]) == 5
    assert backend.batch_exists(["nothing", *keys]) == 0
    assert backend.batch_exists([]) == 0
    backend.clear()  # SGLang's cache flush: every page this backend wrote is gone
    assert backend.batch_exists(keys) == 0
    assert backend.batch_exists(keys[5:]) == 0


def test_a_corrupted_page_stops_the_run_and_is_never_served(
    backend_factory: Factory, tmp_path: Path
) -> None:
    pool = make_pool("mla", "page_first")
    path = tmp_path / "kv.bin"
    backend = backend_factory(pool, extra_config([disk_tier(path)]))
    keys = chain("a", 8)
    written = fill(pool, list(range(8)), seed=3)
    assert all(backend.batch_set_v1(keys, indices(list(range(8)))))
    # flip one byte of page 3's payload in the tier's file
    raw = bytearray(path.read_bytes())
    at = raw.find(written[3].numpy().tobytes()[:64])
    assert at >= 0
    raw[at + 5] ^= 0xFF
    path.write_bytes(bytes(raw))
    dst = list(range(20, 28))
    sentinel = torch.full_like(written[0], -1.0)
    for p in dst:
        pool.set_from_flat_data_page(p * PAGE, sentinel)
    assert backend.batch_get_v1(keys, indices(dst)) == [True] * 3 + [False] * 5
    for i in range(3):
        assert torch.equal(page(pool, dst[i]), written[i])
    for p in dst[3:]:  # nothing from the bad page on was written into the host pool
        assert torch.equal(page(pool, p), sentinel)
    # the corrupted page was deleted: the chain now stops before it
    assert backend.batch_exists(keys) == 3


def test_a_dead_tier_raises_and_never_returns_none(backend_factory: Factory) -> None:
    pool = make_pool("mha", "layer_first")
    redis = {"kind": "redis", "url": "redis://127.0.0.1:1/0", "op_timeout_s": 0.5}
    backend = backend_factory(pool, extra_config([redis], max_pages=100))
    keys = chain("a", 4)
    fill(pool, [0, 1, 2, 3], seed=4)
    assert backend.batch_exists(keys) == 0  # a lookup is a miss at once
    with pytest.raises(TierError, match="no tier can write"):
        backend.batch_set_v1(keys, indices([0, 1, 2, 3]))
    with pytest.raises(TierError, match="no tier can read"):
        backend.batch_get_v1(keys, indices([4, 5, 6, 7]))
    backend.close()  # type: ignore[attr-defined]
    with pytest.raises(ClosedError):
        backend.batch_exists(keys)


def test_heads_of_chains_survive_pressure(backend_factory: Factory, tmp_path: Path) -> None:
    """Requests progress together (the first batch of pages of each, then the second ...)
    through a disk tier with room for half their pages: a tier evicting by recency keeps
    the tails, whose heads are gone, and serves no hit; the backend keeps heads."""
    pool = make_pool("mha", "page_first")
    probe = pool.get_dummy_flat_data_page()
    nbytes = probe.numel() * probe.element_size()
    slots = next(n for n in range(1, 1 << 16) if file_bytes(n, nbytes) >= 1 << 20)
    capacity = file_bytes(slots, nbytes)
    backend = backend_factory(
        pool, extra_config([disk_tier(tmp_path / "kv.bin", capacity_bytes=capacity)])
    )
    chains = [chain(f"c{j}", 12) for j in range(slots // 6)]
    fill(pool, list(range(4)), seed=5)
    for start in range(0, 12, 4):
        for keys in chains:
            backend.batch_set_v1(
                keys[start : start + 4],
                indices([0, 1, 2, 3]),
                HiCacheStorageExtraInfo(prefix_keys=keys[:start]),
            )
    hits = [backend.batch_exists(keys) for keys in chains]
    assert sum(hits) == slots  # the tier is full, and every page in it is a hit
    assert sum(h > 0 for h in hits) >= len(chains) // 2

    # the same writes straight to the tier, which evicts by recency: no chain has a head
    settings = parse_tier_settings(
        [disk_tier(tmp_path / "lru.bin", capacity_bytes=capacity)], owner="test"
    )
    ns = engine_namespace(model="m", layout="lru", dtype="f32", rank=0)
    with TierBridge.from_settings(settings, namespace=ns, block_nbytes=nbytes) as bridge:
        payload = memoryview(bytearray(nbytes))
        for start in range(0, 12, 4):
            for keys in chains:
                batch = [bridge.key(k.encode()) for k in keys[start : start + 4]]
                bridge.put(batch, [payload] * len(batch))
        lru_hits = [bridge.exists([bridge.key(k.encode()) for k in keys]) for keys in chains]
    assert sum(lru_hits) == 0


def test_pool_aware_v2_calls_are_refused(backend_factory: Factory, tmp_path: Path) -> None:
    pool = make_pool("mha", "page_first")
    backend = backend_factory(pool, extra_config([disk_tier(tmp_path / "kv.bin")]))
    backend.register_mem_host_pool_v2(pool, "kv")  # the KV pool itself is fine
    with pytest.raises(ConfigError, match="'mamba'.*not supported"):
        backend.register_mem_host_pool_v2(make_pool("mha", "page_first"), "mamba")
    with pytest.raises(ConfigError, match="not supported"):
        backend.batch_exists_v2(["a"], [])
    with pytest.raises(ConfigError, match="interface_v1"):
        backend.batch_get(["a"])


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"interface_v1": 0}, "interface_v1=0"),
        ({"colour": "blue"}, r"unknown key\(s\) \['colour'\]"),
        ({"max_pages": 0}, "max_pages=0"),
        ({"tiers": [{"kind": "disk", "path": "/x", "capacity_bytes": -1}]}, "capacity_bytes"),
        ({"tiers": [{"kind": "redis", "url": "redis://127.0.0.1:1"}]}, "max_pages is needed"),
    ],
)
def test_bad_settings_are_refused_through_sglangs_factory(
    tmp_path: Path, change: dict[str, Any], match: str
) -> None:
    extra = extra_config([disk_tier(tmp_path / "kv.bin")])
    extra.update(change)
    with pytest.raises(ConfigError, match=match):
        StorageBackendFactory.create_backend("dynamic", storage_config(extra), None)


def test_a_disk_tier_is_refused_for_several_ranks(tmp_path: Path) -> None:
    extra = extra_config([disk_tier(tmp_path / "kv.bin")])
    with pytest.raises(ConfigError, match="2 ranks would each open it"):
        StorageBackendFactory.create_backend("dynamic", storage_config(extra, tp_size=2), None)


def test_prefetch_and_backup_threads_at_once(backend_factory: Factory, tmp_path: Path) -> None:
    pool = make_pool("mla", "layer_first")
    backend = backend_factory(pool, extra_config([disk_tier(tmp_path / "kv.bin")]))
    written = fill(pool, list(range(8)), seed=6)
    keys = chain("a", 8)
    assert all(backend.batch_set_v1(keys, indices(list(range(8)))))
    errors: list[BaseException] = []

    def backup(n: int) -> None:
        try:
            for i in range(10):
                backend.batch_set_v1(chain(f"t{n}-{i}", 2), indices([0, 1]))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=backup, args=(n,)) for n in range(2)]
    for t in threads:
        t.start()
    for _ in range(10):
        assert backend.batch_get_v1(keys, indices(list(range(40, 48)))) == [True] * 8
    for t in threads:
        t.join()
    assert errors == []
    for i, p in enumerate(range(40, 48)):
        assert torch.equal(page(pool, p), written[i])


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer()
    server.start()
    try:
        yield server
    finally:
        server.close()


def test_redis_tier_round_trip_and_a_paused_server(
    backend_factory: Factory, redis_server: RedisServer
) -> None:
    """Pages round-trip through a Redis tier; a paused server turns into misses and
    raised reads (never None), and the tier comes back once the server answers."""
    pool = make_pool("mla", "page_first")
    redis = {"kind": "redis", "url": redis_server.url, "op_timeout_s": 0.5}
    redis.update({"retry_initial_s": 0.05, "retry_max_s": 0.2})
    backend = backend_factory(pool, extra_config([redis], max_pages=64))
    keys = chain("a", 6)
    written = fill(pool, list(range(6)), seed=7)
    assert backend.batch_set_v1(keys, indices(list(range(6)))) == [True] * 6
    assert backend.batch_get_v1(keys, indices(list(range(10, 16)))) == [True] * 6
    for i, p in enumerate(range(10, 16)):
        assert torch.equal(page(pool, p), written[i])

    redis_server.pause()
    try:
        assert backend.batch_exists(keys) == 0
        with pytest.raises(TierError, match="no tier can read"):
            backend.batch_get_v1(keys, indices(list(range(20, 26))))
    finally:
        redis_server.resume()
    for _ in range(200):  # the health loop pings the tier back with backoff
        if backend.batch_exists(keys) == 6:
            break
        threading.Event().wait(0.05)
    assert backend.batch_get_v1(keys, indices(list(range(30, 36)))) == [True] * 6
