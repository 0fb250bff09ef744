"""The settings of the secondary tiers, kept importable here.

They are defined in `kvoffload.config` beside `OffloadConfig`, whose ``tiers`` field holds
them, so that importing the configuration never imports the tiers package.
"""

from __future__ import annotations

from kvoffload.config import (
    DiskTierSettings,
    RedisTierSettings,
    SecretUrl,
    TierSettings,
    TierSettingsList,
    redact_url,
)

__all__ = [
    "DiskTierSettings",
    "RedisTierSettings",
    "SecretUrl",
    "TierSettings",
    "TierSettingsList",
    "redact_url",
]
