"""Eviction policies for `CpuBlockPool`, and admission filters for stores.

`make_policy()` turns a name (`OffloadConfig.eviction_policy`, ``kvoffload replay
--policy``) into a fresh policy; `POLICY_NAMES` lists the registered names and
`STATIC_POLICY_NAMES` those but the adaptive one (which follows the others).
"""

from __future__ import annotations

from collections.abc import Callable

from kvoffload.errors import ConfigError
from kvoffload.pool.policies._static import STATIC_POLICIES, STATIC_POLICY_NAMES
from kvoffload.pool.policies.adaptive import AdaptivePolicy, AdaptiveStatistics
from kvoffload.pool.policies.arc import ArcPolicy
from kvoffload.pool.policies.base import EvictionPolicy
from kvoffload.pool.policies.gdfreq import PrefixFrequencyPolicy
from kvoffload.pool.policies.lru import LruPolicy
from kvoffload.pool.policies.s3fifo import S3FifoPolicy

__all__ = [
    "POLICY_NAMES",
    "STATIC_POLICY_NAMES",
    "AdaptivePolicy",
    "AdaptiveStatistics",
    "ArcPolicy",
    "EvictionPolicy",
    "LruPolicy",
    "PrefixFrequencyPolicy",
    "S3FifoPolicy",
    "make_policy",
]

_REGISTRY: dict[str, Callable[[], EvictionPolicy]] = {
    **STATIC_POLICIES,
    "adaptive": AdaptivePolicy,
}

POLICY_NAMES: tuple[str, ...] = tuple(_REGISTRY)
"""Registered policy names, the default (``"lru"``) first."""


def make_policy(policy: EvictionPolicy | str | None) -> EvictionPolicy:
    """A fresh policy for a name, the given policy itself, or LRU for ``None``.

    Raises:
        ConfigError: an unknown name; the message lists the known ones.
    """
    if policy is None:
        return LruPolicy()
    if isinstance(policy, str):
        factory = _REGISTRY.get(policy.strip().lower())
        if factory is None:
            raise ConfigError(
                f"unknown eviction policy {policy!r}; known policies: {', '.join(POLICY_NAMES)}"
            )
        return factory()
    return policy
