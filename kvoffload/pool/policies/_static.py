"""The registry of the static policies: each ranks free blocks by one fixed rule.

Below `kvoffload.pool.policies` and the adaptive policy, which both read it: the adaptive
policy's experts are drawn from these names.
"""

from __future__ import annotations

from collections.abc import Callable

from kvoffload.pool.policies.arc import ArcPolicy
from kvoffload.pool.policies.base import EvictionPolicy
from kvoffload.pool.policies.gdfreq import PrefixFrequencyPolicy
from kvoffload.pool.policies.lru import LruPolicy
from kvoffload.pool.policies.s3fifo import S3FifoPolicy

__all__ = ["STATIC_POLICIES", "STATIC_POLICY_NAMES"]

STATIC_POLICIES: dict[str, Callable[[], EvictionPolicy]] = {
    "lru": LruPolicy,
    "arc": ArcPolicy,
    "s3fifo": S3FifoPolicy,
    "prefix-freq": PrefixFrequencyPolicy,
}
"""Name to factory of every static policy, the default (``"lru"``) first."""

STATIC_POLICY_NAMES: tuple[str, ...] = tuple(STATIC_POLICIES)
"""The registered policies that rank blocks by one fixed rule (all but ``"adaptive"``)."""
