"""The settings of the secondary tiers, re-exported from `kvoffload.tier_config`.

They live below the configuration (`kvoffload.config` imports them), so that importing
the configuration never runs the tiers package; this module keeps the old import path.
"""

from __future__ import annotations

from kvoffload.tier_config import (
    AnyTierSettings,
    DiskTierSettings,
    RedisClusterTierSettings,
    RedisTierSettings,
    SecretUrl,
    StartupNodeUrl,
    TierSettings,
    TierSettingsList,
    redact_url,
)

__all__ = [
    "AnyTierSettings",
    "DiskTierSettings",
    "RedisClusterTierSettings",
    "RedisTierSettings",
    "SecretUrl",
    "StartupNodeUrl",
    "TierSettings",
    "TierSettingsList",
    "redact_url",
]
