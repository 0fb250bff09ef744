"""The connector's KV cache events: the CPU pool's events as vLLM's ``BlockStored`` /
``BlockRemoved`` / ``AllBlocksCleared``, in the hash format of vLLM's own events.

A KV-aware router indexes vLLM's events by vLLM's block hashes (``request.block_hashes``
viewed at the group's block size, as `vllm.v1.core.block_pool.BlockPool` publishes them;
an ``int`` of their low 64 bits with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``). kvoffload
keys its pool by its own, process-independent hashes, so when a store is planned
`KVEvents` remembers, per group and kvoffload hash, the vLLM hash of the same block (with
its parent's, its tokens, its LoRA and its extra keys, as vLLM's event carries them), and
turns each pool event into the vLLM event of the same block: medium ``"CPU"``, the
group's index in vLLM's KV cache config. A block's entry lives as long as the pool holds
it (dropped at its ``BlockRemoved``, or when its store failed).

Both scheduler sides use it: one full-attention group (group index 0) and several
(each cacheable group by its vLLM index; a hash is remembered per group, so two groups'
blocks never mix).

With ``tiers``, a block written down to a tier gets a ``BlockStored`` of that tier's
medium too (`tier_medium`: ``"DISK"``, ``"REDIS"``, ``"REDIS_CLUSTER"``), with the same
hashes and group. The workers write down, so they tell: each rank's `TierWrites` collects
the write-downs that ended, per tier, into the step's worker metadata (no extra round
trip: it travels with the copies' reports), and `KVEvents.note_tier_writes` publishes a
block once every rank reported it stored in that tier (each rank holds its own shard). A
write-down that a tier stored only in part (a Redis Cluster node past its budget) names
no block: the tiers count blocks, not which ones. The tiers never say when they drop a
block (a disk slot reused, a Redis key expired or evicted), so no ``BlockRemoved`` of a
tier's medium is ever sent: a router takes such a block as a hint that may miss.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, final

from kvoffload._logging import get_logger
from kvoffload.hashing import BlockHash
from kvoffload.pool import AllBlocksCleared, BlockRemoved, BlockStored, PoolEvent

if TYPE_CHECKING:
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.v1.request import Request

    from kvoffload.transfer.plan import StorePlan

__all__ = ["KVEvents", "TierWrites", "events_enabled", "tier_medium"]

_log = get_logger("integrations.vllm")


def events_enabled(vllm_config: Any) -> bool:
    """Whether vLLM publishes KV cache events (``kv_events_config.enable_kv_cache_events``):
    the connector then hands vLLM its CPU pool's events too."""
    events = getattr(vllm_config, "kv_events_config", None)
    return bool(events is not None and events.enable_kv_cache_events)


_PENDING_MAX = 65536
"""Most blocks some ranks, not all yet, reported written to a tier (the oldest are
forgotten: a rank whose write failed never reports them)."""


def tier_medium(kind: str) -> str:
    """The medium of a tier's events: its kind in capitals, ``-`` as ``_`` (``"DISK"``,
    ``"REDIS"``, ``"REDIS_CLUSTER"``)."""
    return kind.upper().replace("-", "_")


@final
class TierWrites:
    """One rank's write-downs that ended, per (vLLM group index, tier index): the blocks
    every write of which that tier stored (each group's `WorkerTiers.on_written` calls
    `note`)."""

    __slots__ = ("_landed",)

    def __init__(self) -> None:
        self._landed: dict[tuple[int, int], list[BlockHash]] = {}

    def note(self, hashes: Sequence[BlockHash], counts: Sequence[int], group: int = 0) -> None:
        """A write-down of group ``group``'s ``hashes`` ended; ``counts[i]``: blocks tier
        ``i`` stored."""
        for tier, stored in enumerate(counts):
            if stored >= len(hashes):
                self._landed.setdefault((group, tier), []).extend(hashes)

    def take(self) -> dict[tuple[int, int], tuple[BlockHash, ...]]:
        """``(group, tier) -> blocks stored there`` since the last call."""
        landed, self._landed = self._landed, {}
        return {key: tuple(hashes) for key, hashes in landed.items()}


@dataclass(frozen=True, slots=True)
class _Block:
    """What vLLM's ``BlockStored`` says of one block, besides the medium and group."""

    block_hash: Any
    parent: Any
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None
    lora_name: str | None
    extra_keys: tuple[Any, ...] | None


