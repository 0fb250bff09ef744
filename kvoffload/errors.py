"""The exceptions kvoffload raises.

Every error derives from one root, so ``except KvOffloadError`` catches anything the
library raised on purpose::

    KvOffloadError
    ├── ConfigError (ValueError)          a configuration field has a bad value
    ├── LayoutMismatchError (ValueError)  KV tensors do not match the declared KVLayout
    ├── InvalidInputError (ValueError)    an argument of a call has a bad value
    │   ├── BlockTableError               a GPU block table is malformed (range, duplicate, changed)
    │   └── InputTypeError (TypeError)    an argument has the wrong type
    ├── OutOfBlocksError                  fewer free CPU blocks than asked for
    ├── BlockStateError                   misuse of a block: double free, publish unreferenced
    ├── InvariantError                    check_invariants() found a breach of DESIGN.md
    ├── UnknownRequestError (KeyError)    a request id the scheduler does not know
    ├── RequestStateError                 a request used in a state that forbids it (finished)
    ├── HostMemoryError                   host buffer allocation or pinning failed
    ├── TransferError                     a copy failed; the cause is chained
    │   └── LoadAbandonedError            the engine abandoned the load (abandon_load())
    ├── TransferNotFinishedError          result()/exception() asked of a pending transfer
    ├── PinnerError                       the engine's GpuBlockPinner raised; the cause is chained
    ├── ClosedError                       an object was used after aclose()
    ├── WrongContextError (RuntimeError)  a call from a thread or task that may not make it
    ├── ForkedProcessError                an object was used in a process forked after it was made
    └── TierError                         a secondary tier (disk, Redis) failed or is unreachable
        └── IntegrityError                a block read from a tier failed its verification

Warnings: ``UnhashedBlocksWarning`` (a ``UserWarning``) says, once per scheduler, that an
engine reports computed blocks it never hashed, so they can never be stored.

torch and CUDA errors are translated only at the transfer boundary
(``raise TransferError(...) from exc``); everywhere else they propagate unchanged.
"""

from __future__ import annotations

__all__ = [
    "BlockStateError",
    "BlockTableError",
    "ClosedError",
    "ConfigError",
    "ForkedProcessError",
    "HostMemoryError",
    "InputTypeError",
    "IntegrityError",
    "InvalidInputError",
    "InvariantError",
    "KvOffloadError",
    "LayoutMismatchError",
    "LoadAbandonedError",
    "OutOfBlocksError",
    "PinnerError",
    "RequestStateError",
    "TierError",
    "TransferError",
    "TransferNotFinishedError",
    "UnhashedBlocksWarning",
    "UnknownRequestError",
    "WrongContextError",
]


class KvOffloadError(Exception):
    """Root of every error kvoffload raises on purpose."""


class ConfigError(KvOffloadError, ValueError):
    """A configuration field has a bad value; the message names the field and the value."""


class LayoutMismatchError(KvOffloadError, ValueError):
    """KV tensors do not match the declared `KVLayout`."""


class InvalidInputError(KvOffloadError, ValueError):
    """An argument of a call has a bad value; the message names the argument, the value and
    the request it was for. Nothing was changed."""


class BlockTableError(InvalidInputError):
    """A GPU block table is malformed: an id out of range or named twice, or an entry that
    changed or disappeared while the request ran. The message names the request, the id and
    the position(s)."""


class InputTypeError(InvalidInputError, TypeError):
    """An argument has the wrong type (a float token count, a generator as a block table,
    a token id that is not a 64-bit int). Also a ``TypeError``."""


class OutOfBlocksError(KvOffloadError):
    """Fewer free CPU blocks than were asked for.

    Attributes:
        requested: blocks asked for.
        num_free: blocks that were free.
    """

    def __init__(self, requested: int, num_free: int) -> None:
        super().__init__(
            f"cannot allocate {requested} CPU block(s): only {num_free} free "
            "(blocks with a reference are never evicted)"
        )
        self.requested = requested
        self.num_free = num_free


class BlockStateError(KvOffloadError):
    """A block was used in a way its state does not allow (double free, publish unreferenced)."""


class InvariantError(KvOffloadError):
    """``check_invariants()`` found a breach of an invariant from DESIGN.md."""


class UnknownRequestError(KvOffloadError, KeyError):
    """A request id that the scheduler does not know."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class RequestStateError(KvOffloadError):
    """A request was used in a state that forbids it: updated after it finished, any call
    on a finished `OffloadRequest`, or a second handle for an id in use. The message names
    the request and its state."""


class HostMemoryError(KvOffloadError):
    """Allocating or pinning the host KV buffer failed."""


class TransferError(KvOffloadError):
    """A store or load failed; the underlying torch/CUDA error is chained as ``__cause__``."""


class LoadAbandonedError(TransferError):
    """The engine abandoned this load (`OffloadRequest.abandon_load()`,
    `KVOffloader.abandon_load()`): awaiting it raises this at once, while the copy may
    still run. Nothing it lands is used; its GPU blocks stay pinned until it has ended."""


class TransferNotFinishedError(KvOffloadError):
    """``result()`` or ``exception()`` was called on a transfer that has not finished."""


class PinnerError(KvOffloadError):
    """The engine's ``GpuBlockPinner`` raised; its exception is chained as ``__cause__``.

    The transfer it concerned was not started (``pin``) or was completed anyway (``unpin``);
    every reference was released, and the offloader keeps working.
    """


class ClosedError(KvOffloadError):
    """An object was used after it was closed."""


class WrongContextError(KvOffloadError, RuntimeError):
    """A call came from a thread or task that may not make it (the step loop runs on the
    event loop's thread; ``aclose()`` runs in the task that entered). Nothing was changed."""


class ForkedProcessError(KvOffloadError):
    """An object was used in a child process forked after it was created."""


class TierError(KvOffloadError):
    """A secondary tier failed: unreachable, timed out, out of space, or misconfigured.

    Tier errors never reach the engine's step loop: the tier manager counts them, marks
    the tier unhealthy and retries it with backoff.
    """


class IntegrityError(TierError):
    """A block read from a tier failed its check (header, namespace, hash, length, checksum).

    Attributes:
        reason: which check failed (``"header"``, ``"namespace"``, ``"hash"``,
            ``"length"`` or ``"checksum"``).
    """

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"block failed its {reason} check: {detail}")
        self.reason = reason


class UnhashedBlocksWarning(UserWarning):
    """The engine reports computed tokens far past the block hashes it gave: blocks with no
    hash can never be stored. Issued once per scheduler."""
