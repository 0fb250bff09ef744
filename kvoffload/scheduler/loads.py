"""The rules of lookups and loads every lane shares: a lookup's counts
(`check_lookup_counts()`), a load's length (`check_load_tokens()`), the miss reasons of a
block, the `LookupExtension` protocol the tiers answer, and the bound on "ask again".

"Ask again" (``None``, with ``allow_defer``) is bounded: once a request has been answered
"ask again" `MAX_LOOKUP_DEFERRALS` times in a row, or for longer than the deferral
deadline (`DEFER_DEADLINE_S`, or the tiers' `LookupExtension.defer_deadline_s` when
longer), its lookup answers with what is on CPU (counted in ``deferrals_bounded``). A
promotion that never ends, or one that ends without the block every time, costs a shorter
hit, never a request that waits forever.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Protocol

from kvoffload._logging import get_logger
from kvoffload.errors import InvalidInputError
from kvoffload.hashing import BlockHash
from kvoffload.pool.free_queue import CpuBlock
from kvoffload.scheduler.ledger import BlockLedger
from kvoffload.scheduler.misses import MissReason
from kvoffload.transfer.plan import LoadPlan

__all__ = [
    "DEFER_DEADLINE_S",
    "MAX_LOOKUP_DEFERRALS",
    "LookupExtension",
    "abandon_loads",
    "block_miss_reason",
    "check_load_tokens",
    "check_lookup_counts",
    "deferral_deadline",
    "deferral_spent",
    "run_extend",
    "run_spent",
    "lookup_defers",
]

_log = get_logger("scheduler")

_NONE = MissReason.NONE
_NOT_READ = MissReason.NOT_READ
_IN_FLIGHT = MissReason.IN_FLIGHT

MAX_LOOKUP_DEFERRALS = 1 << 16
"""The most "ask again" answers in a row one request's lookups give: a backstop behind the
deadline, set high because an engine may ask on every step of a busy loop (1,024 answers
took well under the time a loaded machine's disk promotion needs, and cut it short)."""

DEFER_DEADLINE_S = 1.0
"""The longest one request's lookups answer "ask again" in a row (without tiers, or when
the tiers' own deadline is shorter): a store or load copy lands well within it."""


def deferral_spent(deferrals: int, elapsed: float, deadline: float) -> bool:
    """The bound on a request's run of "ask again" answers, one group or several: it is
    spent after `MAX_LOOKUP_DEFERRALS` of them in a row, or once ``elapsed`` seconds since
    the first reach ``deadline``; the next lookup then answers with what is on CPU."""
    return deferrals >= MAX_LOOKUP_DEFERRALS or elapsed >= deadline


class DeferralRun(Protocol):
    """A request's run of "ask again" answers (one group's request state or several's)."""

    deferrals: int
    deferred_since: float


def run_spent(
    state: DeferralRun, deferrals: int, clock: Callable[[], float], below_s: float | None
) -> bool:
    """Whether ``state``'s run of ``deferrals`` "ask again" answers reached its bound
    (`deferral_spent()` against `deferral_deadline()`), one group or several."""
    return deferral_spent(deferrals, clock() - state.deferred_since, deferral_deadline(below_s))


def run_extend(state: DeferralRun, deferrals: int, clock: Callable[[], float]) -> None:
    """Answer "ask again": one more in ``state``'s run of them (the first dates it)."""
    state.deferrals = deferrals + 1
    if not deferrals:
        state.deferred_since = clock()


def deferral_deadline(below_s: float | None) -> float:
    """The deadline of a request's run of "ask again" answers, one group or several:
    `DEFER_DEADLINE_S`, or ``below_s`` (the tiers' `LookupExtension.defer_deadline_s`;
    ``None`` without tiers) when longer."""
    return DEFER_DEADLINE_S if below_s is None else max(DEFER_DEADLINE_S, below_s)


def lookup_defers(
    ledger: BlockLedger,
    next_hashes: Sequence[BlockHash],
    hits: Sequence[CpuBlock],
    promoting: Callable[[BlockHash], bool] | None = None,
) -> bool:
    """The rule of ``lookup(allow_defer=True)``, for one pool: whether a lookup whose hit
    is the blocks ``hits`` should answer "ask again later".

    Yes when a block of the hit is being loaded for another request (its GPU copy will
    serve this one), or when the blocks the next longer hit lacks, ``next_hashes``, are
    there and every one is being filled: stored or promoted into the pool (in the
    ledger's pending hashes), or, with ``promoting``, named by a promotion that is still
    probing its tier (the longer hit is there once they land). One group asks its tiers
    after this (`LookupExtension.extend_lookup()` answers for the promotion it starts);
    with several KV cache groups each group's pool is asked, with that group's tiers as
    ``promoting``, and the lookup defers when any says yes (`GroupedScheduler.lookup()`).
    """
    loading = ledger.loading
    if loading and any(b.block_id in loading for b in hits):
        return True
    if not next_hashes:
        return False
    pending = ledger.pending
    if promoting is None:
        return all(h in pending for h in next_hashes)
    return all(h in pending or promoting(h) for h in next_hashes)


def abandon_loads(
    ledger: BlockLedger, rid: str, plan_ids: Iterable[int], starts: Mapping[int, int]
) -> tuple[list[LoadPlan], int | None]:
    """The rule of ``abandon_load()`` for one pool, one group or each of several: every
    load plan of request ``rid`` in flight (the ids of ``plan_ids`` that ``starts`` records:
    load plan id → the request block its first CPU block fills), oldest first, is marked
    abandoned in the ledger (`BlockLedger.abandon_load()`): a lookup no longer defers to
    it and a second load of its blocks is not concurrent, while its CPU blocks keep their
    references until the copy ends and `BlockLedger.close()` releases them (a completion
    counts nothing for it). The caller detaches the plans from the request and forgets
    the block table from the first block they write on.

    Returns:
        The load plans abandoned now, oldest first, and the first request block they
        write (``None``: none was abandoned).
    """
    abandoned: list[LoadPlan] = []
    first: int | None = None
    for plan_id in sorted(plan_ids):
        start = starts.get(plan_id)
        if start is None:
            continue  # a store
        rec = ledger.abandon_load(plan_id)
        if rec is None or not isinstance(rec.plan, LoadPlan):
            continue
        abandoned.append(rec.plan)
        first = start if first is None else min(first, start)
    if abandoned:
        _log.debug(
            "load_abandoned",
            request_id=rid,
            plans=len(abandoned),
            blocks=sum(p.num_blocks for p in abandoned),
        )
    return abandoned, first


def check_lookup_counts(
    rid: str, num_tokens: int, num_computed_tokens: int, unit: int, unit_name: str
) -> None:
    """A lookup's counts, the rule of every path (one group's `lookup()`, a
    `GroupedScheduler`'s): ``0 <= num_computed_tokens <= num_tokens``, and
    ``num_computed_tokens`` a multiple of ``unit`` (one group's block size, several
    groups' hit alignment; ``unit_name`` names it).

    Raises:
        InvalidInputError: naming the request and the counts.
    """
    if num_tokens < 0 or not 0 <= num_computed_tokens <= num_tokens:
        raise InvalidInputError(
            f"request {rid!r}: need 0 <= num_computed_tokens "
            f"({num_computed_tokens}) <= num_tokens ({num_tokens})"
        )
    if num_computed_tokens % unit:
        raise InvalidInputError(
            f"request {rid!r}: num_computed_tokens={num_computed_tokens} is not a "
            f"multiple of {unit_name}={unit}"
        )


def check_load_tokens(rid: str, num_tokens: int, hit: int, unit: int, *, shorter: bool) -> None:
    """How much of a lookup's pinned ``hit`` a load takes, the rule of every path (one
    group's `plan_load()` and a `GroupedScheduler`'s; both take the whole hit, which this
    always accepts, without the call): ``0 <= num_tokens <= hit``, a multiple of
    ``unit`` (one group's block size, several groups' hit alignment). ``shorter``:
    whether a load shorter than the hit is taken at all (not with a group whose shorter
    hit needs other blocks, `check_shorter_load()`); the message then offers only 0 or
    the hit.

    Raises:
        InvalidInputError: naming the request, ``num_tokens``, the hit and the unit.
    """
    if num_tokens < 0 or num_tokens % unit or num_tokens > hit:
        below = f" or a multiple of {unit} below it" if shorter else ""
        raise InvalidInputError(
            f"request {rid!r}: num_tokens={num_tokens} must be 0 or the lookup's hit "
            f"{hit}{below} (the pinned hit is {hit} tokens)"
        )


class LookupExtension(Protocol):
    """What a lookup asks of the storage below the CPU pool (the tier manager)."""

    def extend_lookup(
        self,
        block_hashes: Sequence[BlockHash],
        end: int,
        limit: int,
        pinned: Sequence[CpuBlock],
        *,
        allow_defer: bool,
    ) -> bool:
        """A lookup found the blocks ``pinned`` on CPU, a run ending before
        ``block_hashes[end]``, of the loadable ``block_hashes[:limit]``; start what brings
        in the blocks after it.

        Returns:
            ``True`` when the caller should ask again later (``allow_defer`` only): the
            scheduler releases the pin and answers ``None``.
        """
        ...

    def hit_sources(self, pinned: Sequence[CpuBlock]) -> dict[str, int] | None:
        """Of a lookup's CPU hit ``pinned`` (asked before `extend_lookup()`), how many
        blocks this storage brought into the pool from each of its parts (a tier, by
        name) since a lookup last pinned them; ``None`` when none: the whole hit was
        in the pool already."""
        ...

    def miss_reason(self, block_hash: BlockHash) -> MissReason | None:
        """Why this storage could not bring ``block_hash`` in for a lookup that missed
        it on CPU (`MissReason.IN_FLIGHT`: its promotion runs; `MissReason.TIER_FAILED`),
        or ``None`` when it knows no reason (the pool's memory is asked next)."""
        ...

    @property
    def defer_deadline_s(self) -> float:
        """The longest a request's lookups may answer "ask again" in a row while this
        storage brings its blocks in (the time its promotions may take)."""
        ...


def block_miss_reason(
    ledger: BlockLedger,
    block_hash: BlockHash,
    below: Callable[[BlockHash], MissReason | None] | None,
) -> MissReason:
    """Why a pool (its ``ledger``) could not serve ``block_hash`` to a lookup: its copy
    into the pool in flight (`MissReason.IN_FLIGHT`), else what the storage below says
    (``below``: the tiers' `LookupExtension.miss_reason`, ``None`` without tiers), else
    what the pool's `MissMemory` remembers. The one rule for one group and for each
    group of several."""
    if block_hash in ledger.pending:
        return _IN_FLIGHT
    if below is not None:
        reason = below(block_hash)
        if reason is not None:
            return reason
    return ledger.misses.reason(block_hash)
