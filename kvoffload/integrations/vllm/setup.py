"""Start-up checks: from vLLM's configuration to kvoffload's `OffloadConfig` and `KVLayout`.

Both sides of the connector (the scheduler process and every worker) run the same checks
on the same inputs, so they agree on the CPU pool's size and on a block's bytes without
talking to each other.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from kvoffload.config import KVLayout, OffloadConfig
from kvoffload.errors import ConfigError

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = ["layout_from_kv_cache_config", "offload_config"]


def offload_config(extra: Mapping[str, Any] | None, *, block_size: int) -> OffloadConfig:
    """Build the `OffloadConfig` from ``kv_connector_extra_config``.

    Every `OffloadConfig` field is accepted under its own name, with the same validation;
    ``block_size`` defaults to vLLM's and must equal it when given.

    Args:
        extra: the ``kv_connector_extra_config`` mapping (``None``: empty).
        block_size: vLLM's KV block size in tokens.

    Returns:
        The settings.

    Raises:
        ConfigError: a key is unknown (named, with the closest valid key and the list of
            valid keys), a value is invalid (the field and value named), or ``block_size``
            differs from vLLM's.
    """
    values = dict(extra or {})
    valid = sorted(OffloadConfig.model_fields)
    unknown = sorted(str(key) for key in values if key not in OffloadConfig.model_fields)
    if unknown:
        hints = []
        for key in unknown:
            close = difflib.get_close_matches(key, valid, n=1)
            hints.append(f"{key!r} (did you mean {close[0]!r}?)" if close else repr(key))
        raise ConfigError(
            f"kv_connector_extra_config: unknown key {', '.join(hints)}; "
            f"valid keys: {', '.join(valid)}"
        )
    given = values.setdefault("block_size", block_size)
    if given != block_size:
        raise ConfigError(
            f"kv_connector_extra_config block_size={given!r} differs from vLLM's "
            f"block_size={block_size}; leave it out to use vLLM's"
        )
    try:
        return OffloadConfig(**values)
    except ConfigError as exc:
        raise ConfigError(f"kv_connector_extra_config: {exc}") from exc


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def layout_from_kv_cache_config(kv_cache_config: KVCacheConfig) -> tuple[KVLayout, list[str]]:
    """The layout of one CPU block, and the attention layers it covers in order.

    Only models whose KV cache is one group of full-attention layers are supported; a
    model with more groups (sliding window, hybrid Mamba, MLA next to attention) is
    refused with the group it cannot offload.

    Args:
        kv_cache_config: the KV cache configuration vLLM passes to the connector.

    Returns:
        ``(layout, layer_names)``: a ``blocks_first`` layout whose per-layer block holds
        exactly one vLLM page, and the layer names in the order CPU blocks hold them.

    Raises:
        ConfigError: the cache has more or fewer than one group, or its group is not plain
            full attention, or its page size does not match K and V of the layout.
    """
    from vllm.v1.kv_cache_interface import FullAttentionSpec  # noqa: PLC0415

    groups = kv_cache_config.kv_cache_groups
    described = [
        f"group {i}: {type(g.kv_cache_spec).__name__} ({len(g.layer_names)} layers, "
        f"e.g. {g.layer_names[0] if g.layer_names else '-'})"
        for i, g in enumerate(groups)
    ]
    if len(groups) != 1:
        raise ConfigError(
            "KVOffloadConnector supports models with exactly one KV cache group of full "
            f"attention layers; this model has {len(groups)}: " + "; ".join(described)
        )
    spec = groups[0].kv_cache_spec
    if type(spec) is not FullAttentionSpec or spec.sliding_window is not None:
        raise ConfigError(
            "KVOffloadConnector supports full attention KV caches only; unsupported " + described[0]
        )
    head_size_v = spec.head_size_v if spec.head_size_v is not None else spec.head_size
    if head_size_v != spec.head_size:
        raise ConfigError(
            f"KVOffloadConnector needs K and V of one head size; {described[0]} has "
            f"head_size={spec.head_size}, head_size_v={head_size_v}"
        )
    layout = KVLayout(
        num_layers=len(groups[0].layer_names),
        num_kv_heads=spec.num_kv_heads,
        head_size=spec.head_size,
        dtype=_dtype_name(spec.dtype),
        block_size=spec.block_size,
        kind="blocks_first",
    )
    if spec.page_size_bytes != layout.bytes_per_layer_block:
        raise ConfigError(
            f"{described[0]}: a page of {spec.page_size_bytes} bytes per layer is not K and "
            f"V of {spec.block_size} tokens x {spec.num_kv_heads} heads x {spec.head_size} "
            f"({layout.bytes_per_layer_block} bytes); padded or quantized pages are not "
            "supported"
        )
    return layout, list(groups[0].layer_names)


def model_namespace_id(vllm_config: VllmConfig, config: OffloadConfig) -> str:
    """The ``model_id`` mixed into block hashes: the configured one, or vLLM's model
    name, revision and KV cache dtype."""
    if config.model_id:
        return config.model_id
    model = vllm_config.model_config
    return f"vllm:{model.model}@{model.revision or ''}:{vllm_config.cache_config.cache_dtype}"
