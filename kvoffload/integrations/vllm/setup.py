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
from kvoffload.integrations.vllm.groups import GroupDescription, describe_groups, refusal

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = [
    "accepted_groups",
    "is_single_full_group",
    "layout_from_kv_cache_config",
    "offload_config",
    "opaque_layout",
    "single_group_layout",
]


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


def accepted_groups(kv_cache_config: KVCacheConfig) -> tuple[GroupDescription, ...]:
    """The model's groups, described; refused when the connector cannot offload them.

    Raises:
        ConfigError: naming each group it cannot offload, its kind and why (see
            `kvoffload.integrations.vllm.groups.refusal`).
    """
    described = describe_groups(kv_cache_config)
    reason = refusal(described)
    if reason is not None:
        raise ConfigError(f"KVOffloadConnector cannot offload this model's KV cache: {reason}")
    return described


def is_single_full_group(groups: tuple[GroupDescription, ...]) -> bool:
    """Whether the model is one full-attention group (its layout is `single_group_layout`,
    its worker side `WorkerSide`, its namespace and tiers those of `KVOffloader`)."""
    return len(groups) == 1 and groups[0].kind == "full"


def opaque_layout(group: GroupDescription) -> KVLayout:
    """A ``uint8`` layout whose per-layer block is exactly one of ``group``'s pages.

    The page is opaque bytes (an MLA latent, a padded state, K/V of any head sizes):
    ``2 * block_size * 1 * head_size`` bytes, with ``head_size = page / (2 * block_size)``.

    Raises:
        ConfigError: the page is not a multiple of twice the block size (named).
    """
    page = group.uniform_page_bytes or 0
    bs = group.block_size
    if page <= 0 or page % (2 * bs):
        raise ConfigError(
            f"KVOffloadConnector cannot offload {group.name} ({group.spec}, kind "
            f"{group.kind}): a page of {page} bytes per layer is not a multiple of "
            f"2 x block_size={bs} bytes"
        )
    return KVLayout(
        num_layers=max(1, len(group.layer_names)),
        num_kv_heads=1,
        head_size=page // (2 * bs),
        dtype="uint8",
        block_size=bs,
        kind="blocks_first",
    )


def single_group_layout(kv_cache_config: KVCacheConfig) -> tuple[KVLayout, list[str], bool]:
    """The layout of one CPU block of a one-group full-attention model, its layers, and
    whether its pages are moved as opaque bytes.

    Plain K/V pages (K and V of one head size, the page exactly their bytes; with or
    without a window that vLLM allocates as full attention) get the K/V layout of
    today's path. Any other page (an MLA latent, K/V of two head sizes) gets an
    `opaque_layout` (``uint8``), and workers view vLLM's tensors as bytes.

    Raises:
        ConfigError: the model cannot be offloaded (`accepted_groups`), or it is not one
            full-attention group.
    """
    groups = accepted_groups(kv_cache_config)
    if not is_single_full_group(groups):
        kinds = ", ".join(f"{g.name}: {g.kind}" for g in groups)
        raise ConfigError(
            f"KVOffloadConnector: expected one full-attention group, got {len(groups)} ({kinds})"
        )
    (group,) = groups
    names = list(group.layer_names)
    if group.page_format == "kv" and group.head_size_v == group.head_size:
        heads, size = group.num_kv_heads or 0, group.head_size or 0
        layout = KVLayout(
            num_layers=len(names),
            num_kv_heads=heads,
            head_size=size,
            dtype=group.dtype,
            block_size=group.block_size,
            kind="blocks_first",
        )
        if group.uniform_page_bytes == layout.bytes_per_layer_block:
            return layout, names, False
    return opaque_layout(group), names, True


def layout_from_kv_cache_config(kv_cache_config: KVCacheConfig) -> tuple[KVLayout, list[str]]:
    """The layout of one CPU block of a one-group full-attention model, and its layers in
    the order CPU blocks hold them (`single_group_layout` without the opaque flag).

    Raises:
        ConfigError: as `single_group_layout`.
    """
    layout, names, _ = single_group_layout(kv_cache_config)
    return layout, names


def refuse_recurrent_hybrid(vllm_config: VllmConfig) -> None:
    """Refuse a model with recurrent-state layers next to attention when vLLM's hybrid
    KV cache manager is off, before the model loads.

    The connector supports the hybrid manager (`SupportsHMA`), so vLLM keeps it on and
    hands such a model's recurrent-state groups to the connector. Turned off
    (``--disable-hybrid-kv-cache-manager``), vLLM would fail after loading the model with
    "Failed to promote local KV cache specs to one unified type".

    Raises:
        ConfigError: ``vllm_config``'s model is such a hybrid and the hybrid manager is
            off (its architecture named).
    """
    model = vllm_config.model_config
    if model is None or not model.is_hybrid:
        return
    if not vllm_config.scheduler_config.disable_hybrid_kv_cache_manager:
        return
    raise ConfigError(
        f"KVOffloadConnector cannot offload {model.architecture} with vLLM's hybrid KV "
        "cache manager off: its recurrent-state layers (Mamba, linear attention) reach a "
        "connector only through that manager (vLLM would fail at start-up with 'Failed "
        "to promote local KV cache specs to one unified type'); leave it on"
    )


def model_namespace_id(vllm_config: VllmConfig, config: OffloadConfig) -> str:
    """The ``model_id`` mixed into block hashes: the configured one, or vLLM's model
    name, revision and KV cache dtype."""
    if config.model_id:
        return config.model_id
    model = vllm_config.model_config
    return f"vllm:{model.model}@{model.revision or ''}:{vllm_config.cache_config.cache_dtype}"
