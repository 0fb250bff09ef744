"""Reference models of the eviction policies: plain lists, written the obvious way.

Each model sees what a policy sees (touch, free, victims) and keeps only the policy's
state; block reference counts and hashes are read from the pool's blocks. The tests drive
a pool and a model side by side and demand the same victims.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence

from kvoffload.hashing import BlockHash
from kvoffload.pool.free_queue import CpuBlock


class LruModel:
    def __init__(self, blocks: Sequence[CpuBlock]) -> None:
        self.blocks = blocks
        self.order = [b.block_id for b in blocks]

    def on_touch(self, block: CpuBlock) -> None:
        if block.ref_cnt == 0:
            self.order.remove(block.block_id)

    def on_free(self, blocks: Sequence[CpuBlock]) -> None:
        self.order.extend(b.block_id for b in blocks)

    def victims(self, n: int, protect: Collection[CpuBlock]) -> list[int]:
        ids = {b.block_id for b in protect}
        out = [b for b in self.order if b not in ids][:n]
        for b in out:
            self.order.remove(b)
        return out


class _Empty:
    def __init__(self, blocks: Sequence[CpuBlock]) -> None:
        self.blocks = blocks
        self.empty = [b.block_id for b in blocks]

    def take_empty(self, n: int, protect: Collection[CpuBlock]) -> list[int]:
        ids = {b.block_id for b in protect}
        out = [b for b in self.empty if self.blocks[b].ref_cnt == 0 and b not in ids][:n]
        for b in out:
            self.empty.remove(b)
        return out

    def untouch_empty(self, block: CpuBlock) -> None:
        if block.ref_cnt == 0 and block.block_id in self.empty:
            self.empty.remove(block.block_id)


class ArcModel(_Empty):
    def __init__(self, blocks: Sequence[CpuBlock]) -> None:
        super().__init__(blocks)
        self.c = len(blocks)
        self.t1: list[int] = []
        self.t2: list[int] = []
        self.b1: list[BlockHash] = []
        self.b2: list[BlockHash] = []
        self.p = 0.0

    def on_touch(self, block: CpuBlock) -> None:
        b = block.block_id
        if b in self.t1:
            self.t1.remove(b)
            self.t2.append(b)
        elif b in self.t2:
            self.t2.remove(b)
            self.t2.append(b)
        else:
            self.untouch_empty(block)

    def on_free(self, blocks: Sequence[CpuBlock]) -> None:
        for block in blocks:
            b, h = block.block_id, block.block_hash
            if b in self.t1 or b in self.t2:
                continue
            if h is None:
                if b not in self.empty:
                    self.empty.append(b)
            elif h in self.b1:
                self.p = min(self.c, self.p + max(len(self.b2) / max(len(self.b1), 1), 1.0))
                self.b1.remove(h)
                self.t2.append(b)
            elif h in self.b2:
                self.p = max(0.0, self.p - max(len(self.b1) / max(len(self.b2), 1), 1.0))
                self.b2.remove(h)
                self.t2.append(b)
            else:
                self.t1.append(b)

    def _first(self, lst: list[int], ids: set[int]) -> int | None:
        for b in lst:
            if self.blocks[b].ref_cnt == 0 and b not in ids:
                return b
        return None

    def victims(self, n: int, protect: Collection[CpuBlock]) -> list[int]:
        out = self.take_empty(n, protect)
        ids = {b.block_id for b in protect}
        while len(out) < n:
            use_t1 = bool(self.t1) and (len(self.t1) > self.p or not self.t2)
            first, second = (self.t1, self.t2) if use_t1 else (self.t2, self.t1)
            b = self._first(first, ids)
            lst = first
            if b is None:
                b, lst = self._first(second, ids), second
            assert b is not None
            lst.remove(b)
            h = self.blocks[b].block_hash
            if h is not None:
                if lst is self.t1:
                    if h in self.b1:
                        self.b1.remove(h)
                    self.b1.append(h)
                    while len(self.b1) > max(0, self.c - len(self.t1)):
                        self.b1.pop(0)
                else:
                    if h in self.b2:
                        self.b2.remove(h)
                    self.b2.append(h)
                    cap = max(0, 2 * self.c - len(self.t1) - len(self.t2) - len(self.b1))
                    while len(self.b2) > min(cap, 2 * self.c):
                        self.b2.pop(0)
            out.append(b)
        return out


class S3FifoModel(_Empty):
    def __init__(self, blocks: Sequence[CpuBlock]) -> None:
        super().__init__(blocks)
        n = len(blocks)
        self.small_target = max(1, int(n * 0.1))
        self.ghost_cap = n - self.small_target
        self.small: list[int] = []
        self.main: list[int] = []
        self.ghost: list[BlockHash] = []
        self.freq = [0] * n

    def on_touch(self, block: CpuBlock) -> None:
        b = block.block_id
        if b in self.small or b in self.main:
            self.freq[b] = min(3, self.freq[b] + 1)
        else:
            self.untouch_empty(block)

    def on_free(self, blocks: Sequence[CpuBlock]) -> None:
        for block in blocks:
            b, h = block.block_id, block.block_hash
            if b in self.small or b in self.main:
                continue
            if h is None:
                if b not in self.empty:
                    self.empty.append(b)
                continue
            self.freq[b] = 0
            if h in self.ghost:
                self.ghost.remove(h)
                self.main.append(b)
            else:
                self.small.append(b)

    def _small(self, ids: set[int]) -> int | None:
        skipped, found = [], None
        for _ in range(len(self.small)):
            b = self.small.pop(0)
            if self.freq[b] >= 1:
                self.freq[b] = 0
                self.main.append(b)
            elif self.blocks[b].ref_cnt or b in ids:
                skipped.append(b)
            else:
                h = self.blocks[b].block_hash
                if h is not None:
                    if h in self.ghost:
                        self.ghost.remove(h)
                    self.ghost.append(h)
                    while len(self.ghost) > self.ghost_cap:
                        self.ghost.pop(0)
                found = b
                break
        self.small[:0] = skipped
        return found

    def _main(self, ids: set[int]) -> int | None:
        skipped, found = [], None
        for _ in range(4 * len(self.main)):
            if not self.main:
                break
            b = self.main.pop(0)
            if self.freq[b]:
                self.freq[b] -= 1
                self.main.append(b)
            elif self.blocks[b].ref_cnt or b in ids:
                skipped.append(b)
            else:
                found = b
                break
        self.main[:0] = skipped
        return found

    def victims(self, n: int, protect: Collection[CpuBlock]) -> list[int]:
        out = self.take_empty(n, protect)
        ids = {b.block_id for b in protect}
        while len(out) < n:
            if len(self.small) >= self.small_target or not self.main:
                b = self._small(ids)
                if b is None:
                    b = self._main(ids)
            else:
                b = self._main(ids)
                if b is None:
                    b = self._small(ids)
            assert b is not None
            out.append(b)
        return out


class PrefixFreqModel(_Empty):
    def __init__(self, blocks: Sequence[CpuBlock]) -> None:
        super().__init__(blocks)
        self.uses = [0] * len(blocks)
        self.ranked: dict[int, tuple[float, int]] = {}
        self.inflation = 0.0
        self.seq = 0

    def on_touch(self, block: CpuBlock) -> None:
        b = block.block_id
        if block.block_hash is not None and self.uses[b]:
            self.uses[b] += 1
        if block.ref_cnt == 0:
            self.ranked.pop(b, None)
            self.untouch_empty(block)

    def on_free(self, blocks: Sequence[CpuBlock]) -> None:
        for x in blocks:
            b = x.block_id
            if b in self.ranked or b in self.empty:
                continue
            if x.block_hash is None:
                self.uses[b] = 0
                self.empty.append(b)
                continue
            self.uses[b] = self.uses[b] or 1
            self.seq += 1
            self.ranked[b] = (self.inflation + math.log2(1 + self.uses[b]), self.seq)

    def victims(self, n: int, protect: Collection[CpuBlock]) -> list[int]:
        out = self.take_empty(n, protect)
        ids = {b.block_id for b in protect}
        while len(out) < n:
            b = min((k for k in self.ranked if k not in ids), key=lambda k: self.ranked[k])
            self.inflation = self.ranked.pop(b)[0]
            self.uses[b] = 0
            out.append(b)
        return out


MODELS = {
    "lru": LruModel,
    "arc": ArcModel,
    "s3fifo": S3FifoModel,
    "prefix-freq": PrefixFreqModel,
}
