"""Configuration: `OffloadConfig` (settings) and `KVLayout` (tensor geometry).

This is the only module that reads the environment. Every other part receives an
``OffloadConfig`` object.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any, Literal

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
from pydantic_settings import BaseSettings, SettingsConfigDict, SettingsError

from kvoffload.errors import ConfigError, LayoutMismatchError
from kvoffload.tiers.settings import TierSettingsList

__all__ = ["DTypeName", "KVLayout", "LayoutKind", "OffloadConfig"]

DTypeName = Literal[
    "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "int8", "uint8"
]
"""KV dtypes kvoffload can move (by their torch names)."""

LayoutKind = Literal["blocks_first", "kv_first"]
"""How an engine lays out one layer's KV tensor.

* ``"blocks_first"``: ``[num_blocks, 2, block_size, num_kv_heads, head_size]``
* ``"kv_first"``: ``[2, num_blocks, block_size, num_kv_heads, head_size]``
"""

_GIB = 1 << 30


def _not_bool(value: object) -> object:
    """Refuse ``True``/``False`` where a count is expected (pydantic would take 1/0)."""
    if isinstance(value, bool):
        # pydantic turns only ValueError into a validation error
        raise ValueError(f"a count must be an int, not a bool ({value!r})")  # noqa: TRY004
    return value


def _frozen_setattr(model: BaseModel, name: str, value: object) -> None:
    cls = type(model).__name__
    raise ConfigError(
        f"{cls} is frozen: cannot set {name}={value!r}; build a new {cls} with the value "
        "(it is validated again)"
    )


def _describe(exc: ValidationError, fields: Collection[str], env_prefix: str | None) -> str:
    parts = []
    for err in exc.errors():
        loc = err["loc"]
        if not loc:  # a cross-field check: its message names the fields
            parts.append(err["msg"].removeprefix("Value error, "))
            continue
        where = ".".join(str(p) for p in loc)
        if env_prefix is not None and loc[0] in fields:
            where += f" (env {env_prefix}{str(loc[0]).upper()})"
        parts.append(f"{where}: {err['msg']} (got {err.get('input')!r})")
    return "; ".join(parts)


class KVLayout(BaseModel):
    """Geometry of an engine's KV cache: one tensor per layer, all alike.

    Each layer's tensor holds K and V for every GPU block, shaped as ``kind`` says.
    A CPU block holds all layers of one GPU block: ``bytes_per_block`` bytes.

    Raises:
        ConfigError: a field is out of bounds (the message names it and the value).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    num_layers: int = Field(ge=1, le=4096, description="Number of attention layers.")
    num_kv_heads: int = Field(ge=1, le=4096, description="KV heads per layer (after TP split).")
    head_size: int = Field(ge=1, le=65536, description="Elements per head.")
    dtype: DTypeName = Field(description="Element type of the KV tensors (torch name).")
    block_size: int = Field(ge=1, le=65536, description="Tokens per block.")
    kind: LayoutKind = Field(default="blocks_first", description="Per-layer tensor layout.")

    def __init__(self, **values: Any) -> None:
        try:
            super().__init__(**values)
        except ValidationError as exc:
            raise ConfigError(
                f"invalid KVLayout: {_describe(exc, type(self).model_fields, None)}"
            ) from exc

    _no_bool = field_validator(
        "num_layers", "num_kv_heads", "head_size", "block_size", mode="before"
    )(_not_bool)

    def __setattr__(self, name: str, value: object) -> None:
        _frozen_setattr(self, name, value)

    @property
    def torch_dtype(self) -> torch.dtype:
        """The element type as a ``torch.dtype``."""
        dt: torch.dtype = getattr(torch, self.dtype)
        return dt

    @property
    def element_size(self) -> int:
        """Bytes per element."""
        return torch.empty((), dtype=self.torch_dtype).element_size()

    @property
    def block_shape(self) -> tuple[int, int, int, int]:
        """Shape of one layer's part of one block: ``(2, block_size, heads, head_size)``."""
        return (2, self.block_size, self.num_kv_heads, self.head_size)

    @property
    def bytes_per_layer_block(self) -> int:
        """Bytes of one layer's K and V for one block."""
        return 2 * self.block_size * self.num_kv_heads * self.head_size * self.element_size

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block across all layers: the size of one CPU block."""
        return self.num_layers * self.bytes_per_layer_block

    def tensor_shape(self, num_gpu_blocks: int) -> tuple[int, ...]:
        """The shape one layer's tensor has for ``num_gpu_blocks`` blocks."""
        per_block = (self.block_size, self.num_kv_heads, self.head_size)
        if self.kind == "blocks_first":
            return (num_gpu_blocks, 2, *per_block)
        return (2, num_gpu_blocks, *per_block)

    def num_gpu_blocks(self, tensors: Sequence[torch.Tensor]) -> int:
        """Validate ``tensors`` against this layout and return the GPU block count.

        Raises:
            LayoutMismatchError: wrong layer count, shape, dtype, device or strides;
                the message names the layer and both values.
        """
        if len(tensors) != self.num_layers:
            raise LayoutMismatchError(
                f"expected {self.num_layers} layer tensors, got {len(tensors)}"
            )
        if not tensors:
            raise LayoutMismatchError("no KV tensors given")
        first = tensors[0]
        if first.dim() != 5:
            raise LayoutMismatchError(
                f"layer 0: expected a 5-d tensor, got shape {tuple(first.shape)}"
            )
        n = int(first.shape[0] if self.kind == "blocks_first" else first.shape[1])
        want = self.tensor_shape(n)
        for i, t in enumerate(tensors):
            if tuple(t.shape) != want:
                raise LayoutMismatchError(
                    f"layer {i}: shape {tuple(t.shape)} does not match {self.kind} layout {want}"
                )
            if t.dtype != self.torch_dtype:
                raise LayoutMismatchError(
                    f"layer {i}: dtype {t.dtype} != layout dtype {self.dtype}"
                )
            if t.device != first.device:
                raise LayoutMismatchError(
                    f"layer {i}: device {t.device} differs from layer 0's {first.device}"
                )
            if not t.is_contiguous():
                raise LayoutMismatchError(f"layer {i}: tensor is not contiguous")
        return n

    @classmethod
    def from_tensors(
        cls,
        tensors: Sequence[torch.Tensor],
        *,
        kind: LayoutKind | None = None,
        block_size: int | None = None,
    ) -> KVLayout:
        """Infer the layout from an engine's per-layer KV tensors and validate all of them.

        Args:
            tensors: one tensor per layer.
            kind: the layout kind; inferred from which dimension is 2 when omitted
                (required when both the first two dimensions are 2).
            block_size: when given, must equal the tensors' block dimension.

        Raises:
            LayoutMismatchError: the tensors disagree with each other, with ``kind`` or
                with ``block_size``, or the kind cannot be inferred.
        """
        if not tensors:
            raise LayoutMismatchError("no KV tensors given")
        shape = tuple(tensors[0].shape)
        if len(shape) != 5:
            raise LayoutMismatchError(f"layer 0: expected a 5-d tensor, got shape {shape}")
        if kind is None:
            if shape[0] == 2 and shape[1] == 2:
                raise LayoutMismatchError(
                    f"layer 0: shape {shape} is ambiguous between blocks_first and kv_first; "
                    "pass kind="
                )
            if shape[1] == 2:
                kind = "blocks_first"
            elif shape[0] == 2:
                kind = "kv_first"
            else:
                raise LayoutMismatchError(
                    f"layer 0: shape {shape} has no K/V dimension of size 2 in position 0 or 1"
                )
        elif (kind == "blocks_first" and shape[1] != 2) or (kind == "kv_first" and shape[0] != 2):
            raise LayoutMismatchError(f"layer 0: shape {shape} is not a {kind} layout")
        if block_size is not None and shape[2] != block_size:
            raise LayoutMismatchError(
                f"layer 0: block dimension {shape[2]} != block_size {block_size}"
            )
        dtype_name = str(tensors[0].dtype).removeprefix("torch.")
        try:
            layout = cls(
                num_layers=len(tensors),
                num_kv_heads=shape[3],
                head_size=shape[4],
                dtype=dtype_name,
                block_size=shape[2],
                kind=kind,
            )
        except ConfigError as exc:
            raise LayoutMismatchError(str(exc)) from exc
        layout.num_gpu_blocks(tensors)
        return layout


