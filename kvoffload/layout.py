"""The tensor geometry of an engine's KV cache: `KVLayout`, `DTypeName` and `LayoutKind`.

It sits below hashing (a `HashNamespace` mixes the geometry in), the host buffer and the
copy engines, and below `kvoffload.config` (which re-exports these names).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from kvoffload._validation import describe, frozen_setattr, not_bool, validate_or_refuse
from kvoffload.errors import ConfigError, LayoutMismatchError

__all__ = ["DTypeName", "KVLayout", "LayoutKind"]

DTypeName = Literal[
    "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "int8", "uint8"
]
"""KV dtypes kvoffload can move (by their torch names)."""

LayoutKind = Literal["blocks_first", "kv_first"]
"""How an engine lays out one layer's KV tensor.

* ``"blocks_first"``: ``[num_blocks, 2, block_size, num_kv_heads, head_size]``
* ``"kv_first"``: ``[2, num_blocks, block_size, num_kv_heads, head_size]``
"""

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self from Python 3.11


def _refused(exc: ValidationError) -> ConfigError:
    """The `ConfigError` of a refused `KVLayout`: each field, the problem, the value."""
    return ConfigError(f"invalid KVLayout: {describe(exc, KVLayout.model_fields, None)}")


class KVLayout(BaseModel):
    """Geometry of an engine's KV cache: one tensor per layer, all alike.

    Each layer's tensor holds K and V for every GPU block, shaped as ``kind`` says.
    A CPU block holds all layers of one GPU block: ``bytes_per_block`` bytes.

    Raises:
        ConfigError: a field is out of bounds or not an int (``True``, ``"4"`` and ``4.0``
            are refused, not coerced); the message names it and the value.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    num_layers: int = Field(ge=1, strict=True, le=4096, description="Number of attention layers.")
    num_kv_heads: int = Field(
        ge=1, strict=True, le=4096, description="KV heads per layer (after TP split)."
    )
    head_size: int = Field(ge=1, strict=True, le=65536, description="Elements per head.")
    dtype: DTypeName = Field(description="Element type of the KV tensors (torch name).")
    block_size: int = Field(ge=1, strict=True, le=65536, description="Tokens per block.")
    kind: LayoutKind = Field(default="blocks_first", description="Per-layer tensor layout.")

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
            lambda: super(KVLayout, cls).model_validate(*args, **kwargs), _refused
        )

    _no_bool = field_validator(
        "num_layers", "num_kv_heads", "head_size", "block_size", mode="before"
    )(not_bool)

    def __setattr__(self, name: str, value: object) -> None:
        frozen_setattr(self, name, value)

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
