"""vLLM's per-layer KV tensors seen as opaque pages: one run of bytes per block and layer.

vLLM allocates one ``int8`` buffer for the whole KV cache and gives every layer of every
group a view of it (``create_kv_cache_views``): attention layers ``[B, H, N, C]`` of the
spec's dtype (K/V heads, an MLA latent, a one-byte fp8 page), recurrent layers ``int8``
``[B, 1, 1, state bytes]`` with a block stride of the padded page (so not contiguous).
The groups overlay each other from byte 0: layer ``l`` of one group and layer ``l`` of
another address the same bytes, and a block id belongs to one group at a time.

`page_views` turns each layer's tensor into a ``uint8`` view ``[B, 2, bs, 1, page / (2 *
bs)]`` (the shape of an `opaque_layout`) over exactly the bytes of its pages, padding
included, so kvoffload's copy engines move a group's pages as bytes, whatever they hold.
A copy of one group's blocks then reads and writes that group's layers' pages of those
blocks only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from kvoffload.config import KVLayout
from kvoffload.errors import LayoutMismatchError

__all__ = ["page_view", "page_views"]


def page_view(
    name: str, tensor: torch.Tensor, layout: KVLayout, num_gpu_blocks: int
) -> torch.Tensor:
    """``tensor``'s pages as one ``uint8`` view in ``layout.tensor_shape(num_gpu_blocks)``.

    The tensor must have ``num_gpu_blocks`` blocks in its first dimension, a block stride
    of exactly one page (``layout.bytes_per_layer_block`` bytes, padding included), and
    every element of a block inside that block's page.

    Raises:
        LayoutMismatchError: the tensor is not laid out that way (named with its shape,
            strides and dtype).
    """
    page = layout.bytes_per_layer_block
    item = tensor.element_size()
    shape, strides = tuple(tensor.shape), tensor.stride()

    def refuse(why: str) -> LayoutMismatchError:
        return LayoutMismatchError(
            f"layer {name!r}: KV cache of shape {shape}, strides {strides} and dtype "
            f"{tensor.dtype} is not {num_gpu_blocks} block-major pages of {page} bytes: {why}"
        )

    if tensor.dim() < 1 or shape[0] != num_gpu_blocks:
        raise refuse(f"its first dimension is not the {num_gpu_blocks} blocks")
    if strides[0] * item != page:
        raise refuse(f"its block stride is {strides[0] * item} bytes")
    inner = zip(shape[1:], strides[1:], strict=True)
    extent = 1 + sum((size - 1) * stride for size, stride in inner)
    if any(s < 0 for s in strides) or extent * item > page:
        raise refuse("a block's elements reach outside its page")
    start = tensor.storage_offset() * item
    storage = tensor.untyped_storage()
    if start + num_gpu_blocks * page > storage.nbytes():
        raise refuse("the last page runs past the end of the allocation")
    raw = torch.empty(0, dtype=torch.uint8, device=tensor.device)
    raw.set_(storage, start, (num_gpu_blocks, page), (page, 1))
    return raw.view(layout.tensor_shape(num_gpu_blocks))


def page_views(
    kv_caches: Mapping[str, torch.Tensor],
    layer_names: Sequence[str],
    layout: KVLayout,
    num_gpu_blocks: int,
) -> list[torch.Tensor]:
    """`page_view` of each of ``layer_names``, in that order.

    Raises:
        LayoutMismatchError: a layer is missing or not a tensor, or `page_view` refuses it.
    """
    views = []
    for name in layer_names:
        tensor = kv_caches.get(name)
        if not isinstance(tensor, torch.Tensor):
            raise LayoutMismatchError(
                f"vLLM registered no KV cache tensor for layer {name!r} (got "
                f"{type(tensor).__name__})"
            )
        views.append(page_view(name, tensor, layout, num_gpu_blocks))
    return views
