"""`KvOffloadHiCacheStorage`: an SGLang ``HiCacheStorage`` over kvoffload's tiers.

SGLang's cache controller calls a storage backend from its own threads, blocking: the
prefetch thread asks ``batch_exists`` (how many pages, from the first, are stored) and
then ``batch_get_v1`` into host-pool pages; the backup thread calls ``batch_set_v1`` with
host-pool pages to write. Here every call goes through one `TierBridge` (the tiers on a
private event loop thread), so SGLang gets what kvoffload's tiers give: every page read is
verified (header, namespace, hash, length, checksum) and one that fails is a miss and is
deleted; every tier call is bounded by its ``op_timeout_s``; a failing tier is skipped
(lookups become misses at once) and pinged back with backoff.

HiCache counts a hit as the leading run of a chain of pages, so pages are kept by a
`ChainBudget`: at most ``max_pages``, evicting the deepest page first (never one shallower
than the page it makes room for), before a tier has to evict by recency (which takes heads
first).

Results follow SGLang's contract exactly: ``batch_exists`` returns an ``int``,
``batch_get_v1``/``batch_set_v1`` a list of one ``bool`` per key whose ``True`` entries
are a leading run (a failed or corrupted page ends the run). Nothing returns ``None``:
misuse and a call while every tier is down raise (SGLang's controller logs the exception
and counts the call as a miss or a failed backup).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, final

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)

from kvoffload._logging import get_logger
from kvoffload.errors import ClosedError, ConfigError, InvalidInputError, TierError
from kvoffload.hashing import BlockHash
from kvoffload.integrations.sglang.settings import BackendSettings, backend_settings
from kvoffload.tier_config import DiskTierSettings
from kvoffload.tiers import TierBridge, engine_namespace
from kvoffload.tiers.chain_budget import ChainBudget

if TYPE_CHECKING:
    from sglang.srt.mem_cache.pool_host import HostKVCache

__all__ = ["KvOffloadHiCacheStorage"]

_log = get_logger("integrations.sglang")

_LAYOUTS = frozenset({"layer_first", "page_first", "page_first_direct"})
"""Host-pool layouts whose pages the backend moves (MHA and MLA pools have them all)."""


def _page_bytes(page: torch.Tensor) -> memoryview:
    """The bytes of a contiguous page tensor (no copy)."""
    return memoryview(page.view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]


@final
class KvOffloadHiCacheStorage(HiCacheStorage):
    """SGLang HiCache L3 storage over kvoffload's disk, Redis and Redis Cluster tiers.

    SGLang's backend factory builds it as ``KvOffloadHiCacheStorage(storage_config,
    kwargs)`` and then calls `register_mem_pool_host()`, which opens the tiers (a page's
    size comes from the host pool). See ``docs/sglang.md`` for the configuration.

    Args:
        storage_config: SGLang's ``HiCacheStorageConfig``; its ``extra_config`` holds the
            backend's settings (`backend_settings()`).
        kwargs: what the factory passes besides (unused; SGLang passes none).

    Raises:
        ConfigError: a bad setting (named), or no model name to key pages by.
    """

    def __init__(
        self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None
    ) -> None:
        cfg = storage_config
        processes = cfg.tp_size * cfg.pp_size * cfg.attn_cp_size
        if cfg.is_mla_model:  # MLA pages are the same on every tensor-parallel rank
            processes //= cfg.tp_size
        self.settings: BackendSettings = backend_settings(cfg.extra_config, processes=processes)
        if not cfg.model_name:
            raise ConfigError(
                "HiCacheStorageConfig.model_name is empty: pages are keyed by the model, "
                "and without it two models' pages could meet"
            )
        self._config = cfg
        self._lock = threading.Lock()  # guards the budget: prefetch and backup threads
        self._bridge: TierBridge | None = None
        self._budget: ChainBudget[str] | None = None
        self._pool: HostKVCache | None = None
        self._nbytes = 0
        self._page_size = 0
        self._warned_no_prefix = False
        self._closed = False

    def __repr__(self) -> str:
        return f"KvOffloadHiCacheStorage(bridge={self._bridge!r}, budget={self._budget_size()})"

    def _budget_size(self) -> str:
        budget = self._budget
        return "-" if budget is None else f"{len(budget)}/{budget.capacity}"

    # -- registration -------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: HostKVCache) -> None:
        """Attach SGLang's host KV pool and open the tiers (pages are its pages).

        Raises:
            ConfigError: the pool's layout is not one the backend moves, a second pool is
                registered, or the disk tiers leave no free page.
            TierError: the tiers cannot be built.
        """
        if self._closed:
            raise ClosedError(f"{self!r} is closed")
        if self._pool is not None:
            if mem_pool_host is self._pool:
                return
            raise ConfigError("a host pool is already registered with this backend")
        layout = str(mem_pool_host.layout)
        if layout not in _LAYOUTS:
            raise ConfigError(
                f"host pool layout {layout!r}: the kvoffload HiCache backend moves pages of "
                f"the layouts {sorted(_LAYOUTS)} (--hicache-mem-layout)"
            )
        super().register_mem_pool_host(mem_pool_host)
        page = mem_pool_host.get_dummy_flat_data_page()
        self._nbytes = page.numel() * page.element_size()
        self._page_size = int(mem_pool_host.page_size)
        cfg = self._config
        shard = (
            f"sglang:{type(mem_pool_host).__name__}:{layout}:page={self._page_size}"
            f":bytes={self._nbytes}:tp={1 if cfg.is_mla_model else cfg.tp_size}"
            f":pp={cfg.pp_rank}/{cfg.pp_size}:cp={cfg.attn_cp_rank}/{cfg.attn_cp_size}"
        )
        namespace = engine_namespace(
            model=str(cfg.model_name),
            layout=shard,
            dtype=str(mem_pool_host.dtype),
            rank=0 if cfg.is_mla_model else cfg.tp_rank,
        )
        bridge = TierBridge.from_settings(
            self.settings.tiers,
            namespace=namespace,
            block_nbytes=self._nbytes,
            name="kvoffload-hicache",
        )
        try:
            capacity = self._capacity(bridge)
        except BaseException:
            bridge.close(drain=False)
            raise
        self._bridge = bridge
        self._budget = ChainBudget(capacity)
        self._pool = mem_pool_host
        _log.info(
            "sglang_backend_opened",
            tiers=[s.kind for s in self.settings.tiers],
            page_bytes=self._nbytes,
            layout=layout,
            max_pages=capacity,
        )

    def _capacity(self, bridge: TierBridge) -> int:
        """``max_pages``, or the free slots of the smallest disk tier at open."""
        if self.settings.max_pages is not None:
            return self.settings.max_pages
        free: list[int] = []
        stats = bridge.statistics()
        for settings, tier in zip(self.settings.tiers, stats, strict=True):
            if isinstance(settings, DiskTierSettings):
                slots = int(tier.details.get("slots", 0))
                used = int(tier.details.get("slots_used", 0))
                free.append(slots - used)
        capacity = min(free)
        if capacity < 1:
            raise ConfigError(
                f"tiers: the disk tiers have {capacity} free page slots of {self._nbytes} "
                "bytes; give capacity_bytes room for at least one page, or set max_pages"
            )
        return capacity

    def register_mem_host_pool_v2(self, host_pool: HostKVCache, host_pool_name: object) -> None:
        """Refuse every pool but the KV pool registered first.

        Raises:
            ConfigError: a Mamba, sliding-window or other sidecar pool: the backend stores
                KV pages only (SGLang's pool-aware v2 calls are not supported).
        """
        if str(host_pool_name) == PoolName.KV.value and host_pool is self._pool:
            return
        raise ConfigError(_v2_refusal(host_pool_name))

    def batch_exists_v2(
        self,
        keys: list[str],
        pool_transfers: list[PoolTransfer] | None = None,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> PoolTransferResult:
        """Refused: see `register_mem_host_pool_v2()`."""
        raise ConfigError(_v2_refusal(_names(pool_transfers)))

    def batch_get_v2(
        self,
        transfers: list[PoolTransfer],
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> dict[str, list[bool]]:
        """Refused: see `register_mem_host_pool_v2()`."""
        raise ConfigError(_v2_refusal(_names(transfers)))

    def batch_set_v2(
        self,
        transfers: list[PoolTransfer],
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> dict[str, list[bool]]:
        """Refused: see `register_mem_host_pool_v2()`."""
        raise ConfigError(_v2_refusal(_names(transfers)))

    # -- the calls of SGLang's prefetch and backup threads -------------------------------------

    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        """How many of ``keys``, from the first, the tiers hold (a leading run).

        A tier that is down counts as holding nothing (a miss at once, no error).

        Raises:
            ClosedError: after `close()`.
            ConfigError: no host pool is registered yet.
        """
        bridge, _ = self._ready()
        if not keys:
            return 0
        found = bridge.exists(self._hashes(bridge, keys))
        budget = self._budget
        if budget is not None:
            with self._lock:
                budget.touch(keys[:found])
        return found

    def exists(self, key: str) -> bool:
        """Whether ``key``'s page is stored."""
        return self.batch_exists([key]) == 1

    def batch_get_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Read pages into the host pool at ``host_indices`` (``page_size`` per key).

        Returns:
            Per key, whether its page is in the host pool now: a leading run of ``True``
            (a missing or corrupted page ends it; the host pages after it are untouched).

        Raises:
            InvalidInputError: ``host_indices`` does not hold ``page_size`` per key.
            TierError: nothing arrived and every tier is down.
            ClosedError: after `close()`.
        """
        bridge, pool = self._ready()
        offsets = self._offsets(keys, host_indices)
        if not keys:
            return []
        staging = torch.empty((len(keys), self._nbytes), dtype=torch.uint8)
        views = [_page_bytes(staging[i]) for i in range(len(keys))]
        got = bridge.get(self._hashes(bridge, keys), views)
        run = got.index(False) if False in got else len(got)
        for i in range(run):
            pool.set_from_flat_data_page(offsets[i], staging[i].view(pool.dtype))
        budget = self._budget
        if budget is not None:
            with self._lock:
                budget.touch(keys[:run])
                budget.forget(key for key, ok in zip(keys, got, strict=True) if not ok)
        if run == 0:
            self._raise_if_all_down(bridge, "read")
        return [True] * run + [False] * (len(keys) - run)

    def batch_set_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Write the host pool's pages at ``host_indices`` under ``keys``.

        ``extra_info.prefix_keys`` (SGLang passes it with
        ``"hicache_storage_pass_prefix_keys": true``) gives the pages' depth in their
        chain; without it they count from depth 0 at the first key.

        Returns:
            Per key, whether its page is stored: a leading run of ``True`` (pages the
            budget or a tier could not take end it).

        Raises:
            InvalidInputError: ``host_indices`` does not hold ``page_size`` per key.
            TierError: nothing landed and every tier is down.
            ClosedError: after `close()`.
        """
        bridge, pool = self._ready()
        offsets = self._offsets(keys, host_indices)
        if not keys:
            return []
        prefix = extra_info.prefix_keys if extra_info is not None else None
        if prefix is None and not self._warned_no_prefix:
            self._warned_no_prefix = True
            _log.warning(
                "sglang_prefix_keys_missing",
                hint='set "hicache_storage_pass_prefix_keys": true in the extra config; '
                "without it pages are ranked by their place in each write",
            )
        budget = self._budget
        if budget is None:  # pragma: no cover - set with the bridge
            raise ConfigError("the backend has no page budget")
        with self._lock:
            admission = budget.admit(keys, len(prefix) if prefix else 0)
        if admission.victims:
            bridge.delete(self._hashes(bridge, admission.victims))
        admitted = admission.admitted
        hashes = self._hashes(bridge, keys[:admitted])
        pages = [pool.get_data_page(offsets[i], flat=True).contiguous() for i in range(admitted)]
        stored = bridge.put(hashes, [_page_bytes(page) for page in pages]) if admitted else 0
        landed = admitted
        if stored < admitted:
            landed = bridge.exists(hashes)
            with self._lock:
                budget.forget(keys[landed:admitted])
        if landed == 0 and admitted:
            self._raise_if_all_down(bridge, "write")
        return [True] * landed + [False] * (len(keys) - landed)

    # -- the older copying interface (not supported) --------------------------------------------

    def get(
        self,
        key: str,
        target_location: Any | None = None,
        target_sizes: Any | None = None,
    ) -> torch.Tensor | None:
        """Refused: the backend is used with ``interface_v1: 1`` only."""
        raise ConfigError(_V1_ONLY)

    def batch_get(
        self,
        keys: list[str],
        target_locations: Any | None = None,
        target_sizes: Any | None = None,
    ) -> list[torch.Tensor | None] | int:
        """Refused: the backend is used with ``interface_v1: 1`` only."""
        raise ConfigError(_V1_ONLY)

    def set(
        self,
        key: str,
        value: Any | None = None,
        target_location: Any | None = None,
        target_sizes: Any | None = None,
    ) -> bool:
        """Refused: the backend is used with ``interface_v1: 1`` only."""
        raise ConfigError(_V1_ONLY)

    def batch_set(
        self,
        keys: list[str],
        values: Any | None = None,
        target_locations: Any | None = None,
        target_sizes: Any | None = None,
    ) -> bool:
        """Refused: the backend is used with ``interface_v1: 1`` only."""
        raise ConfigError(_V1_ONLY)

    # -- lifecycle -----------------------------------------------------------------------------

    def clear(self) -> None:
        """Delete every page this backend wrote from the tiers (SGLang's cache flush)."""
        bridge, _ = self._ready()
        budget = self._budget
        if budget is None:  # pragma: no cover - set with the bridge
            return
        with self._lock:
            keys = list(budget.keys())
            budget.clear()
        if keys:
            bridge.delete(self._hashes(bridge, keys))

    def close(self) -> None:
        """Finish the calls in flight, close the tiers and end the bridge's thread.
        Idempotent; calls after it raise `ClosedError`."""
        self._closed = True
        bridge, self._bridge = self._bridge, None
        if bridge is not None:
            bridge.close(drain=True)

    # -- helpers -------------------------------------------------------------------------------

    def _ready(self) -> tuple[TierBridge, HostKVCache]:
        bridge, pool = self._bridge, self._pool
        if self._closed:
            raise ClosedError(f"{self!r} is closed")
        if bridge is None or pool is None:
            raise ConfigError("no host pool registered: SGLang calls register_mem_pool_host first")
        return bridge, pool

    def _offsets(self, keys: Sequence[str], host_indices: torch.Tensor) -> list[int]:
        expected = len(keys) * self._page_size
        if host_indices.numel() != expected:
            raise InvalidInputError(
                f"host_indices: {host_indices.numel()} indices for {len(keys)} keys, "
                f"expected {expected} (page_size {self._page_size} per key)"
            )
        return [int(i) for i in host_indices[:: self._page_size].tolist()]

    @staticmethod
    def _hashes(bridge: TierBridge, keys: Sequence[str]) -> list[BlockHash]:
        return [bridge.key(key.encode()) for key in keys]

    def _raise_if_all_down(self, bridge: TierBridge, what: str) -> None:
        stats = bridge.statistics()
        if stats and not any(t.healthy for t in stats):
            errors = "; ".join(f"{t.name}: {t.last_error or 'unhealthy'}" for t in stats)
            raise TierError(f"kvoffload HiCache backend: no tier can {what} pages ({errors})")


_V1_ONLY = (
    "the kvoffload HiCache backend implements the zero-copy calls only: "
    'set "interface_v1": 1 in --hicache-storage-backend-extra-config'
)


def _names(transfers: Sequence[PoolTransfer] | None) -> str:
    return ",".join(str(t.name) for t in transfers or ()) or "(none)"


def _v2_refusal(pool: object) -> str:
    return (
        f"host pool {str(pool)!r}: the kvoffload HiCache backend stores the KV pool's pages "
        "only; SGLang's pool-aware (v2) calls for Mamba, sliding-window and other sidecar "
        "pools are not supported by this version"
    )
