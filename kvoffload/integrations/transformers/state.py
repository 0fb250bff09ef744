"""What `PagedEngine` keeps per request, and its counters.

A `_Req` is one request as the engine sees it: its tokens, its GPU block table, how far it
is computed, its kvoffload handle (or, with no offloader attached, its own block hasher)
and the `GenerationResult` it ends with. `_Counters` are the numbers
`PagedEngine.statistics` reports. Both are shared by the engine's parts: the batching
(`kvoffload.integrations.transformers.batching`), the forward pass
(`kvoffload.integrations.transformers.forward`) and the calls on kvoffload
(`kvoffload.integrations.transformers.offload`).
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from kvoffload.hashing import BlockHash, BlockHasher
from kvoffload.integrations.transformers.recurrent import RecurrentState
from kvoffload.integrations.transformers.results import GenerationResult
from kvoffload.request import OffloadRequest
from kvoffload.transfer.task import TransferTask

__all__: list[str] = []


class _Req:
    """One request: waiting (no table, no load) or running (its table)."""

    __slots__ = (
        "aborted",
        "eos",
        "handle",
        "hasher",
        "hint",
        "load_task",
        "max_new",
        "no_load",
        "notes",
        "num_cached_blocks",
        "num_computed",
        "rec_table",
        "result",
        "state",
        "t0",
        "tables",
        "tier_hit",
        "tokens",
    )

    def __init__(
        self, rid: str, prompt: list[int], max_new: int, eos: int | None, hasher: BlockHasher | None
    ) -> None:
        self.tokens = prompt
        self.max_new, self.eos = max_new, eos
        self.handle: OffloadRequest | None = None
        # (retain_for_s, session) given to the handle's finish (a session hint), or None.
        self.hint: tuple[float, Hashable] | None = None
        self.hasher = hasher
        self.tables: list[list[int | None]] = []  # per attention group; None: freed
        self.state: RecurrentState | None = None  # the recurrent layers' state, if any
        # With a multi-group offloader: the state blocks of the request's snapshots (entry
        # i: the state after (i + 1) * block_size tokens), one ref each; None: none kept.
        self.rec_table: list[int | None] = []
        self.num_computed = 0
        self.num_cached_blocks = 0  # blocks registered in the GPU prefix cache
        self.tier_hit: dict[str, int] = {}  # of the hit being loaded: tokens by tier
        self.load_task: TransferTask | None = None
        self.aborted = False
        self.no_load = False  # a load of it was abandoned: it computes from now on
        self.notes: list[str] = []  # kvoffload errors contained along the way, for `result.error`
        self.t0 = time.perf_counter()
        self.result = GenerationResult(rid, len(prompt))

    @property
    def table(self) -> list[int]:
        """The first attention group's table (a full-attention group's has no ``None``)."""
        return self.tables[0] if self.tables else []  # type: ignore[return-value]

    @table.setter
    def table(self, value: list[int]) -> None:
        if self.tables:
            self.tables[0] = list(value)
        else:
            self.tables = [list(value)]

    @property
    def request_id(self) -> str:
        return self.result.request_id

    @property
    def hashes(self) -> Sequence[BlockHash]:
        if self.handle is not None:
            return self.handle.block_hashes
        return self.hasher.block_hashes if self.hasher is not None else ()


@dataclass(slots=True)
class _Counters:
    """The engine's counters (see `EngineStatistics`)."""

    steps: int = 0
    computed: int = 0
    gpu_cached: int = 0
    loaded: int = 0
    preemptions: int = 0
    failed_loads: int = 0
    abandoned_loads: int = 0
    finish_errors: int = 0
    pinner_errors: int = 0
    tier_loaded: dict[str, int] = field(default_factory=dict)
