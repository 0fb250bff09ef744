"""`build_tier()`: the tier an entry of ``OffloadConfig.tiers`` describes."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvoffload._extras import needs_extra
from kvoffload.config import DiskTierSettings, RedisClusterTierSettings, RedisTierSettings
from kvoffload.errors import ConfigError
from kvoffload.tiers.base import SecondaryTier
from kvoffload.tiers.disk import DiskTier

if TYPE_CHECKING:
    from kvoffload.config import TierSettings

__all__ = ["build_tier"]


def build_tier(
    settings: TierSettings, index: int, *, namespace: bytes, block_nbytes: int
) -> SecondaryTier:
    """Make the tier that ``settings`` describes (not opened yet).

    Args:
        settings: one entry of ``OffloadConfig.tiers``.
        index: its position (names it when ``settings.name`` is unset).
        namespace: the 32-byte namespace digest.
        block_nbytes: bytes of one CPU block.

    Raises:
        ConfigError: the settings do not fit (a disk capacity below one slot), or the
            Redis extra is not installed.
    """
    name = settings.name or f"{settings.kind}{index}"
    if isinstance(settings, DiskTierSettings):
        return DiskTier(
            settings.path,
            int(settings.capacity_bytes),
            block_nbytes=block_nbytes,
            namespace=namespace,
            persist=settings.persist,
            direct_io=settings.direct_io,
            preallocate=settings.preallocate,
            name=name,
            io_threads=settings.max_in_flight,
        )
    if isinstance(settings, RedisTierSettings):
        try:
            from kvoffload.tiers.redis import RedisTier  # noqa: PLC0415 - optional extra
        except ImportError as exc:
            raise ConfigError(
                f"tiers[{index}] ({name!r}): {needs_extra('the redis tier', 'redis')} ({exc})"
            ) from exc
        return RedisTier(
            settings.url.get_secret_value(),
            block_nbytes=block_nbytes,
            namespace=namespace,
            key_prefix=settings.key_prefix,
            ttl_s=settings.ttl_s,
            max_connections=settings.max_in_flight,
            name=name,
        )
    if isinstance(settings, RedisClusterTierSettings):
        try:
            from kvoffload.tiers.redis_cluster import (  # noqa: PLC0415 - optional extra
                RedisClusterTier,
            )
        except ImportError as exc:
            raise ConfigError(
                f"tiers[{index}] ({name!r}): "
                f"{needs_extra('the redis-cluster tier', 'redis')} ({exc})"
            ) from exc
        return RedisClusterTier(
            [node.get_secret_value() for node in settings.startup_nodes],
            block_nbytes=block_nbytes,
            namespace=namespace,
            key_prefix=settings.key_prefix,
            ttl_s=settings.ttl_s,
            read_from_replicas=settings.read_from_replicas,
            node_timeout_s=settings.node_timeout_ms / 1000,
            lookup_budget_s=settings.lookup_budget_ms / 1000,
            write_budget_s=settings.write_budget_ms / 1000,
            breaker_failures=settings.breaker_failures,
            breaker_backoff_s=settings.breaker_backoff_ms / 1000,
            breaker_backoff_max_s=settings.breaker_backoff_max_ms / 1000,
            refresh_interval_s=settings.refresh_interval_ms / 1000,
            max_reads_per_node=settings.max_reads_per_node,
            max_writes_per_node=settings.max_writes_per_node,
            threads=settings.max_in_flight,
            name=name,
        )
    raise ConfigError(f"tiers[{index}]: unknown tier settings {settings!r}")  # pragma: no cover
