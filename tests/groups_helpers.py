"""A small multi-group engine for the group tests: per-group GPU and CPU byte tensors
filled with values derived from (group, layer, token position), and the copies of each
plan done synchronously, so every load's bytes can be compared exactly."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvoffload.config import OffloadConfig
from kvoffload.groups import KVCacheGroup
from kvoffload.hashing import BlockHasher
from kvoffload.pool.block_pool import CpuBlockPool
from kvoffload.scheduler.groups import GroupedPlan, GroupedScheduler

PAGE = 8  # bytes per layer block in the tests


def group(name: str, kind: str, bs: int, **kw: object) -> KVCacheGroup:
    return KVCacheGroup.model_validate(
        {
            "name": name,
            "kind": kind,
            "block_size": bs,
            "num_layers": 2,
            "bytes_per_layer_block": PAGE,
            **kw,
        }
    )


def content(gi: int, layer: int, block: int, salt: int = 0) -> torch.Tensor:
    """The bytes of block ``block`` of ``layer`` in group number ``gi``."""
    base = (gi * 37 + layer * 11 + block * 5 + salt * 3) % 251
    return (torch.arange(PAGE, dtype=torch.int64) + base).remainder(256).to(torch.uint8)


class Rig:
    """Groups, their pools, a scheduler and per-group tensors."""

    def __init__(
        self,
        groups: Sequence[KVCacheGroup],
        cpu_blocks: int | dict[str, int] = 64,
        gpu_blocks: int = 256,
        checkpoint_tokens: int | None = None,
        max_retained_blocks: int | None = None,
        config: OffloadConfig | None = None,
    ) -> None:
        self.groups = list(groups)
        sizes = cpu_blocks if isinstance(cpu_blocks, dict) else {}
        self.pools = {
            g.name: CpuBlockPool(
                sizes.get(g.name, cpu_blocks if isinstance(cpu_blocks, int) else 64),
                max_retained_blocks=max_retained_blocks,
            )
            for g in groups
            if g.cacheable
        }
        self.sched = GroupedScheduler(
            groups,
            self.pools,
            checkpoint_tokens=checkpoint_tokens,
            num_gpu_blocks={g.name: gpu_blocks for g in groups},
            config=config,
        )
        self.gpu = {g.name: torch.zeros(2, gpu_blocks, PAGE, dtype=torch.uint8) for g in groups}
        self.cpu = {
            name: torch.zeros(pool.num_blocks, 2, PAGE, dtype=torch.uint8)
            for name, pool in self.pools.items()
        }
        self.copies = {g.name: 0 for g in groups}
        self.index = {g.name: i for i, g in enumerate(groups)}

    def hashes(self, tokens: Sequence[int]) -> dict[str, list[bytes]]:
        out = {}
        for g in self.groups:
            h = BlockHasher(g.namespace(model_id="t").root, g.block_size)
            h.extend(list(tokens))
            out[g.name] = list(h.block_hashes)
        return out

    def fill(self, table: dict[str, list[int | None]], salt: int = 0) -> None:
        """Write the expected bytes of every held block of every group."""
        for g in self.groups:
            gi = self.index[g.name]
            for pos, gpu in enumerate(table[g.name]):
                if gpu is None:
                    continue
                for layer in range(2):
                    self.gpu[g.name][layer, gpu] = content(gi, layer, pos, salt)

    def run(self, plan: GroupedPlan | None, ok: bool = True) -> None:
        """Do the copies of ``plan`` and complete every group's part."""
        if plan is None:
            return
        for name, sub in plan.plans.items():
            for gpu, cpu in zip(sub.gpu_block_ids, sub.cpu_block_ids, strict=True):
                self.copies[name] += 1
                if not ok:
                    continue
                if plan.kind == "store":
                    self.cpu[name][cpu] = self.gpu[name][:, gpu]
                else:
                    self.gpu[name][:, gpu] = self.cpu[name][cpu]
            self.sched.complete(name, sub, ok)

    def check_bytes(self, table: dict[str, list[int | None]], positions: dict[str, range]) -> None:
        """Every loaded block holds exactly the bytes of its (group, layer, position)."""
        for g in self.groups:
            gi = self.index[g.name]
            for pos in positions.get(g.name, range(0)):
                gpu = table[g.name][pos]
                assert gpu is not None
                for layer in range(2):
                    got = self.gpu[g.name][layer, gpu]
                    assert torch.equal(got, content(gi, layer, pos)), (g.name, layer, pos)
