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
from kvoffload.integrations.vllm.groups import describe_groups, refusal

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

    Only models whose KV cache is one group of full-attention layers with K/V pages are
    supported (chunked local attention that vLLM allocates as full attention included);
    any other model is refused with each group it cannot offload, its kind and why (see
    `kvoffload.integrations.vllm.groups.refusal`).

    Args:
        kv_cache_config: the KV cache configuration vLLM passes to the connector.

    Returns:
        ``(layout, layer_names)``: a ``blocks_first`` layout whose per-layer block holds
        exactly one vLLM page, and the layer names in the order CPU blocks hold them.

    Raises:
        ConfigError: the cache has more or fewer than one group, or its group is not plain
            full attention with K/V pages (a sliding window, chunked local attention as
            its own group, a recurrent state, an MLA latent, a packed page), or its page
            size does not match K and V of the layout.
    """
    from vllm.v1.kv_cache_interface import FullAttentionSpec  # noqa: PLC0415

    groups = kv_cache_config.kv_cache_groups
    described = describe_groups(kv_cache_config)
    reason = refusal(described)
    if reason is not None:
        raise ConfigError(f"KVOffloadConnector cannot offload this model's KV cache: {reason}")
    spec = groups[0].kv_cache_spec
    where = f"{described[0].name} ({len(groups[0].layer_names)} layers)"
    if type(spec) is not FullAttentionSpec:
        raise ConfigError(
            f"KVOffloadConnector cannot offload this model's KV cache: {described[0].name}: "
            f"{type(spec).__name__} is not plain full attention (FullAttentionSpec); this "
            "spec needs kvoffload's KV cache group support"
        )
    head_size_v = spec.head_size_v if spec.head_size_v is not None else spec.head_size
    if head_size_v != spec.head_size:
        raise ConfigError(
            f"KVOffloadConnector needs K and V of one head size; {where} has "
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
            f"{where}: a page of {spec.page_size_bytes} bytes per layer is not K and "
            f"V of {spec.block_size} tokens x {spec.num_kv_heads} heads x {spec.head_size} "
            f"({layout.bytes_per_layer_block} bytes); padded or quantized pages are not "
            "supported"
        )
    return layout, list(groups[0].layer_names)


def refuse_recurrent_hybrid(vllm_config: VllmConfig) -> None:
    """Refuse a model with recurrent-state layers next to attention, before it loads.

    Such a model's KV cache has recurrent-state groups (one state per request, snapshots
    at block boundaries), which reach a connector only through vLLM's hybrid KV cache
    manager, and vLLM turns that off for a connector without HMA support.

    Raises:
        ConfigError: ``vllm_config``'s model is such a hybrid (its architecture named).
    """
    model = vllm_config.model_config
    if model is None or not model.is_hybrid:
        return
    raise ConfigError(
        f"KVOffloadConnector cannot offload {model.architecture}: its recurrent-state "
        "layers (Mamba, linear attention) next to attention need kvoffload's KV cache "
        "group support (state snapshots); without it vLLM would fail at start-up with "
        "'Failed to promote local KV cache specs to one unified type'"
    )


def model_namespace_id(vllm_config: VllmConfig, config: OffloadConfig) -> str:
    """The ``model_id`` mixed into block hashes: the configured one, or vLLM's model
    name, revision and KV cache dtype."""
    if config.model_id:
        return config.model_id
    model = vllm_config.model_config
    return f"vllm:{model.model}@{model.revision or ''}:{vllm_config.cache_config.cache_dtype}"
