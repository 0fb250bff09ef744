"""vLLM's KV cache groups as neutral, engine-agnostic descriptions.

vLLM describes a model's KV cache as a `KVCacheConfig`: a list of `KVCacheGroupSpec`
(layer names sharing one block table) each with a `KVCacheSpec` subclass. `describe_groups`
translates that into one frozen `GroupDescription` per group, with no vLLM type in it:
what kvoffload's core needs to know about a group to store and load its blocks (what a
hit requires of it, the geometry of one block's page, the layers it covers).

`refusal` says why the connector cannot offload a model, naming the group, its kind and
why; `to_kv_cache_group` turns an accepted description into kvoffload's `KVCacheGroup`.
See ``docs/groups.md`` for what each vLLM spec means for offload.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, final

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, KVCacheSpec

    from kvoffload.groups import KVCacheGroup

__all__ = [
    "GroupDescription",
    "GroupKind",
    "PageFormat",
    "describe_groups",
    "refusal",
    "to_kv_cache_group",
]

GroupKind = Literal["full", "sliding_window", "chunked", "recurrent", "none"]
"""What a prefix hit at N tokens needs from a group.

- ``full``: every block below N (hits are downward-closed);
- ``sliding_window``: the blocks covering the last ``window - 1`` tokens before N;
- ``chunked``: the blocks of the attention chunk that N falls in;
- ``recurrent``: one state snapshot, taken at a block boundary at or before N - 1;
- ``none``: nothing can be reused (not prefix-cacheable); never stored.
"""

PageFormat = Literal["kv", "mla", "state", "opaque"]
"""What one layer's page of one block holds: K and V heads (``kv``), an MLA latent with
its rope part (``mla``), a recurrent state (``state``), or bytes kvoffload does not
interpret (``opaque``: quantized with scales, packed, or an unknown spec)."""


@final
@dataclass(frozen=True, slots=True)
class GroupDescription:
    """One vLLM KV cache group, as kvoffload's group model will take it.

    Attributes:
        index: the group's position in ``KVCacheConfig.kv_cache_groups`` (vLLM's group
            id: block-id lists per group arrive in this order).
        name: ``"group <index>"``, for messages and metrics.
        kind: what a hit needs from this group (`GroupKind`).
        spec: the vLLM spec's class name and the fields that decided ``kind``, for
            messages (e.g. ``"FullAttentionSpec with sliding_window=128"``).
        block_size: tokens per block (for ``recurrent``, tokens between snapshots).
        sliding_window: the window in tokens of a ``sliding_window`` group, else
            ``None``; also set on a ``full`` group whose layers vLLM allocates as full
            attention but computes with a window (hybrid manager off).
        attention_chunk_size: the chunk in tokens of a ``chunked`` group, else ``None``;
            also set on a ``full`` group as ``sliding_window`` is.
        layer_names: the group's layers, in vLLM's order.
        page_bytes: bytes one block of each layer occupies in vLLM's cache, padding
            included (one per layer, in ``layer_names`` order).
        content_bytes: of those, the bytes that hold data (without padding).
        dtype: the element type of the per-layer tensors vLLM registers with the
            connector (``"float32"``, ``"bfloat16"``, ``"uint8"``, ``"float8_e4m3fn"``;
            ``"int8"`` for recurrent states, which vLLM registers as raw bytes).
        page_format: what a page holds (`PageFormat`).
        num_kv_heads: K/V heads (or MLA latent slots) per page; ``None`` for states.
        head_size: K head size, or the MLA latent width; ``None`` for states.
        head_size_v: V head size (0 for MLA); ``None`` for states.
        prefix_cacheable: whether vLLM keys this group's blocks by prefix hash and lets
            external KV be loaded into it.
        spec_type: the class name of the (first layer's) vLLM spec.
    """

    index: int
    name: str
    kind: GroupKind
    spec: str
    block_size: int
    sliding_window: int | None
    attention_chunk_size: int | None
    layer_names: tuple[str, ...]
    page_bytes: tuple[int, ...]
    content_bytes: tuple[int, ...]
    dtype: str
    page_format: PageFormat
    num_kv_heads: int | None = None
    head_size: int | None = None
    head_size_v: int | None = None
    prefix_cacheable: bool = True
    spec_type: str = ""

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block across all the group's layers, padding included."""
        return sum(self.page_bytes)

    @property
    def uniform_page_bytes(self) -> int | None:
        """The page size when every layer has the same one, else ``None``."""
        sizes = set(self.page_bytes)
        return sizes.pop() if len(sizes) == 1 else None


def _dtype_name(dtype: object) -> str:
    return str(dtype).removeprefix("torch.")


def _spec_label(spec: KVCacheSpec) -> str:
    """The spec's class and the fields that decide its kind."""
    extras = [
        f"{attr}={getattr(spec, attr)}"
        for attr in ("sliding_window", "attention_chunk_size", "rswa_window", "mamba_cache_mode")
        if getattr(spec, attr, None) is not None
    ]
    label = type(spec).__name__
    return f"{label} with {', '.join(extras)}" if extras else label


def _layer_specs(
    group: KVCacheGroupSpec,
) -> list[tuple[str, KVCacheSpec]]:
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs  # noqa: PLC0415

    spec = group.kv_cache_spec
    if isinstance(spec, UniformTypeKVCacheSpecs):
        return [(name, spec.kv_cache_specs[name]) for name in group.layer_names]
    return [(name, spec) for name in group.layer_names]


def _kind_of(spec: KVCacheSpec) -> tuple[GroupKind, int | None, int | None]:
    """The group kind of one layer's spec, its sliding window and its attention chunk."""
    from vllm.v1.kv_cache_interface import (  # noqa: PLC0415
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        MambaSpec,
        RSWASpec,
        SlidingWindowSpec,
    )

    if not spec.prefix_cacheable:
        return "none", None, None
    if isinstance(spec, MambaSpec):
        # "align" keeps a state snapshot at block boundaries, keyed by the prefix hash;
        # "none" keeps only the running state, which no later request can reuse.
        return ("recurrent" if spec.mamba_cache_mode != "none" else "none"), None, None
    if isinstance(spec, RSWASpec):
        # Gap blocks between the prompt and the decode window are freed: not a prefix.
        return "none", None, None
    if isinstance(spec, FullAttentionSpec):
        # With the hybrid manager off, sliding-window and chunked layers are allocated
        # as full attention (every block kept) and carry their window here.
        return "full", spec.sliding_window, spec.attention_chunk_size
    if isinstance(spec, SlidingWindowSpec):
        # vLLM keeps ``extra_retained_tokens`` below the window for multi-token drafts:
        # they are part of what a hit must restore, so they widen the stored window.
        extra = getattr(spec, "extra_retained_tokens", 0) or 0
        return "sliding_window", spec.sliding_window + extra, None
    if isinstance(spec, ChunkedLocalAttentionSpec):
        return "chunked", None, spec.attention_chunk_size
    # Encoder-only, cross-attention, ring buffers, HiSparse, unknown specs.
    return "none", None, None


def _page_of(spec: KVCacheSpec) -> tuple[PageFormat, str, int, int | None, int | None, int | None]:
    """``(format, dtype, content bytes, heads, head_size, head_size_v)`` of one layer."""
    from vllm.v1.kv_cache_interface import (  # noqa: PLC0415
        AttentionSpec,
        KVQuantMode,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowMLASpec,
    )

    if isinstance(spec, MambaSpec):
        return "state", "int8", spec.real_page_size_bytes, None, None, None
    if isinstance(spec, AttentionSpec):
        content = spec.unpadded_page_size_bytes
        dtype = _dtype_name(spec.dtype)
        heads, size, size_v = spec.num_kv_heads, spec.head_size, spec.head_size_v
        packed = (
            (
                spec.kv_quant_mode is not KVQuantMode.NONE
                and spec.kv_quant_mode is not KVQuantMode.FP8_PER_TENSOR
            )
            or spec.state_content_bytes is not None
            or spec.num_head_slots is not None
        )
        if packed or spec.tokens_per_state != 1:
            return "opaque", dtype, content, heads, size, size_v
        if isinstance(spec, (MLAAttentionSpec, SlidingWindowMLASpec)):
            return "mla", dtype, content, heads, size, size_v
        return "kv", dtype, content, heads, size, size_v
    return "opaque", "int8", spec.page_size_bytes, None, None, None


def describe_group(index: int, group: KVCacheGroupSpec) -> GroupDescription:
    """The neutral description of one vLLM KV cache group.

    A group whose layers disagree on kind, window, block size, page format or dtype
    (possible only inside vLLM's ``UniformTypeKVCacheSpecs``) is described by its
    first layer, with its per-layer page sizes; its ``spec`` names the wrapper.
    """
    layers = _layer_specs(group)
    spec = group.kv_cache_spec
    first = layers[0][1] if layers else spec
    kind, sliding_window, chunk = _kind_of(first)
    page_format, dtype, _, heads, size, size_v = _page_of(first)
    page_bytes = tuple(layer.page_size_bytes for _, layer in layers)
    content_bytes = tuple(_page_of(layer)[2] for _, layer in layers)
    cacheable = bool(spec.prefix_cacheable and group.enable_kv_transfer and kind != "none")
    return GroupDescription(
        index=index,
        name=f"group {index}",
        kind=kind if cacheable else "none",
        spec=_spec_label(spec)
        if spec is first
        else f"{type(spec).__name__} of {_spec_label(first)}",
        block_size=spec.block_size,
        sliding_window=sliding_window,
        attention_chunk_size=chunk,
        layer_names=tuple(group.layer_names),
        page_bytes=page_bytes,
        content_bytes=content_bytes,
        dtype=dtype,
        page_format=page_format,
        num_kv_heads=heads,
        head_size=size,
        head_size_v=size_v,
        prefix_cacheable=cacheable,
        spec_type=type(first).__name__,
    )


def describe_groups(kv_cache_config: KVCacheConfig) -> tuple[GroupDescription, ...]:
    """One `GroupDescription` per group of ``kv_cache_config``, in vLLM's order."""
    return tuple(describe_group(i, g) for i, g in enumerate(kv_cache_config.kv_cache_groups))


def _where(group: GroupDescription) -> str:
    count = len(group.layer_names)
    example = group.layer_names[0] if group.layer_names else "-"
    return f"{group.name}: {group.spec} ({count} layer{'s' if count != 1 else ''}, e.g. {example})"


_KNOWN_SPECS = frozenset(
    {
        "FullAttentionSpec",
        "MLAAttentionSpec",
        "SlidingWindowSpec",
        "SlidingWindowMLASpec",
        "ChunkedLocalAttentionSpec",
        "MambaSpec",
    }
)
"""The vLLM specs whose blocks kvoffload knows how to store and load. A spec outside it
(attention sinks, reduced sliding windows, HiSparse, ...) that vLLM expects a connector to
restore is refused; one that is not prefix-cacheable is a ``none`` group."""


def _reason(group: GroupDescription) -> str | None:
    """Why the connector cannot offload this group, or ``None``."""
    if group.kind == "none":
        return None  # not prefix-cacheable: never stored, does not limit hits
    if group.spec_type and group.spec_type not in _KNOWN_SPECS:
        return (
            f"kind {group.kind}: kvoffload does not know which blocks a hit needs from a "
            f"{group.spec_type} group, so it cannot restore it"
        )
    if group.uniform_page_bytes is None:
        return (
            f"kind {group.kind}: its layers have pages of different sizes "
            f"{sorted(set(group.page_bytes))}; a CPU block holds one page size per group"
        )
    if group.page_format == "opaque":
        return (
            f"kind {group.kind}: packed or per-token-head quantized pages "
            "(their scales laid out by the attention backend) are not supported"
        )
    return None


def refusal(groups: Sequence[GroupDescription]) -> str | None:
    """Why the connector cannot offload these groups, or ``None`` if it can.

    Every group of a known kind is offloaded: full attention (with a window or chunk set
    by vLLM when its hybrid manager is off: every block kept, hits downward-closed),
    sliding window, chunked, recurrent state (``align`` mode) and groups that are not
    prefix-cacheable (never stored). Pages are opaque bytes per layer: K/V heads, an MLA
    latent, a one-byte fp8 page, a padded state. The message names each group it cannot
    offload, its kind and why.
    """
    if not groups:
        return "this model has no KV cache groups (attention-free): there is nothing to offload"
    listed = [f"{_where(g)}: {why}" for g in groups if (why := _reason(g)) is not None]
    if listed:
        return "; ".join(listed)
    if all(g.kind == "none" for g in groups):
        return "; ".join(
            f"{_where(g)}: kind none: this group is not prefix-cacheable, so there is "
            "nothing to offload"
            for g in groups
        )
    return None


def to_kv_cache_group(group: GroupDescription) -> KVCacheGroup:
    """kvoffload's `KVCacheGroup` for an accepted description (`refusal` is ``None``).

    Its name is ``g<index>``; its page is ``page_bytes`` per layer, opaque (padding
    included); a ``full`` group keeps no window or chunk (vLLM keeps every block of it).
    """
    from kvoffload.groups import KVCacheGroup  # noqa: PLC0415

    page = group.uniform_page_bytes or 1
    return KVCacheGroup(
        name=f"g{group.index}",
        kind=group.kind,
        block_size=group.block_size,
        window=group.sliding_window if group.kind == "sliding_window" else None,
        chunk=group.attention_chunk_size if group.kind == "chunked" else None,
        num_layers=max(1, len(group.layer_names)),
        bytes_per_layer_block=page,
        dtype=group.dtype,
    )
