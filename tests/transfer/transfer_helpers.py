"""Helpers shared by the transfer tests."""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvoffload.config import KVLayout
from kvoffload.transfer import LoadPlan, StorePlan, TransferPlan


def make_layout(
    kind: str = "blocks_first",
    dtype: str = "float32",
    layers: int = 3,
    heads: int = 2,
    head: int = 8,
    block_size: int = 4,
) -> KVLayout:
    return KVLayout(
        num_layers=layers,
        num_kv_heads=heads,
        head_size=head,
        dtype=dtype,
        block_size=block_size,
        kind=kind,
    )


def random_kv(layout: KVLayout, num_blocks: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shape = layout.tensor_shape(num_blocks)
    return [
        torch.randn(shape, generator=gen, dtype=torch.float32).to(layout.torch_dtype)
        for _ in range(layout.num_layers)
    ]


def gpu_block(layout: KVLayout, kv: list[torch.Tensor], layer: int, block: int) -> torch.Tensor:
    """One layer's [2, bs, h, d] of one block, whatever the layout kind."""
    t = kv[layer]
    return t[block] if layout.kind == "blocks_first" else t[:, block]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


_ids = iter(range(1, 1 << 30))


def store_plan(gpu: list[int], cpu: list[int], request: str = "r") -> StorePlan:
    return StorePlan(
        plan_id=next(_ids),
        kind="store",
        gpu_block_ids=tuple(gpu),
        cpu_block_ids=tuple(cpu),
        request_ids=(request,),
        block_hashes=(),
    )


def load_plan(gpu: list[int], cpu: list[int], request: str = "r") -> LoadPlan:
    return LoadPlan(
        plan_id=next(_ids),
        kind="load",
        gpu_block_ids=tuple(gpu),
        cpu_block_ids=tuple(cpu),
        request_ids=(request,),
        request_id=request,
        num_tokens=0,
    )


PlanFactory = Callable[[list[int], list[int]], TransferPlan]
