"""`SlotIndex`: which block is in which slot of a disk tier's file, on the event loop.

It owns the hash → slot map in LRU order, the free slots (a stack: the last freed goes
first, so free slots are handed out in runs), the slots being read (a slot read from is
never reused until the read ends: it is *doomed* and freed then) and the blocks being
written (indexed only once their write ended). It does no I/O.
"""

from __future__ import annotations

import operator
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import final

from kvoffload.hashing import BlockHash
from kvoffload.tiers.base import BlockWrite

__all__ = ["SlotIndex"]

_slot_of = operator.itemgetter(1)


@final
class SlotIndex:
    """The slots of one file: held, free, being read and being written.

    Args:
        num_slots: slots in the file.
    """

    __slots__ = ("doomed", "free", "index", "num_slots", "readers", "writing")

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.index: OrderedDict[BlockHash, int] = OrderedDict()
        self.free: list[int] = []  # a stack: the last freed goes first
        self.readers: dict[int, int] = {}
        self.doomed: set[int] = set()
        self.writing: set[BlockHash] = set()

    def __len__(self) -> int:
        return len(self.index)

    def reset(
        self, entries: Iterable[tuple[BlockHash, int]] = (), free: list[int] | None = None
    ) -> None:
        """Start over with ``entries`` held (oldest first) and ``free`` as the free stack
        (default: every slot, the lowest on top)."""
        self.index.clear()
        self.index.update(entries)
        self.readers.clear()
        self.doomed.clear()
        self.free = list(range(self.num_slots - 1, -1, -1)) if free is None else free

    def busy(self) -> bool:
        """Whether a read or a write is under way."""
        return bool(self.writing) or any(self.readers.values())

    def leading(self, block_hashes: Sequence[BlockHash]) -> int:
        """Length of the leading run of ``block_hashes`` that is held."""
        index = self.index
        n = 0
        for block_hash in block_hashes:
            if block_hash not in index:
                break
            n += 1
        return n

    def claim(
        self, blocks: Sequence[BlockWrite], nbytes: int, name: str
    ) -> tuple[int, list[tuple[BlockWrite, int]]]:
        """Give each block not held a slot to be written into: ``(held, jobs)``.

        A block already held is only touched in the LRU order and counted in ``held``; one
        being written, or one no slot can take (every slot is being read), is skipped.
        ``jobs`` pairs each block to write with its slot, sorted by slot; `settle()` must
        follow.

        Raises:
            ValueError: a payload is not ``nbytes`` long (nothing is claimed).
        """
        for block in blocks:
            if len(block.payload) != nbytes:
                raise ValueError(
                    f"disk tier {name!r}: payload of {len(block.payload)} bytes, a block "
                    f"has {nbytes}"
                )
        held = 0
        jobs: list[tuple[BlockWrite, int]] = []
        index, writing, free = self.index, self.writing, self.free
        for block in blocks:
            block_hash = block.block_hash
            if block_hash in index:
                index.move_to_end(block_hash)
                held += 1
                continue
            if block_hash in writing:
                continue
            slot = free.pop() if free else self._evict()
            if slot is None:
                continue
            writing.add(block_hash)
            jobs.append((block, slot))
        jobs.sort(key=_slot_of)  # consecutive slots go in one pwritev
        return held, jobs

    def settle(self, jobs: Sequence[tuple[BlockWrite, int]], written: int) -> None:
        """After the write of `claim()`'s ``jobs``: index the first ``written``, free the
        slots of the rest."""
        self.writing.difference_update([block.block_hash for block, _ in jobs])
        self.index.update((block.block_hash, slot) for block, slot in jobs[:written])
        for _, slot in jobs[written:]:
            self.release(slot)

    def pin(
        self, block_hashes: Sequence[BlockHash], into: Sequence[memoryview], nbytes: int
    ) -> list[tuple[int, int]]:
        """Mark the held blocks of ``block_hashes`` as being read: ``(position, slot)`` of
        each, sorted by slot; `unpin()` must follow.

        Raises:
            ValueError: a buffer of a held block has fewer than ``nbytes`` bytes.
        """
        index, readers = self.index, self.readers
        jobs: list[tuple[int, int]] = []
        for i, block_hash in enumerate(block_hashes):
            slot = index.get(block_hash)
            if slot is None:
                continue
            if len(into[i]) < nbytes:
                raise ValueError(f"buffer {i} holds {len(into[i])} bytes, a block has more")
            index.move_to_end(block_hash)
            readers[slot] = readers.get(slot, 0) + 1
            jobs.append((i, slot))
        jobs.sort(key=_slot_of)  # consecutive slots come in one preadv
        return jobs

    def unpin(self, jobs: Sequence[tuple[int, int]]) -> None:
        """End the reads `pin()` started; a slot dropped meanwhile is freed now."""
        readers, doomed = self.readers, self.doomed
        for _, slot in jobs:
            left = readers[slot] - 1
            if left:
                readers[slot] = left
            else:
                del readers[slot]
                if slot in doomed:
                    doomed.discard(slot)
                    self.free.append(slot)

    def drop(self, block_hashes: Iterable[BlockHash]) -> None:
        """Forget blocks; their slots are reused once no read holds them."""
        index = self.index
        for block_hash in block_hashes:
            slot = index.pop(block_hash, None)
            if slot is not None:
                self.release(slot)

    def release(self, slot: int) -> None:
        """Free ``slot``, or once its reads end."""
        if self.readers.get(slot):
            self.doomed.add(slot)
        else:
            self.free.append(slot)

    def _evict(self) -> int | None:
        """The least recently used slot no read holds, taken from its block; ``None``."""
        readers = self.readers
        for block_hash, slot in self.index.items():
            if not readers.get(slot):
                del self.index[block_hash]
                return slot
        return None
