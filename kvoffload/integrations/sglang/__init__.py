"""kvoffload's tiers as SGLang HiCache's L3: `KvOffloadHiCacheStorage`.

Load it with ``--hicache-storage-backend dynamic`` and an extra config naming
``kvoffload.integrations.sglang`` and ``KvOffloadHiCacheStorage`` with ``interface_v1: 1``
(see ``docs/sglang.md``).

Raises:
    ImportError: SGLang is not installed (the message names the extra).
"""

from __future__ import annotations

from kvoffload._extras import needs_extra

try:
    import sglang.srt.mem_cache.hicache_storage  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised without the extra
    raise ImportError(
        needs_extra("kvoffload.integrations.sglang", "sglang")
        + " (SGLang >= 0.5.23; on a CPU-only machine: bash scripts/sglang_env.sh)"
    ) from exc

from kvoffload.integrations.sglang.settings import BackendSettings, backend_settings
from kvoffload.integrations.sglang.storage import KvOffloadHiCacheStorage

__all__ = ["BackendSettings", "KvOffloadHiCacheStorage", "backend_settings"]
