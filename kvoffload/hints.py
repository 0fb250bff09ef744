"""`SessionHints`: what an application tells a `KVOffloader` about the requests to come.

Agent workloads pause for tool calls and come back to the same, longer context. Three
hints (with several KV cache groups each retained prefix is exactly what a lookup of it
needs in every group, `GroupedScheduler.retain()`; ``prefetch`` what a lookup of it
needs, `GroupTiers.prefetch()`):

- **retain for a pause** (`SessionHints.retain_for()`, or ``retain_for_s`` on
  `KVOffloader.request()` / `OffloadRequest.finish()`): keep a prefix from eviction for a
  while, within ``max_retained_fraction``; it ends by itself (`RetentionHints`);
- **release** (`SessionHints.release()`): end a session's hint early;
- **prefetch** (`SessionHints.prefetch()`): promote a prefix from the secondary tiers
  into the CPU pool ahead of the request that needs it.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar, final

if TYPE_CHECKING:
    from kvoffload.pool.hints import RetentionHints

__all__ = ["SessionHints"]

P = TypeVar("P")
"""A hashed prompt: one group's block hashes, or one list per KV cache group."""


class _Retention(Protocol[P]):
    """What the hints call: the offloader's `Session` (one KV cache group or several)."""

    @property
    def hints(self) -> RetentionHints[P]: ...
    def hash_prompt(self, token_ids: Sequence[int]) -> P: ...
    def retain(self, block_hashes: P, owner: Hashable) -> int: ...
    def release_retained(self, owner: Hashable) -> int: ...
    def retain_for(self, block_hashes: P, retain_for_s: float, session: Hashable) -> int: ...
    def release_hint(self, session: Hashable) -> int: ...
    async def prefetch(self, block_hashes: P, num_tokens: int) -> int: ...


@final
class SessionHints(Generic[P]):
    """The session hints of one `KVOffloader` (``off.hints``), for one KV cache group
    or several.

    Every call is a step-loop call: on the event loop's thread, while the offloader is
    open (else `ClosedError`, `WrongContextError`).
    """

    __slots__ = ("_session",)

    def __init__(self, session: _Retention[P]) -> None:
        self._session = session

    def retain_prefix(self, token_ids: Sequence[int], *, owner: Hashable) -> int:
        """Keep the leading run of a prompt's full blocks that is stored in the CPU pool
        now (a system prompt) from eviction until `release_retained(owner)` or
        `KVOffloader.reset()`; return how many blocks that is. A block not stored yet, and
        every one after it, is not retained (store, then call again); docs/policies.md,
        "Retention priorities". Also `KVOffloader.retain_prefix()`.

        With several KV cache groups, every group retains exactly the blocks a lookup of
        the longest prefix the groups hold needs (a sliding window's blocks, a recurrent
        state), each pool within its own bound; the count is all groups' blocks.

        Raises:
            InvalidInputError: over ``max_retained_fraction`` (of any group's pool;
                nothing is retained in any group).
            InputTypeError: ``token_ids`` not a sequence of ints, ``owner`` not hashable.
        """
        return self._session.retain(self._session.hash_prompt(token_ids), owner)

    def release_retained(self, owner: Hashable) -> int:
        """Let the blocks `retain_prefix()` kept for ``owner`` be evicted again; return
        how many (also `KVOffloader.release_retained()`). Raises `InvalidInputError` if
        ``owner`` retains nothing."""
        return self._session.release_retained(owner)

    def retain_for(
        self, token_ids: Sequence[int], retain_for_s: float, *, session: Hashable
    ) -> int:
        """Keep the leading run of the prompt's full blocks stored in the CPU pool from
        eviction for ``retain_for_s`` seconds (an agent's tool call), then let them go by
        themselves; return how many blocks are retained now.

        Blocks whose stores are still in flight are retained once stored (at a later
        `KVOffloader.store()`). A hint is best effort within ``max_retained_fraction``,
        shared with `KVOffloader.retain_prefix()`: the part over the bound is not
        retained, nothing is refused. A later hint of the same ``session`` replaces this
        one; `release()` ends it early. Expiry is lazy, on `clock`: at
        the next `KVOffloader.store()`, `retain_for()` or `release()` after the deadline.

        Raises:
            InvalidInputError: ``retain_for_s`` not a number of seconds in (0, one year];
                nothing is retained then.
            InputTypeError: ``token_ids`` not a sequence of ints, ``session`` not hashable.
        """
        hashes = self._session.hash_prompt(token_ids)
        return self._session.retain_for(hashes, retain_for_s, session)

    def retain_hashes_for(self, block_hashes: P, retain_for_s: float, session: Hashable) -> int:
        """`retain_for()` of hashes already made (what `OffloadRequest.finish()` calls)."""
        return self._session.retain_for(block_hashes, retain_for_s, session)

    def release(self, session: Hashable) -> int:
        """End ``session``'s hint early: its blocks may be evicted again. Return how many
        blocks it retained (0 when it has no live hint: expired, released, never given).

        Raises:
            InputTypeError: ``session`` is not hashable.
        """
        return self._session.release_hint(session)

    async def prefetch(self, token_ids: Sequence[int]) -> int:
        """Promote the prompt's full blocks from the secondary tiers into the CPU pool
        ahead of the request that will need them (the next turn after a tool call), so
        that its lookup is a CPU hit; return how many leading full blocks of the prompt
        are in the CPU pool on return.

        Without tiers it returns at once with what the CPU pool holds. With several KV
        cache groups it returns the tokens (at most ``len(token_ids)``) a lookup of a
        prompt that extends ``token_ids`` finds on CPU on return, having asked every
        group's tiers at once for what that lookup needs (each pool within its own bound,
        `GroupTiers.prefetch()`): like one group's, it brings back the last full block
        of a prompt that ends on a block boundary, which the next turn reads. The blocks are
        taken like a lookup's promotion: free CPU blocks only, never one with a copy in
        flight, nor the prompt's blocks already cached, and all prefetches in flight
        together take at most ``max_prefetch_fraction`` of the pool (a prefetch past that
        promotes the part that fits). Blocks a store or a lookup's promotion is filling
        right now are left to it. Await it, or run it in a task and cancel it; to bound
        its time, wrap it in `anyio.fail_after`.

        Cancellation: what the prefetch was reading is published nothing, and every CPU
        block it took is released (blocks it published before stay cached).

        Raises:
            InputTypeError: ``token_ids`` not a sequence of ints.
        """
        hashes = self._session.hash_prompt(token_ids)
        # The request that comes extends these tokens: what a lookup of a prompt one
        # token longer needs (every full block; one group's ignores the count).
        return await self._session.prefetch(hashes, len(token_ids) + 1)

    def deadline(self, session: Hashable) -> float | None:
        """When ``session``'s hint ends on `clock` (``None``: no live hint,
        as of the last expiry)."""
        return self._session.hints.deadline(session)

    @property
    def clock(self) -> Callable[[], float]:
        """The clock hints are measured on, in seconds (`time.monotonic` unless set: a
        test or a simulation sets its own, before giving hints)."""
        return self._session.hints.clock

    @clock.setter
    def clock(self, clock: Callable[[], float]) -> None:
        self._session.hints.clock = clock

    @property
    def sessions(self) -> tuple[Hashable, ...]:
        """The sessions with a live hint (as of the last expiry)."""
        return self._session.hints.sessions
