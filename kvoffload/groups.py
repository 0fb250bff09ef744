"""KV cache groups: what a hybrid or MLA model's cache is made of, and what a hit needs.

A model's KV cache is an ordered tuple of `KVCacheGroup`s. Every layer of a group shares
one block table; block ``i`` of a group covers tokens ``[i * bs, (i + 1) * bs)`` (for a
``recurrent`` group, block ``i`` is the state snapshot after ``(i + 1) * bs`` tokens). A
group's page is opaque: ``bytes_per_layer_block`` bytes per layer per block, whatever is
inside (K/V heads, an MLA latent, a quantized page with its scales, a state snapshot).

This module holds the pure rules, with no state: `needed()` (the blocks a hit at ``N``
tokens needs from a group), `hit_alignment()` (the LCM of the block sizes),
`check_groups()` (what a model's groups must be together),
`store_points()`, `bytes_per_cached_token()` and `split_capacity()` (the host memory
split). `kvoffload.scheduler.groups.GroupedScheduler` applies them. See docs/groups.md.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

import torch
from pydantic import (
    BaseModel,
    ByteSize,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from kvoffload._validation import describe, frozen_setattr, not_bool, validate_or_refuse
from kvoffload.errors import ConfigError, LayoutMismatchError
from kvoffload.hashing import HashNamespace
from kvoffload.layout import KVLayout

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self from Python 3.11

__all__ = [
    "DEFAULT_CHECKPOINT_TOKENS",
    "MAX_HIT_ALIGNMENT_TOKENS",
    "GroupKind",
    "KVCacheGroup",
    "bytes_per_cached_token",
    "check_groups",
    "default_checkpoint_tokens",
    "hit_alignment",
    "needed",
    "page_layout",
    "split_capacity",
    "store_points",
]

GroupKind = Literal["full", "sliding_window", "chunked", "recurrent", "none"]
"""What a prefix hit needs from a group (see `needed()`)."""

DEFAULT_CHECKPOINT_TOKENS = 1024
"""The default spacing of store points: the smallest multiple of the hit alignment that
is at least this many tokens (`default_checkpoint_tokens()`)."""


MAX_HIT_ALIGNMENT_TOKENS = 1 << 24
"""The largest hit alignment (LCM of the cacheable groups' block sizes) `check_groups()`
takes when the model's context length is not given: 16,777,216 tokens, the bound of
``OffloadConfig.checkpoint_tokens`` (a store point is a multiple of the alignment), longer
than any model's context. A hit needs a prompt longer than the alignment."""


_MAX_DIM = 65536  # KVLayout's bound on head_size and block_size


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheGroup(BaseModel):
    """One group of layers sharing a block table, its kind and its page.

    Attributes:
        name: unique among the model's groups; part of every pool and tier key.
        kind: ``"full"``, ``"sliding_window"`` (needs ``window``), ``"chunked"`` (needs
            ``chunk``), ``"recurrent"`` (one state snapshot per block boundary) or
            ``"none"`` (never stored or loaded; does not limit hits).
        block_size: tokens per block (``recurrent``: tokens per checkpoint interval).
        window: the sliding window W in tokens.
        chunk: the local-attention chunk C in tokens.
        num_layers: layers in the group.
        bytes_per_layer_block: bytes of one block of one layer (opaque).
        dtype: the engine tensors' dtype name (copies are byte copies).
        layout: the K/V geometry when the page is K/V heads, else ``None``.
        cpu_bytes: host bytes for this group, instead of its share by need.
        cpu_share: fraction of the host capacity for this group, instead of its share.

    The counts are strict: ``True``, ``"4"`` or ``4.0`` is refused where an int is
    expected, and ``cpu_share`` takes a number, not a bool or a string.

    Raises:
        ConfigError: a field has a bad value or type, or the fields disagree (the message
            names the field and the value).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(
        min_length=1, strict=True, description="Unique group name, part of every key."
    )
    kind: GroupKind = Field(description="What a prefix hit needs from the group.")
    block_size: int = Field(ge=1, strict=True, description="Tokens per block.")
    window: int | None = Field(
        default=None, ge=1, strict=True, description="Sliding window W, tokens."
    )
    chunk: int | None = Field(
        default=None, ge=1, strict=True, description="Local-attention chunk C, tokens."
    )
    num_layers: int = Field(ge=1, strict=True, description="Layers in the group.")
    bytes_per_layer_block: int = Field(
        ge=1, strict=True, description="Bytes of one block of one layer."
    )
    dtype: str = Field(
        default="uint8", min_length=1, strict=True, description="Engine tensor dtype name."
    )
    layout: KVLayout | None = Field(default=None, description="K/V geometry, if any.")
    cpu_bytes: ByteSize | None = Field(default=None, ge=1, description="Host bytes override.")
    cpu_share: float | None = Field(
        default=None, gt=0.0, le=1.0, strict=True, description="Host capacity share override."
    )

    def __init__(self, **values: Any) -> None:
        try:
            super().__init__(**values)
        except ValidationError as exc:
            raise _refused(exc) from exc

    @classmethod
    def model_validate(cls, *args: Any, **kwargs: Any) -> Self:
        """`pydantic.BaseModel.model_validate`, refusing with a `ConfigError` as the
        constructor does."""
        return validate_or_refuse(
            lambda: super(KVCacheGroup, cls).model_validate(*args, **kwargs), _refused
        )

    _no_bool = field_validator("cpu_bytes", mode="before")(not_bool)

    def __setattr__(self, name: str, value: object) -> None:
        frozen_setattr(self, name, value)

    @model_validator(mode="after")
    def _check_kind(self) -> KVCacheGroup:
        where = f"group {self.name!r} (kind {self.kind!r})"
        if self.kind == "sliding_window" and self.window is None:
            raise ConfigError(f"{where}: window is required for a sliding_window group")
        if self.kind == "chunked":
            if self.chunk is None:
                raise ConfigError(f"{where}: chunk is required for a chunked group")
            if self.chunk % self.block_size:
                raise ConfigError(
                    f"{where}: chunk={self.chunk} must be a multiple of "
                    f"block_size={self.block_size}"
                )
        if self.window is not None and self.kind != "sliding_window":
            raise ConfigError(f"{where}: window is only for sliding_window groups")
        if self.chunk is not None and self.kind != "chunked":
            raise ConfigError(f"{where}: chunk is only for chunked groups")
        if self.cpu_bytes is not None and self.cpu_share is not None:
            raise ConfigError(f"{where}: give cpu_bytes or cpu_share, not both")
        return self

    @classmethod
    def from_layout(
        cls, layout: KVLayout, *, name: str = "g0", kind: GroupKind = "full", **fields: object
    ) -> KVCacheGroup:
        """The group whose page is ``layout``'s K/V block (one way to describe a page)."""
        values: dict[str, Any] = {
            "name": name,
            "kind": kind,
            "block_size": layout.block_size,
            "num_layers": layout.num_layers,
            "bytes_per_layer_block": layout.bytes_per_layer_block,
            "dtype": layout.dtype,
            "layout": layout,
            **fields,
        }
        return cls(**values)

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block over all of the group's layers (one CPU block)."""
        return self.num_layers * self.bytes_per_layer_block

    @property
    def cacheable(self) -> bool:
        """Whether the group is stored at all (every kind but ``"none"``)."""
        return self.kind != "none"

    def namespace(self, *, model_id: str = "", salt: str = "") -> HashNamespace:
        """The hash namespace of the group's keys: its name, kind and page are mixed in,
        so a block of one group never matches another group's key (in the pool or a
        tier), even for the same tokens."""
        page = (
            f"group={self.name}:{self.kind}:W{self.window}:C{self.chunk}:"
            f"L{self.num_layers}:P{self.bytes_per_layer_block}:B{self.block_size}"
        )
        return HashNamespace(model_id=model_id, dtype=self.dtype, layout=page, salt=salt)


def _refused(exc: ValidationError) -> ConfigError:
    """The `ConfigError` of a refused `KVCacheGroup`: each field, the problem, the value."""
    return ConfigError(f"invalid KVCacheGroup: {describe(exc, KVCacheGroup.model_fields, None)}")


def _span(group: KVCacheGroup) -> int:
    """The window (sliding_window) or chunk (chunked) of ``group``, in tokens."""
    span = group.window if group.kind == "sliding_window" else group.chunk
    if span is None:  # the model refuses this; a model_construct() could skip it
        raise ConfigError(f"group {group.name!r} (kind {group.kind!r}) has no window/chunk")
    return span


def needed(group: KVCacheGroup, n: int) -> range:
    """The block indices of ``group`` a hit at ``n`` tokens needs (docs/groups.md).

    Raises:
        ValueError: ``n`` is negative, or not a block boundary of a recurrent group.
    """
    if n < 0:
        raise ValueError(f"group {group.name!r}: a hit of {n} tokens")
    bs = group.block_size
    end = n // bs
    kind = group.kind
    if kind == "full":
        return range(0, end)
    if kind == "sliding_window":
        return range(max(0, end - _cdiv(_span(group) - 1, bs)), end)
    if kind == "chunked":
        chunk = _span(group)
        return range((n // chunk * chunk) // bs, end)
    if kind == "recurrent":
        if n % bs:
            raise ValueError(
                f"group {group.name!r}: a recurrent hit must be a multiple of "
                f"block_size={bs}, got {n}"
            )
        return range(end - 1, end) if end else range(0, 0)
    return range(0, 0)


def hit_alignment(groups: Sequence[KVCacheGroup]) -> int:
    """The granularity of hits: the LCM of the cacheable groups' block sizes."""
    sizes = [g.block_size for g in groups if g.cacheable]
    return math.lcm(*sizes) if sizes else 1


def check_groups(groups: Sequence[KVCacheGroup], *, max_model_len: int | None = None) -> int:
    """Check a model's groups as a whole; return their hit alignment (`hit_alignment()`).

    Args:
        groups: the model's groups, in order.
        max_model_len: the model's context length in tokens, when known; otherwise the
            alignment is bounded by `MAX_HIT_ALIGNMENT_TOKENS`.

    Raises:
        ConfigError: no group, two groups of one name, no cacheable group (every group
            of kind ``"none"``: nothing to offload), or an alignment so large that no hit
            is possible (at least ``max_model_len``, or above `MAX_HIT_ALIGNMENT_TOKENS`);
            the message gives the names, or the alignment and the block sizes.
    """
    names = [g.name for g in groups]
    if len(set(names)) != len(names) or not names:
        raise ConfigError(f"group names must be unique and non-empty, got {names}")
    if not any(g.cacheable for g in groups):
        raise ConfigError(
            f"no group is cacheable: the groups {names} are all of kind 'none' (never "
            "stored or loaded), so there is nothing to offload"
        )
    align = hit_alignment(groups)
    sizes = {g.name: g.block_size for g in groups if g.cacheable}
    if max_model_len is not None and align >= max_model_len:
        raise ConfigError(
            f"the hit alignment {align} tokens (the LCM of the block sizes {sizes}) is not "
            f"below the model's context of max_model_len={max_model_len} tokens: a hit is a "
            "multiple of it and shorter than the prompt, so no hit is possible"
        )
    if align > MAX_HIT_ALIGNMENT_TOKENS:
        raise ConfigError(
            f"the hit alignment {align} tokens (the LCM of the block sizes {sizes}) "
            f"exceeds {MAX_HIT_ALIGNMENT_TOKENS} tokens (MAX_HIT_ALIGNMENT_TOKENS): a hit "
            "is a multiple of it and shorter than the prompt, so no hit would ever be "
            "possible; choose block sizes with a smaller least common multiple"
        )
    return align


def default_checkpoint_tokens(groups: Sequence[KVCacheGroup]) -> int:
    """The smallest multiple of `hit_alignment()` that is at least
    `DEFAULT_CHECKPOINT_TOKENS`."""
    align = hit_alignment(groups)
    return align * _cdiv(DEFAULT_CHECKPOINT_TOKENS, align)


def store_points(start: int, end: int, checkpoint_tokens: int) -> range:
    """The store points in ``(start, end]``: the multiples of ``checkpoint_tokens``."""
    first = (start // checkpoint_tokens + 1) * checkpoint_tokens
    return range(first, end + 1, checkpoint_tokens)


def bytes_per_cached_token(group: KVCacheGroup, checkpoint_tokens: int) -> float:
    """Host bytes a group needs per cached token, what `split_capacity()` shares by.

    Full: one block per ``block_size`` tokens. Sliding window: the window's blocks per
    store point; chunked: at most one chunk's blocks per store point; recurrent: one
    snapshot per store point; none: nothing.
    """
    bpb = group.bytes_per_block
    bs = group.block_size
    if group.kind == "full":
        return bpb / bs
    if group.kind == "sliding_window":
        blocks = min(_cdiv(_span(group) - 1, bs), _cdiv(checkpoint_tokens, bs))
        return blocks * bpb / checkpoint_tokens
    if group.kind == "chunked":
        blocks = min(_span(group), checkpoint_tokens) // bs
        return blocks * bpb / checkpoint_tokens
    if group.kind == "recurrent":
        return bpb / checkpoint_tokens
    return 0.0


def split_capacity(
    groups: Sequence[KVCacheGroup], cpu_bytes: int, checkpoint_tokens: int
) -> dict[str, int]:
    """CPU blocks per cacheable group out of ``cpu_bytes`` of host memory.

    Groups with ``cpu_bytes`` get that; groups with ``cpu_share`` get that fraction of
    ``cpu_bytes``; the rest is shared by `bytes_per_cached_token()`, so every group caches
    about as many tokens as the others. Every cacheable group gets at least one block.

    Raises:
        ConfigError: the overrides exceed ``cpu_bytes``, or a group gets no block.
    """
    cacheable = [g for g in groups if g.cacheable]
    fixed = {g.name: int(g.cpu_bytes) for g in cacheable if g.cpu_bytes is not None}
    fixed |= {g.name: int(cpu_bytes * g.cpu_share) for g in cacheable if g.cpu_share is not None}
    left = cpu_bytes - sum(fixed.values())
    if left < 0:
        raise ConfigError(
            f"the groups' cpu_bytes/cpu_share overrides ({sum(fixed.values())} bytes) "
            f"exceed cpu_bytes={cpu_bytes}"
        )
    shared = [g for g in cacheable if g.name not in fixed]
    need = {g.name: bytes_per_cached_token(g, checkpoint_tokens) for g in shared}
    total = sum(need.values())
    out: dict[str, int] = {}
    for g in cacheable:
        nbytes = fixed.get(g.name)
        if nbytes is None:
            nbytes = int(left * need[g.name] / total) if total else 0
        blocks = nbytes // g.bytes_per_block
        if blocks < 1:
            raise ConfigError(
                f"group {g.name!r} (kind {g.kind!r}) gets {nbytes} host bytes, less than "
                f"one block of {g.bytes_per_block} bytes: raise cpu_bytes or its override"
            )
        out[g.name] = blocks
    return out


def page_layout(
    group: KVCacheGroup, tensors: Sequence[torch.Tensor], *, block_size: int | None = None
) -> tuple[KVLayout, list[torch.Tensor]]:
    """The copy geometry of ``group`` and its tensors as the copy engines see them.

    A group whose ``layout`` matches its tensors keeps them; any other page (an MLA
    latent, a state snapshot, a quantized page) is copied as opaque bytes: each layer's
    tensor, contiguous with the GPU block in its first dimension, is viewed as ``uint8``
    ``[blocks, 2, rows, 1, cols]`` holding ``bytes_per_layer_block`` bytes per block.

    Args:
        group: the group.
        tensors: its layer tensors.
        block_size: the ``rows`` of an opaque page, when the layout's ``block_size`` must
            be the group's (the one-group offloader: its pool counts tokens by it);
            otherwise the fewest rows that keep a row within bounds.

    Raises:
        LayoutMismatchError: the tensors disagree with the group (layer count, bytes per
            block, contiguity), or the page cannot be split so (an odd page; with
            ``block_size``, a page that is not a multiple of ``2 * block_size`` bytes),
            naming the group and the values.
    """
    where = f"group {group.name!r} (kind {group.kind!r})"
    if len(tensors) != group.num_layers:
        raise LayoutMismatchError(
            f"{where}: {len(tensors)} layer tensors given, the group has {group.num_layers}"
        )
    lay = group.layout
    if lay is not None and all(t.dim() == 5 for t in tensors):
        lay.num_gpu_blocks(tensors)
        return lay, list(tensors)
    page = group.bytes_per_layer_block
    half = page // 2
    if block_size is not None:
        rows = block_size
        if page % (2 * rows) or half // rows > _MAX_DIM:
            raise LayoutMismatchError(
                f"{where}: a page of {page} bytes per layer is copied as 2 x block_size="
                f"{rows} rows of opaque bytes, so it must be a multiple of {2 * rows} bytes "
                f"and at most {2 * rows * _MAX_DIM}"
            )
    else:
        rows = 1
        while half // rows > _MAX_DIM or half % rows:
            rows += 1
        if page % 2 or rows > _MAX_DIM:
            raise LayoutMismatchError(
                f"{where}: a page of {page} bytes cannot be copied as K/V halves"
            )
    views = []
    for i, t in enumerate(tensors):
        nbytes = t[0].numel() * t.element_size() if t.dim() and t.shape[0] else 0
        if not t.is_contiguous() or nbytes != page:
            raise LayoutMismatchError(
                f"{where}: layer {i} tensor of shape {tuple(t.shape)} ({t.dtype}) must be "
                f"contiguous with {page} bytes per block in its first dimension, has {nbytes}"
            )
        views.append(t.view(torch.uint8).view(t.shape[0], 2, rows, 1, half // rows))
    layout = KVLayout(
        num_layers=group.num_layers,
        num_kv_heads=1,
        head_size=half // rows,
        dtype="uint8",
        block_size=rows,
    )
    return layout, views
