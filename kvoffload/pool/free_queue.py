"""An intrusive doubly linked LRU queue of free CPU blocks.

The links live in the blocks themselves, between two private sentinel nodes, so no Python
object is allocated by ``popleft``, ``append`` or ``remove`` and each is O(1). The head is
the least recently used end (evicted first); ``append`` adds at the most recently used end.
A block is in at most one queue at a time; its links are ``None`` while it is not queued.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import final

from kvoffload.errors import BlockStateError, InvalidInputError, InvariantError, OutOfBlocksError
from kvoffload.pool.block import BlockId, CpuBlock, QueueNode

__all__ = ["BlockId", "CpuBlock", "LruFreeQueue"]  # the first two from kvoffload.pool.block


class _Sentinel(QueueNode):
    """One of the two private ends of a queue; never a block."""

    __slots__ = ("_next", "_prev")

    def __init__(self) -> None:
        self._prev = None
        self._next = None


@final
class LruFreeQueue:
    """Free blocks in LRU order; every operation is O(1) per block.

    Args:
        blocks: initial contents, least recently used first.
    """

    __slots__ = ("_head", "_len", "_tail")

    def __init__(self, blocks: Iterable[CpuBlock] = ()) -> None:
        self._head = _Sentinel()
        self._tail = _Sentinel()
        self._head._next = self._tail
        self._tail._prev = self._head
        self._len = 0
        self.append_n(blocks)

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[CpuBlock]:
        return self.iter_after(None)

    def __repr__(self) -> str:
        return f"LruFreeQueue(len={self._len})"

    def iter_after(self, block: CpuBlock | None) -> Iterator[CpuBlock]:
        """Iterate from just after ``block`` (from the LRU end when ``None``) to the MRU end.

        Raises:
            BlockStateError: ``block`` is not queued.
        """
        if block is None:
            node = self._head._next
        else:
            if block._prev is None:
                raise BlockStateError(f"block {block.block_id} is not in the free queue")
            node = block._next
        tail = self._tail
        while node is not tail and node is not None:
            nxt = node._next
            yield node  # type: ignore[misc]  # every non-sentinel node is a CpuBlock
            node = nxt

    def popleft(self) -> CpuBlock:
        """Remove and return the least recently used block.

        Raises:
            OutOfBlocksError: the queue is empty.
        """
        first = self._head._next
        if first is self._tail or first is None:
            raise OutOfBlocksError(1, 0)
        nxt = first._next
        self._head._next = nxt
        nxt._prev = self._head  # type: ignore[union-attr]
        first._prev = first._next = None  # type: ignore[misc]
        self._len -= 1
        return first  # type: ignore[return-value]

    def popleft_n(self, n: int) -> list[CpuBlock]:
        """Remove and return the ``n`` least recently used blocks, LRU first.

        Raises:
            OutOfBlocksError: fewer than ``n`` blocks are queued.
            InvalidInputError: ``n`` is negative.
        """
        if n > self._len:
            raise OutOfBlocksError(n, self._len)
        if n <= 0:
            if n < 0:
                raise InvalidInputError(f"cannot pop a negative number of blocks: {n}")
            return []
        out: list[CpuBlock] = []
        append = out.append
        node = self._head._next
        for _ in range(n):
            nxt = node._next  # type: ignore[union-attr]
            node._prev = node._next = None  # type: ignore[union-attr]
            append(node)  # type: ignore[arg-type]
            node = nxt
        self._head._next = node
        node._prev = self._head  # type: ignore[union-attr]
        self._len -= n
        return out

    def append(self, block: CpuBlock) -> None:
        """Add ``block`` at the most recently used end.

        Raises:
            BlockStateError: ``block`` is already queued.
        """
        if block._prev is not None:
            raise BlockStateError(f"block {block.block_id} is already in the free queue")
        tail = self._tail
        last = tail._prev
        last._next = block  # type: ignore[union-attr]
        block._prev = last
        block._next = tail
        tail._prev = block
        self._len += 1

    def append_n(self, blocks: Iterable[CpuBlock]) -> None:
        """Append ``blocks`` in order; the first one given becomes the least recently used.

        Raises:
            BlockStateError: a block is already queued (the blocks before it stay appended).
        """
        tail = self._tail
        last = tail._prev
        count = 0
        try:
            for block in blocks:
                if block._prev is not None:
                    raise BlockStateError(f"block {block.block_id} is already in the free queue")
                last._next = block  # type: ignore[union-attr]
                block._prev = last
                last = block
                count += 1
        finally:
            last._next = tail  # type: ignore[union-attr]
            tail._prev = last
            self._len += count

    def remove(self, block: CpuBlock) -> None:
        """Unlink ``block`` from wherever it is in the queue.

        Raises:
            BlockStateError: ``block`` is not queued.
        """
        prev = block._prev
        if prev is None:
            raise BlockStateError(f"block {block.block_id} is not in the free queue")
        nxt = block._next
        prev._next = nxt  # type: ignore[misc]
        nxt._prev = prev  # type: ignore[union-attr]
        block._prev = block._next = None
        self._len -= 1

    def check(self) -> list[CpuBlock]:
        """Walk the list, checking every link; return the queued blocks in order.

        Raises:
            kvoffload.errors.InvariantError: a broken link, a cycle or a wrong length.
        """
        out: list[CpuBlock] = []
        seen: set[int] = set()
        prev: QueueNode = self._head
        node = self._head._next
        while node is not self._tail:
            if node is None or node._prev is not prev:
                raise InvariantError(f"free queue link broken after {len(out)} block(s)")
            if id(node) in seen:
                raise InvariantError("free queue has a cycle")
            seen.add(id(node))
            out.append(node)  # type: ignore[arg-type]
            prev = node
            node = node._next
        if self._tail._prev is not prev:
            raise InvariantError("free queue tail link broken")
        if len(out) != self._len:
            raise InvariantError(f"free queue holds {len(out)} blocks but counts {self._len}")
        return out
