"""`PagedEngine`'s calls on kvoffload, and what it does when one raises a `PinnerError`.

Every call a step makes on the attached `KVOffloader` (directly, or through a request's
`OffloadRequest` handle) goes through `_OffloadCalls`. When the engine's `GpuBlockPinner`
raised in ``unpin`` while a transfer completed, the offloader's next step-loop call raises
a `PinnerError` once, before doing anything (the completion itself was recorded). That call
can be any of them (``request``, ``lookup``, ``load``, ``release``, ``preempt``,
``update`` through ``advance``, ``store``, ``drain``, ``finish``), so each is contained
here the same way: the error is logged (``offload_call_failed`` with the call, the request
and the cause), counted in `EngineStatistics.pinner_errors`, noted for the request the call
was for (its `GenerationResult.error` names it when it ends), and the call is made once more,
which then does what the first was asked to do. A second `PinnerError` can only come from a
pinner whose ``pin`` keeps raising, in ``load`` or ``store``: the load is given up (its hit
released, its tokens recomputed) and the stores are left for the next step (the offloader
undid their plan). ``finish`` is contained by `_OffloadCalls.finish`: the request is finished
all the same.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, TypeVar, final

from kvoffload._logging import get_logger
from kvoffload.errors import ClosedError, KvOffloadError, PinnerError
from kvoffload.integrations.transformers.state import _Counters, _Req
from kvoffload.offloader import KVOffloader
from kvoffload.scheduler.misses import MissReason
from kvoffload.transfer.task import TransferTask

__all__: list[str] = []

_log = get_logger("integrations.transformers")

_T = TypeVar("_T")


@final
class _OffloadCalls:
    """The attached offloader (or none) and every call the engine makes on it."""

    __slots__ = ("_counters", "off", "tables_of")

    def __init__(self, counters: _Counters) -> None:
        self._counters = counters
        self.off: KVOffloader | None = None
        """The attached offloader."""
        self.tables_of: Callable[[_Req], Any] = lambda r: r.table
        """What ``load`` and ``advance`` hand the handle: the request's table, or with a
        multi-group offloader one table per group (set by the batching)."""

    @property
    def grouped(self) -> bool:
        """Whether the attached offloader has several KV cache groups."""
        return self.off is not None and self.off.groups is not None

    def _contained(self, call: str, r: _Req | None, exc: PinnerError) -> None:
        """Log, count and note a `PinnerError` that ``call`` raised."""
        self._counters.pinner_errors += 1
        _log.warning(
            "offload_call_failed",
            call=call,
            request_id=None if r is None else r.request_id,
            error=repr(exc),
            cause=repr(exc.__cause__),
        )
        if r is not None:
            r.notes.append(f"kvoffload {call} raised {exc!r}")

    def _call(
        self, call: str, r: _Req | None, fn: Callable[..., _T], *args: Any, **kwargs: Any
    ) -> _T:
        """``fn(*args, **kwargs)``; after a `PinnerError`, contained, once more."""
        try:
            return fn(*args, **kwargs)
        except PinnerError as exc:
            self._contained(call, r, exc)
        return fn(*args, **kwargs)

    def open(self, r: _Req) -> None:
        """Give ``r`` its handle (the first admission with an offloader attached)."""
        if self.off is not None:
            r.handle = self._call("request", r, self.off.request, r.request_id, r.tokens)

    def lookup(self, r: _Req, num_computed_tokens: int) -> int | None:
        """Tokens of ``r`` loadable past the engine's prefix (pinned), or 0 without a handle.

        With secondary tiers, ``None`` when the lookup started a promotion (its pin is
        released): the request waits, and a later step loads what the tier had instead of
        computing it (each tier operation within its own budget).
        """
        if r.handle is None or r.no_load:
            return 0
        defer = self.off is not None and self.off.tiers is not None
        return self._call(
            "lookup",
            r,
            r.handle.lookup,
            num_computed_tokens=num_computed_tokens,
            allow_defer=defer,
        )

    def explain(self, r: _Req, hit: int) -> tuple[dict[str, int], str | None]:
        """Of the hit of ``r``'s last `lookup()` (``hit`` tokens), the tokens each tier
        promoted for it, and that lookup's `MissReason` value (``None``: no handle;
        ``"not_read"``: the request no longer loads)."""
        handle = r.handle
        if handle is None:
            return {}, None
        if r.no_load:
            return {}, MissReason.NOT_READ.value
        reason = handle.miss_reason
        tiers = {name: n for name, n in handle.tier_hit_tokens.items() if n} if hit else {}
        return tiers, None if reason is None else reason.value

    def load(self, r: _Req) -> TransferTask | None:
        """Start loading the last lookup's hit into ``r``'s table.

        Returns:
            The transfer, or ``None`` when it could not start (the pinner's ``pin`` kept
            raising): the hit is released and the caller recomputes those tokens.
        """
        handle = r.handle
        if handle is None:
            return None
        try:
            return self._call("load", r, handle.load, self.tables_of(r))
        except PinnerError as exc:
            self._contained("load", r, exc)
        self.release(r)
        return None

    def abandon_load(self, r: _Req) -> dict[str, tuple[int, ...]] | tuple[int, ...]:
        """Give up ``r``'s load in flight; the GPU blocks its copy still writes (pinned
        until it ended): one tuple, or one per group name with a multi-group offloader."""
        if r.handle is None:
            return ()
        return r.handle.abandon_load()  # never raises a PinnerError

    def release(self, r: _Req) -> None:
        """Drop ``r``'s lookup pin (it will not be loaded now)."""
        if r.handle is not None:
            self._call("release", r, r.handle.release)

    def preempt(self, r: _Req) -> None:
        """Tell kvoffload ``r``'s GPU blocks are gone."""
        if r.handle is not None:
            self._call("preempt", r, r.handle.preempt)

    def advance(self, r: _Req, num_computed: int) -> None:
        """Report ``r``'s step: its tables (`tables_of`) and computed tokens."""
        if r.handle is not None:
            self._call("advance", r, r.handle.advance, self.tables_of(r), num_computed)

    def store(self) -> None:
        """Start this step's stores (left for the next step if the pinner's ``pin`` keeps
        raising)."""
        if self.off is None:
            return
        try:
            self._call("store", None, self.off.store)
        except PinnerError as exc:
            self._contained("store", None, exc)

    async def drain(self) -> None:
        """Wait for the transfers in flight."""
        if self.off is None:
            return
        try:
            await self.off.drain()
        except PinnerError as exc:
            self._contained("drain", None, exc)
            await self.off.drain()

    def finish(self, r: _Req) -> str | None:
        """Finish ``r``'s handle; never raises for kvoffload.

        Returns:
            What failed, for `GenerationResult.error`, or ``None``.
        """
        handle = r.handle
        if handle is None or handle.finished:
            return None
        try:
            if r.hint is None:
                handle.finish()
            else:
                handle.finish(retain_for_s=r.hint[0], session=r.hint[1])
        except ClosedError:
            return None  # a closed offloader let go of it already
        except KvOffloadError as exc:
            self._counters.finish_errors += 1
            _log.warning(
                "request_finish_failed",
                request_id=r.request_id,
                error=repr(exc),
                cause=repr(exc.__cause__),
            )
            if not handle.finished:  # a handle that lets a refused finish be retried
                with contextlib.suppress(KvOffloadError):
                    handle.finish()
            return f"kvoffload finish failed: {exc!r}"
        return None
