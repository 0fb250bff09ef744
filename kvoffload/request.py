"""`OffloadRequest`: one request's handle on a `KVOffloader`.

An engine gets one from `KVOffloader.request()` when it admits a request and keeps it until
the request ends. The handle owns what every engine would otherwise rewrite around the
low-level calls (`KVOffloader.lookup`, `load`, `update`, `finish`, `preempt`,
`release`), and calls exactly those:

- the request's tokens and the chained hashes of its full blocks, computed incrementally:
  the prompt's blocks when the handle is made, then each block that `extend()` fills
  with generated tokens, chained from the previous block's hash;
- which of those hashes may be reported: `advance()` passes ``update`` the hashes of the
  blocks that are full *and* computed, never a stale prompt-only list;
- the lookup's hit, for `load()`;
- the end of the request: leaving ``with off.request(...) as req:`` finishes it, also on
  an exception or a cancellation, so no lookup pin or request state outlives it.

Block-table arithmetic lives here too: `blocks_for()`, `blocks_needed()`, `table_slice()`
(written in ``request_tables.py``); the handle's input checks are ``request_checks.py``'s.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Hashable, Iterator, Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, Protocol, final, overload

from kvoffload.errors import (
    ClosedError,
    InvalidInputError,
    PinnerError,
    RequestStateError,
)
from kvoffload.hashing import BlockHash, BlockHasher, check_token_sequence
from kvoffload.pool.hints import check_retain_for_s
from kvoffload.pool.retention import check_owner
from kvoffload.request_checks import as_int, check_prefix, computed_past_tokens
from kvoffload.request_tables import BlockTableArithmetic, blocks_for, table_slice
from kvoffload.transfer.task import _NoPublicConstructor

if TYPE_CHECKING:
    from kvoffload.request_groups import GroupLanes
    from kvoffload.scheduler.misses import MissReason
    from kvoffload.transfer.task import TransferTask

__all__ = [
    "HandleState",
    "OffloadRequest",
    "ReadOnlyList",
    "blocks_for",
    "hash_new_blocks",
    "table_slice",
]


class _StepCalls(Protocol):
    """The `KVOffloader` calls a handle makes, and all it needs of the offloader: every
    call of the handle goes to it, for one KV cache group and several alike."""

    def lookup(
        self,
        request_id: str,
        block_hashes: Sequence[BlockHash] | Mapping[str, Sequence[BlockHash]],
        num_tokens: int,
        num_computed_tokens: int,
        *,
        allow_defer: bool,
    ) -> int | None: ...

    def _lookup_outcome(self, request_id: str) -> tuple[MissReason, dict[str, int]]: ...

    def load(
        self,
        request_id: str,
        gpu_block_ids: Sequence[int] | Mapping[str, Sequence[int | None]],
        num_tokens: int,
    ) -> TransferTask | None: ...

    def update(
        self,
        request_id: str,
        gpu_block_ids: Sequence[int] | Mapping[str, Sequence[int | None]],
        block_hashes: Sequence[BlockHash] | Mapping[str, Sequence[BlockHash]],
        num_computed_tokens: int,
    ) -> None: ...

    def release(self, request_id: str) -> None: ...

    def abandon_load(self, request_id: str) -> tuple[int, ...] | dict[str, tuple[int, ...]]: ...

    def preempt(self, request_id: str) -> None: ...

    def finish(self, request_id: str) -> None: ...

    @property
    def hints(self) -> _Hints: ...


class _Hints(Protocol):
    def retain_hashes_for(
        self,
        block_hashes: Sequence[BlockHash] | Mapping[str, Sequence[BlockHash]],
        retain_for_s: float,
        session: Hashable,
    ) -> int: ...


def hash_new_blocks(
    block_hashes: list[BlockHash], token_ids: Sequence[int], block_size: int, root: BlockHash
) -> None:
    """Append the hashes of the blocks of ``token_ids`` that filled up since the last call.

    ``block_hashes`` holds the hashes of the first full blocks of ``token_ids`` (none at
    first); each new full block is hashed once, chained from the previous block's hash
    (``root`` for the first block), by a `BlockHasher` (which keeps this state itself).
    The tokens after the last full block are not looked at.

    Raises:
        InputTypeError: a token of a new full block is not a 64-bit int; nothing is
            appended then (also a ``TypeError`` and a ``ValueError``).
    """
    done = len(block_hashes) * block_size
    if len(token_ids) < done + block_size:
        return  # no block filled up (the common decode step)
    hasher = BlockHasher(block_hashes[-1] if block_hashes else root, block_size)
    hasher.extend(token_ids[done : len(token_ids) // block_size * block_size])
    block_hashes.extend(hasher.block_hashes)


class HandleState(enum.Enum):
    """The lifecycle of an `OffloadRequest`: ``LIVE`` from `KVOffloader.request()` until
    `OffloadRequest.finish()` (or leaving ``with``), then ``FINISHED`` for good.

    A live handle holds its request id (no second handle gets it); a finished one takes no
    call: every step-loop call on it raises `RequestStateError`.
    """

    LIVE = "live"
    FINISHED = "finished"

    def to(self, target: HandleState, request_id: str) -> HandleState:
        """Move to ``target``.

        Raises:
            RequestStateError: the move is not allowed from this state (the message names
                the request and both states).
        """
        if target not in _HANDLE_MOVES[self]:
            raise RequestStateError(
                f"request {request_id!r} is {self.value}: it cannot become {target.value}"
                + (" again (finish() ends a request once)" if self is target else "")
            )
        return target

    def check(self, call: str, request_id: str) -> None:
        """Refuse ``call`` unless the handle is live.

        Raises:
            RequestStateError: the handle is finished (the message names the request, its
                state and the call).
        """
        if self is not HandleState.LIVE:
            raise RequestStateError(
                f"request {request_id!r} is already {self.value}: {call}() is refused (a "
                "finished handle takes no call; request ids are not reused)"
            )


_HANDLE_MOVES: dict[HandleState, frozenset[HandleState]] = {
    HandleState.LIVE: frozenset({HandleState.FINISHED}),
    HandleState.FINISHED: frozenset(),
}


@final
class ReadOnlyList(Sequence[Any]):
    """A read-only view of a list that grows (no copy is made)."""

    __slots__ = ("_items",)

    def __init__(self, items: Sequence[Any]) -> None:
        self._items = items

    @overload
    def __getitem__(self, index: int) -> Any: ...

    @overload
    def __getitem__(self, index: slice) -> list[Any]: ...

    def __getitem__(self, index: int | slice) -> Any:
        return self._items[index]

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Any]:
        return iter(self._items)

    def __repr__(self) -> str:
        return f"ReadOnlyList({self._items!r})"


@final
class OffloadRequest(BlockTableArithmetic, metaclass=_NoPublicConstructor):
    """One request's handle on a `KVOffloader`; made by `KVOffloader.request()`.

    Use it as a context manager: leaving the ``with`` block finishes the request (releasing
    a lookup pin the engine did not load), whatever ends the block. A typical step loop::

        with off.request(rid, prompt) as req:
            hit = req.lookup()
            table = allocate(req.blocks_for(req.num_tokens))
            if hit and (task := req.load(table)) is not None:
                await task
            done = hit
            while not finished:
                done = compute(table, req.token_ids, done)  # one step
                req.advance(table, done)
                off.store()
                req.extend([next_token])

    The handle holds its request id from the moment it is made (a second handle for the id
    is refused) until it finishes, and has one lifecycle, `HandleState`: every call on a
    finished handle raises `RequestStateError`.

    The handle is not thread-safe; use it from the thread that drives the offloader.
    """

    __slots__ = (
        "_block_size",
        "_engine_prefix",
        "_hasher",
        "_hashes",
        "_hit",
        "_lanes",
        "_miss",
        "_num_computed",
        "_off",
        "_reported",
        "_request_id",
        "_state",
        "_tier_hits",
        "_tokens",
        "_who",
    )

    def __init__(
        self,
        offloader: _StepCalls,
        request_id: str,
        prompt_token_ids: Sequence[int],
        num_computed_tokens: int,
        *,
        block_size: int,
        root: BlockHash,
        lanes: GroupLanes | None = None,
    ) -> None:
        who = f"request {request_id!r}: "
        check_token_sequence(prompt_token_ids, "prompt_token_ids", request_id)
        num_computed_tokens = check_prefix(
            num_computed_tokens, len(prompt_token_ids), block_size, request_id
        )
        self._off = offloader
        self._request_id = request_id
        self._who = who
        self._block_size = block_size
        self._tokens: list[int] = []
        # With several groups (``lanes``), the first group's hasher is this one.
        self._lanes = lanes
        self._hasher = lanes.first_hasher if lanes else BlockHasher(root, block_size)
        self._hashes = self._hasher.block_hashes  # the hasher's own list, bound once
        self._engine_prefix = num_computed_tokens
        self._num_computed = num_computed_tokens
        self._hit = 0
        self._miss: MissReason | None = None
        self._tier_hits: dict[str, int] = {}
        self._reported = 0  # hashes given to update so far
        self._state = HandleState.LIVE
        self.extend(prompt_token_ids)

    def __repr__(self) -> str:
        return (
            f"OffloadRequest({self._request_id!r}, {self._state.value}, "
            f"tokens={len(self._tokens)}, computed={self._num_computed}, hit={self._hit})"
        )

    # -- context manager ---------------------------------------------------------------------

    def __enter__(self) -> OffloadRequest:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._state is HandleState.FINISHED:
            return
        # ClosedError: the offloader closed first and dropped every request's references.
        with contextlib.suppress(ClosedError):
            self.finish()

    # -- tokens and hashes -------------------------------------------------------------------

    def extend(self, token_ids: Sequence[int]) -> None:
        """Append tokens (generated ones, or more prompt) and hash each block they fill.

        Each new full block is hashed once, chained from the previous block's hash.

        Raises:
            RequestStateError: the request is finished.
            InputTypeError: a token is not a 64-bit int (nothing is appended then; also a
                ``TypeError`` and a ``ValueError``).
        """
        self._state.check("extend", self._request_id)
        try:  # the hasher checks every token before it changes anything
            (self._lanes or self._hasher).extend(token_ids)
        except InvalidInputError as exc:
            raise type(exc)(f"{self._who}{exc}") from None
        self._tokens.extend(token_ids)

    @property
    def request_id(self) -> str:
        """The engine's id for the request."""
        return self._request_id

    @property
    def block_size(self) -> int:
        """Tokens per block."""
        return self._block_size

    @property
    def token_ids(self) -> Sequence[int]:
        """Every token so far, prompt and generated (read-only)."""
        return ReadOnlyList(self._tokens)

    @property
    def block_hashes(self) -> Sequence[BlockHash]:
        """The chained hashes of the full blocks so far (read-only; with several groups,
        the first cacheable group's, in its namespace)."""
        return ReadOnlyList(self._hashes)

    @property
    def num_tokens(self) -> int:
        """Tokens so far, prompt and generated."""
        return len(self._tokens)

    @property
    def num_full_blocks(self) -> int:
        """Full blocks so far (those that have a hash)."""
        return len(self._hashes)

    @property
    def num_computed_tokens(self) -> int:
        """Tokens with KV, as last given to `advance()` (at least the engine's prefix)."""
        return self._num_computed

    @property
    def hit_tokens(self) -> int:
        """Tokens the last `lookup()` found on the CPU (0 before a lookup)."""
        return self._hit

    @property
    def miss_reason(self) -> MissReason | None:
        """Why the last `lookup()`'s hit stopped where it did (``None`` before a lookup):
        a `MissReason` (``NONE`` when nothing was missed); docs/misses.md."""
        return self._miss

    @property
    def tier_hit_tokens(self) -> Mapping[str, int]:
        """Of the last `lookup()`'s hit, the tokens a secondary tier (by its name)
        promoted into the CPU pool for it, after an earlier lookup of it answered "ask
        again" or a prefetch brought them; the rest of `hit_tokens` was in the CPU pool
        already (`KVOffloader.tier_hit_tokens()`: with several KV cache groups, per tier
        the most any one group's blocks of the hit came from it). Empty without tiers
        and before a lookup.
        """
        return self._tier_hits

    @property
    def finished(self) -> bool:
        """Whether the request is finished: `finish()` was called (also when it raised
        `PinnerError` or `ClosedError`), or the ``with`` block was left."""
        return self._state is HandleState.FINISHED

    @property
    def state(self) -> HandleState:
        """The handle's lifecycle state."""
        return self._state

    # -- the step loop ------------------------------------------------------------------------

    @overload
    def lookup(
        self, *, num_computed_tokens: int | None = None, allow_defer: Literal[False] = False
    ) -> int: ...

    @overload
    def lookup(
        self, *, num_computed_tokens: int | None = None, allow_defer: bool
    ) -> int | None: ...

    def lookup(
        self, *, num_computed_tokens: int | None = None, allow_defer: bool = False
    ) -> int | None:
        """Tokens of the request loadable from CPU past the engine's own prefix; pins them.

        Args:
            num_computed_tokens: tokens the engine's own prefix cache holds (a multiple of
                the block size; default: the value the handle was made with).
            allow_defer: may answer ``None``, "ask again later" (when: see
                `OffloadScheduler.lookup()`).

        Returns:
            The hit in tokens (see `KVOffloader.lookup()`), or ``None`` as above.

        Raises:
            RequestStateError: the request is finished.
            InvalidInputError: ``num_computed_tokens`` out of range or not block aligned;
                the handle keeps the prefix it had (a refused call changes nothing).
            InputTypeError: ``num_computed_tokens`` is not an int (a float, a bool).
        """
        rid = self._request_id
        self._state.check("lookup", rid)
        prefix = (
            self._engine_prefix
            if num_computed_tokens is None
            else as_int(num_computed_tokens, "num_computed_tokens", rid)
        )
        off, lanes = self._off, self._lanes
        hashes = self._hashes if lanes is None else lanes.hashes()
        hit = off.lookup(rid, hashes, len(self._tokens), prefix, allow_defer=allow_defer)
        self._miss, self._tier_hits = off._lookup_outcome(rid)
        self._engine_prefix = prefix
        self._hit = hit or 0
        self._num_computed = max(self._num_computed, prefix)
        return hit

    def load(
        self,
        block_table: Sequence[int] | Mapping[str, Sequence[int | None]],
        num_tokens: int | None = None,
    ) -> TransferTask | None:
        """Start loading the last lookup's hit into the request's blocks.

        Args:
            block_table: the request's whole block table (block ``i`` of the request in
                entry ``i``; the hit lands after the engine's prefix); with several KV
                cache groups, one table per group name (``None`` for blocks not held).
            num_tokens: load only this many of the hit's tokens (whole blocks; with several
                KV cache groups, a multiple of the hit alignment, and only when every
                cacheable group is full attention: `GroupedScheduler.plan_load()`); the rest
                of the pin is released. Default: the whole hit.

        Returns:
            The transfer (compute on the loaded tokens must wait for it), or ``None`` when
            there is nothing to load.

        Raises:
            RequestStateError: the request is finished.
            InvalidInputError: ``num_tokens`` above the hit or not whole blocks.
            InputTypeError: ``num_tokens`` is not an int (a float, a bool).
            BlockTableError: a table too short or malformed.
        """
        self._state.check("load", self._request_id)
        n = self._hit if num_tokens is None else as_int(num_tokens, "num_tokens", self._request_id)
        task = self._off.load(self._request_id, block_table, n)
        self._hit = n
        return task

    def advance(
        self,
        block_table: Sequence[int] | Mapping[str, Sequence[int | None]],
        num_computed_tokens: int,
    ) -> None:
        """Report a step: the table (per group name, with several KV cache groups) and how
        many tokens now have KV.

        Calls `KVOffloader.update()` with the hashes of the blocks that are full and
        computed, so each such block may be stored by the next `KVOffloader.store()` (after
        a preemption, also those reported before it, which the scheduler keeps; it stores
        only blocks below ``num_computed_tokens``).

        Raises:
            RequestStateError: the request is finished.
            InvalidInputError: ``num_computed_tokens`` above `num_tokens`.
            InputTypeError: ``num_computed_tokens`` is not an int (a float, a bool).
            BlockTableError: a table that shrank or changed.
        """
        self._state.check("advance", self._request_id)
        num_computed_tokens = as_int(num_computed_tokens, "num_computed_tokens", self._request_id)
        if num_computed_tokens > len(self._tokens):
            raise computed_past_tokens(num_computed_tokens, len(self._tokens), self._who)
        lanes = self._lanes
        if lanes is not None:
            tables, per_group = lanes.step(block_table, num_computed_tokens)
            self._off.update(self._request_id, tables, per_group, num_computed_tokens)
            lanes.reported(per_group)
            self._num_computed = num_computed_tokens
            return
        hashes = self._hashes
        n = num_computed_tokens // self._block_size
        if n < self._reported:  # noqa: PLR1730 - cheaper than max() on the per-step path
            # After a preemption the scheduler keeps the hashes reported before; they are
            # passed again (it stores only blocks below num_computed_tokens either way).
            n = self._reported
        if n < len(hashes):
            hashes = hashes[:n]  # the last full block is not computed yet
        self._off.update(self._request_id, block_table, hashes, num_computed_tokens)
        self._reported = len(hashes)
        self._num_computed = num_computed_tokens

    def release(self) -> None:
        """Drop the last lookup's pin without loading it (the engine will not take it).

        Raises:
            RequestStateError: the request is finished.
        """
        self._state.check("release", self._request_id)
        self._off.release(self._request_id)
        self._hit = 0

    def abandon_load(self) -> tuple[int, ...] | dict[str, tuple[int, ...]]:
        """Stop waiting for the request's load in flight (its deadline passed, the client
        is gone) and recompute those tokens instead.

        The load's task resolves now: awaiting it raises `LoadAbandonedError`. The copy
        itself cannot be stopped and runs on, but nothing it lands is used: its CPU
        blocks keep their reference and its GPU blocks stay pinned through the
        `GpuBlockPinner` until it has ended (``RefCountPinner(on_release=...)`` says
        when), and it publishes nothing. The lookup pin is released; `hit_tokens` is 0.
        Recompute the tokens into other GPU blocks, or into the returned ones once the
        pinner released them; `advance()` may then report a table with other blocks
        from the load's first block on. Without a load in flight it only releases the
        pin.

        With several KV cache groups every group's part of the load is abandoned at
        once (the hit was one prefix for every group), and each group's table may
        change from that group's first loaded block on.

        Returns:
            The GPU blocks the abandoned copy still writes: never hand them to any
            computation until the pinner releases them. With several KV cache groups,
            one tuple per group name that had blocks to load (each group's pinner
            releases its own).

        Raises:
            RequestStateError: the request is finished.
        """
        self._state.check("abandon_load", self._request_id)
        blocks = self._off.abandon_load(self._request_id)
        self._hit = 0
        return blocks

    def preempt(self) -> None:
        """The engine freed the request's GPU blocks; it will be re-admitted later.

        The tokens and hashes are kept. To resume, call `lookup()` again (with the engine's
        new prefix), allocate a fresh table, `load()` and compute from there.

        Raises:
            RequestStateError: the request is finished.
        """
        self._state.check("preempt", self._request_id)
        self._off.preempt(self._request_id)
        self._hit = 0
        self._engine_prefix = 0
        self._num_computed = 0

    def finish(self, *, retain_for_s: float | None = None, session: Hashable = None) -> None:
        """End the request: nothing more is stored for it, its lookup pin is released and
        its id is given up (ids are never reused).

        With ``retain_for_s`` (a session hint, docs/hints.md), the request's full blocks,
        prompt and generated, are then retained for that many seconds for ``session``
        (default: the request id), as `SessionHints.retain_for()` does: an agent pausing
        for a tool call finds its context again. A bad hint is refused before anything
        changes.

        Its stores in flight complete on their own. Idempotent only through the context
        manager; a second call raises.

        When it raises `PinnerError` (the pinner failed on an earlier transfer, or while
        pinning the blocks held on finish) or `ClosedError` (the offloader closed and let
        go of every request), the request is finished all the same, with nothing left
        behind: do not call it again. Any other error (`WrongContextError`) changed
        nothing: the handle stays live and the call may be repeated.

        Raises:
            RequestStateError: already finished (also through `KVOffloader.finish()`).
            PinnerError: see above; the request is finished.
            ClosedError: see above; the request is finished.
            InvalidInputError: a bad ``retain_for_s``; nothing changed.
            InputTypeError: ``session`` is not hashable; nothing changed.
        """
        self._state.check("finish", self._request_id)
        if retain_for_s is not None:
            retain_for_s = check_retain_for_s(retain_for_s, self._who)
            session = self._request_id if session is None else session
            check_owner(session, "session")
        try:
            self._off.finish(self._request_id)
        except (PinnerError, ClosedError, RequestStateError):
            # Finished all the same (a RequestStateError: someone finished the id through
            # KVOffloader.finish() behind the handle's back).
            self._state = self._state.to(HandleState.FINISHED, self._request_id)
            raise
        self._state = self._state.to(HandleState.FINISHED, self._request_id)
        if retain_for_s is not None:
            hashes = self._hashes if self._lanes is None else self._lanes.hashes()
            self._off.hints.retain_hashes_for(hashes, retain_for_s, session)