class OffloadConfig(BaseSettings):
    """Settings of one offloader. Frozen; reads ``KVOFFLOAD_<FIELD>`` environment variables.

    Exactly one of ``num_cpu_blocks`` and ``cpu_bytes`` sizes the CPU pool.

    Raises:
        ConfigError: a field is out of bounds or two fields disagree; the message names
            the field, its environment variable and the value.
    """

    model_config = SettingsConfigDict(env_prefix="KVOFFLOAD_", extra="forbid", frozen=True)

    block_size: int = Field(
        default=16, ge=1, le=65536, description="Tokens per KV block (must equal the layout's)."
    )
    num_cpu_blocks: int | None = Field(
        default=None, ge=1, le=1 << 31, description="CPU pool size in blocks."
    )
    cpu_bytes: ByteSize | None = Field(
        default=None,
        ge=1,
        description="CPU pool size in bytes (e.g. '8GiB'); turned into whole blocks of the layout.",
    )
    store_mode: Literal["eager", "lazy"] = Field(
        default="eager",
        description="eager: store every newly computed full block; lazy: store the GPU blocks "
        "closest to eviction only.",
    )
    lazy_offload_blocks: int = Field(
        default=256,
        ge=1,
        le=1 << 24,
        description="Lazy mode: how many GPU blocks closest to eviction to keep stored.",
    )
    restore_evicted: bool = Field(
        default=False,
        description="Re-store CPU blocks evicted below a live request's cursor while its GPU "
        "copy still exists (costs a rescan; off keeps the O(1) cursor).",
    )
    max_store_blocks_per_step: int = Field(
        default=4096, ge=1, le=1 << 24, description="Most blocks one plan_stores() schedules."
    )
    pin_memory: Literal["auto", "always", "never"] = Field(
        default="auto",
        description="Pin the host buffer: auto pins when CUDA is available and falls back to "
        "pageable memory with one warning; always fails if pinning fails; never skips it.",
    )
    pin_chunk_bytes: ByteSize = Field(
        default=ByteSize(_GIB),
        ge=1 << 20,
        le=256 * _GIB,
        description="Largest single host-memory registration when pinning.",
    )
    poll_interval_s: float = Field(
        default=0.0002,
        gt=0,
        le=0.1,
        description="Completion poller sleep between event queries while transfers are in flight.",
    )
    model_id: str = Field(
        default="", max_length=1024, description="Model name and revision, mixed into block hashes."
    )
    hash_salt: str = Field(
        default="",
        max_length=1024,
        description="Extra namespace for block hashes (cache isolation).",
    )
    enable_events: bool = Field(
        default=False, description="Record BlockStored/BlockRemoved events for KV-aware routers."
    )
    eviction_policy: str = Field(
        default="lru",
        min_length=1,
        max_length=64,
        description="Which free CPU block is reused first: lru (default, fastest), arc, "
        "s3fifo, prefix-freq, or adaptive (follows whichever of them fits the traffic; "
        "see docs/policies.md).",
    )
    store_admission: str = Field(
        default="always",
        min_length=1,
        max_length=64,
        description="Which computed blocks are stored (eager mode): always, seen_twice, or "
        "seen:N[:WINDOW] (the N-th offer of a hash within the last WINDOW offers).",
    )

    @field_validator("eviction_policy")
    @classmethod
    def _known_policy(cls, value: str) -> str:
        from kvoffload.pool.policies import POLICY_NAMES  # noqa: PLC0415 (import cycle)

        name = value.strip().lower()
        if name not in POLICY_NAMES:
            raise ValueError(f"unknown eviction policy; known: {', '.join(POLICY_NAMES)}")
        return name

    @field_validator("store_admission")
    @classmethod
    def _known_admission(cls, value: str) -> str:
        from kvoffload.pool.policies.admission import parse_admission  # noqa: PLC0415

        parse_admission(value)
        return value.strip().lower()

    tiers: TierSettingsList = Field(
        default=(),
        max_length=8,
        description="Secondary tiers below the CPU pool (disk, redis), fastest first; JSON "
        "in the environment.",
    )
    hold_blocks_on_finish: bool = Field(
        default=False,
        description="Eager mode: a request finished with computed blocks still unstored (deferred "
        "for lack of space) keeps those GPU blocks pinned until a later step stores them.",
    )
    hold_max_blocks: int = Field(
        default=1024,
        ge=1,
        le=1 << 24,
        description="Most GPU blocks all finished requests together may hold "
        "(hold_blocks_on_finish).",
    )
    hold_max_steps: int = Field(
        default=32,
        ge=1,
        le=1 << 20,
        description="plan_stores() calls after which a finished request's unstored blocks are "
        "given up and its GPU blocks released (hold_blocks_on_finish).",
    )

    def __init__(self, **values: Any) -> None:
        try:
            super().__init__(**values)
        except ValidationError as exc:
            fields = type(self).model_fields
            raise ConfigError(
                f"invalid OffloadConfig: {_describe(exc, fields, 'KVOFFLOAD_')}"
            ) from exc
        except SettingsError as exc:  # e.g. KVOFFLOAD_TIERS that is not JSON
            raise ConfigError(f"invalid OffloadConfig: {exc} (list fields take JSON)") from exc

    _no_bool = field_validator(
        "block_size",
        "num_cpu_blocks",
        "lazy_offload_blocks",
        "max_store_blocks_per_step",
        "hold_max_blocks",
        "hold_max_steps",
        mode="before",
    )(_not_bool)

    def __setattr__(self, name: str, value: object) -> None:
        _frozen_setattr(self, name, value)

    @model_validator(mode="after")
    def _exactly_one_size(self) -> OffloadConfig:
        if (self.num_cpu_blocks is None) == (self.cpu_bytes is None):
            raise ValueError(
                "exactly one of num_cpu_blocks (env KVOFFLOAD_NUM_CPU_BLOCKS) and cpu_bytes "
                f"(env KVOFFLOAD_CPU_BYTES) must be set (got num_cpu_blocks="
                f"{self.num_cpu_blocks!r}, cpu_bytes={self.cpu_bytes!r})"
            )
        return self

    def resolve_num_cpu_blocks(self, layout: KVLayout) -> int:
        """CPU blocks for ``layout``: ``num_cpu_blocks``, or ``cpu_bytes`` in whole blocks.

        Raises:
            ConfigError: ``cpu_bytes`` holds less than one block, or ``block_size``
                differs from the layout's.
        """
        if layout.block_size != self.block_size:
            raise ConfigError(
                f"block_size={self.block_size} does not match the layout's block_size="
                f"{layout.block_size}"
            )
        if self.num_cpu_blocks is not None:
            return self.num_cpu_blocks
        cpu_bytes = int(self.cpu_bytes or 0)
        n = cpu_bytes // layout.bytes_per_block
        if n < 1:
            raise ConfigError(
                f"cpu_bytes={cpu_bytes} holds no block of {layout.bytes_per_block} bytes"
            )
        return n
