"""Secondary tiers below the CPU pool: a local disk file and a shared Redis.

Blocks cascade down from the CPU pool once their store completed, and are promoted back
into CPU blocks when a lookup finds them only in a tier. See ``docs/tiers.md``.
"""

from __future__ import annotations

from kvoffload.tier_config import (
    DiskTierSettings,
    RedisClusterTierSettings,
    RedisTierSettings,
    TierSettings,
)
from kvoffload.tiers.base import BlockRead, BlockWrite, SecondaryTier
from kvoffload.tiers.bridge import TierBridge, engine_namespace
from kvoffload.tiers.build import build_tier
from kvoffload.tiers.disk import DiskTier
from kvoffload.tiers.format import HEADER_SIZE, BlockHeader, encode_header, verify_block
from kvoffload.tiers.front import TierFront
from kvoffload.tiers.manager import TierManager
from kvoffload.tiers.stats import TierManagerStatistics, TierStatistics

__all__ = [
    "HEADER_SIZE",
    "BlockHeader",
    "BlockRead",
    "BlockWrite",
    "DiskTier",
    "DiskTierSettings",
    "RedisClusterTierSettings",
    "RedisTierSettings",
    "SecondaryTier",
    "TierManager",
    "TierBridge",
    "TierFront",
    "TierManagerStatistics",
    "TierSettings",
    "TierStatistics",
    "build_tier",
    "encode_header",
    "engine_namespace",
    "verify_block",
]