@final
class KVEvents:
    """Remembers the vLLM hash of every block a store plan writes, and translates the
    pool's events into vLLM's.

    Args:
        medium: the events' medium (``"CPU"``: kvoffload's CPU pool).
        tier_media: each tier's medium, in the tiers' order (`tier_medium`).
    """

    __slots__ = ("_blocks", "_pending", "_tier_events", "medium", "tier_media")

    def __init__(self, medium: str = "CPU", tier_media: Sequence[str] = ()) -> None:
        self.medium = medium
        self.tier_media = tuple(tier_media)
        self._blocks: dict[tuple[int, BlockHash], _Block] = {}
        # (group, tier, hash) -> the ranks that reported it written, until all did.
        self._pending: OrderedDict[tuple[int, int, BlockHash], set[int]] = OrderedDict()
        self._tier_events: list[tuple[str, int, _Block]] = []

    def __len__(self) -> int:
        return len(self._blocks)

    def note_store(
        self,
        group_idx: int,
        plan: StorePlan,
        block_size: int,
        hash_block_size: int,
        requests: Callable[[str], tuple[Request, Sequence[BlockHash]] | None],
    ) -> None:
        """Remember vLLM's view of the blocks ``plan`` stores into group ``group_idx``.

        Args:
            group_idx: the group's index in vLLM's KV cache config.
            plan: the store plan (its requests and kvoffload block hashes).
            block_size: the group's tokens per block.
            hash_block_size: the tokens per hash of ``request.block_hashes`` (vLLM's
                ``BlockPool.hash_block_size``).
            requests: a request id's vLLM request and its kvoffload hashes in this group
                (``None``: the request is gone; its blocks get no event).
        """
        from vllm.v1.core.kv_cache_utils import (  # noqa: PLC0415
            generate_block_hash_extra_keys,
            maybe_convert_block_hash,
            resolve_block_hashes,
        )

        wanted = {h for h in plan.block_hashes if (group_idx, h) not in self._blocks}
        for rid in plan.request_ids:
            if not wanted:
                return
            found = requests(rid)
            if found is None:
                continue
            request, hashes = found
            vllm_hashes = resolve_block_hashes(request.block_hashes, hash_block_size, block_size)
            tokens = request.all_token_ids
            lora = request.lora_request
            # The plan's blocks are the request's latest: look from the end.
            for i in range(min(len(hashes), len(vllm_hashes)) - 1, -1, -1):
                ours = hashes[i]
                if ours not in wanted:
                    continue
                wanted.discard(ours)
                start = i * block_size
                extra, _ = generate_block_hash_extra_keys(request, start, start + block_size, 0)
                self._blocks[group_idx, ours] = _Block(
                    block_hash=maybe_convert_block_hash(vllm_hashes[i]),
                    parent=maybe_convert_block_hash(vllm_hashes[i - 1]) if i else None,
                    token_ids=tuple(tokens[start : start + block_size]),
                    block_size=block_size,
                    lora_id=lora.adapter_id if lora is not None else None,
                    lora_name=lora.name if lora is not None else None,
                    extra_keys=extra,
                )
                if not wanted:
                    return

    def note_tier_writes(
        self,
        writes: Mapping[tuple[int, int], Mapping[int, Sequence[BlockHash]]],
        world_size: int,
    ) -> None:
        """The workers' write-downs that ended (``(group, tier) -> {rank: hashes}``, from
        `TierWrites`): a block every one of ``world_size`` ranks stored in a tier gets a
        ``BlockStored`` of that tier's medium and its group at the next `translate()`, if
        its vLLM hash is still known (the CPU pool still holds it)."""
        pending = self._pending
        for (group_idx, tier), ranks in writes.items():
            if not 0 <= tier < len(self.tier_media):
                _log.debug("event_unknown_tier", tier=tier)
                continue
            for rank, hashes in ranks.items():
                for block_hash in hashes:
                    key = (group_idx, tier, block_hash)
                    if world_size > 1:
                        seen = pending.setdefault(key, set())
                        seen.add(rank)
                        if len(seen) < world_size:
                            continue
                        del pending[key]
                    block = self._blocks.get((group_idx, block_hash))
                    if block is not None:
                        self._tier_events.append((self.tier_media[tier], group_idx, block))
        while len(pending) > _PENDING_MAX:
            pending.popitem(last=False)

    def forget_unstored(
        self, group_idx: int, hashes: Iterable[BlockHash], is_cached: Callable[[BlockHash], bool]
    ) -> None:
        """A store failed: forget its blocks the pool does not hold (no event will come)."""
        for block_hash in hashes:
            if not is_cached(block_hash):
                self._blocks.pop((group_idx, block_hash), None)

    def translate(self, events: Iterable[tuple[int, PoolEvent]]) -> list[KVCacheEvent]:
        """vLLM's events for ``(group index, pool event)`` pairs, in order; one
        ``AllBlocksCleared`` for a reset of every group. A stored block whose vLLM hash is
        unknown (its request was gone when the store was planned) gets no event."""
        from vllm.distributed import kv_events  # noqa: PLC0415

        out: list[KVCacheEvent] = []
        cleared = False
        for group_idx, event in events:
            if isinstance(event, BlockStored):
                block = self._blocks.get((group_idx, event.block_hash))
                if block is None:
                    _log.debug("event_without_vllm_hash", group=group_idx)
                    continue
                out.append(_stored(block, self.medium, group_idx))
            elif isinstance(event, BlockRemoved):
                block = self._blocks.pop((group_idx, event.block_hash), None)
                if block is not None:
                    out.append(
                        kv_events.BlockRemoved(
                            block_hashes=[block.block_hash],
                            medium=self.medium,
                            group_idx=group_idx,
                        )
                    )
            elif isinstance(event, AllBlocksCleared):
                self._blocks = {k: v for k, v in self._blocks.items() if k[0] != group_idx}
                if not cleared:
                    out.append(kv_events.AllBlocksCleared())
                    cleared = True
        tier_events, self._tier_events = self._tier_events, []
        out.extend(_stored(block, medium, group) for medium, group, block in tier_events)
        return out


def _stored(block: _Block, medium: str, group_idx: int) -> KVCacheEvent:
    """vLLM's ``BlockStored`` of one block in ``medium``."""
    from vllm.distributed import kv_events  # noqa: PLC0415
    from vllm.v1.core.kv_cache_utils import to_event_extra_keys  # noqa: PLC0415

    return kv_events.BlockStored(
        block_hashes=[block.block_hash],
        parent_block_hash=block.parent,
        token_ids=list(block.token_ids),
        block_size=block.block_size,
        lora_id=block.lora_id,
        medium=medium,
        lora_name=block.lora_name,
        extra_keys=to_event_extra_keys([block.extra_keys]),
        group_idx=group_idx,
    )
