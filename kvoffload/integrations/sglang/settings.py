"""The backend's settings: SGLang's ``--hicache-storage-backend-extra-config``, checked.

SGLang hands a dynamic backend the whole extra config (less the prefetch keys it takes
for itself). The keys SGLang reads to load the backend are accepted; ``tiers`` and
``max_pages`` are the backend's own; any other key is refused, so that no setting is
silently ignored.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import final

from kvoffload.errors import ConfigError
from kvoffload.tier_config import AnyTierSettings, DiskTierSettings, parse_tier_settings

__all__ = ["SGLANG_KEYS", "BackendSettings", "backend_settings"]

SGLANG_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1"})
"""Keys of the extra config that SGLang itself reads to load a dynamic backend."""

_OWN_KEYS = frozenset({"tiers", "max_pages"})
_WHERE = "--hicache-storage-backend-extra-config"


@final
@dataclass(frozen=True, slots=True)
class BackendSettings:
    """What the backend was configured with.

    Attributes:
        tiers: kvoffload tier settings, in lookup order (validated as
            ``OffloadConfig.tiers``).
        max_pages: the most pages the backend keeps in its tiers (`ChainBudget`), or
            ``None``: the free slots of its disk tiers when it opens.
    """

    tiers: tuple[AnyTierSettings, ...]
    max_pages: int | None


def backend_settings(extra: Mapping[str, object] | None, *, processes: int) -> BackendSettings:
    """Check SGLang's extra config for the kvoffload backend.

    Args:
        extra: ``HiCacheStorageConfig.extra_config``.
        processes: how many ranks of one model write pages (tensor x pipeline x
            context parallel): a disk tier is one process's file.

    Raises:
        ConfigError: naming the key, its value and why: an unknown key, ``interface_v1``
            not 1 (the older path copies every page twice and is not supported), bad
            ``tiers`` (as ``OffloadConfig.tiers``), ``max_pages`` not a positive integer
            or missing where no disk tier bounds the pages, or a disk tier shared by
            several processes.
    """
    extra = dict(extra or {})
    unknown = sorted(set(extra) - SGLANG_KEYS - _OWN_KEYS)
    if unknown:
        raise ConfigError(
            f"{_WHERE}: unknown key(s) {unknown} for the kvoffload HiCache backend "
            f"(its keys: {sorted(_OWN_KEYS)}; SGLang's: {sorted(SGLANG_KEYS)})"
        )
    interface_v1 = extra.get("interface_v1")
    if interface_v1 not in (1, True):
        raise ConfigError(
            f"{_WHERE}: interface_v1={interface_v1!r}: the kvoffload HiCache backend moves "
            'pages straight between the host pool and its tiers; set "interface_v1": 1'
        )
    if "tiers" not in extra:
        raise ConfigError(f'{_WHERE}: "tiers" is missing: a list of kvoffload tier settings')
    tiers = parse_tier_settings(extra["tiers"], owner=f"{_WHERE} tiers")
    max_pages = extra.get("max_pages")
    if max_pages is not None and (
        isinstance(max_pages, bool) or not isinstance(max_pages, int) or max_pages < 1
    ):
        raise ConfigError(f"{_WHERE}: max_pages={max_pages!r}: a positive integer of pages")
    disks = [s for s in tiers if isinstance(s, DiskTierSettings)]
    if disks and processes > 1:
        raise ConfigError(
            f"{_WHERE}: tiers: a disk tier ({str(disks[0].path)!r}) is the file of one "
            f"process, and {processes} ranks would each open it; use a redis or "
            "redis-cluster tier for a model split across processes"
        )
    if not disks and max_pages is None:
        raise ConfigError(
            f"{_WHERE}: max_pages is needed with Redis tiers only: Redis's own eviction "
            "(maxmemory-policy) takes the oldest pages, which are the heads of chains that "
            "HiCache needs first; the backend evicts tail-first within max_pages instead"
        )
    return BackendSettings(tiers=tiers, max_pages=max_pages)
