"""kvoffload: offload LLM KV-cache blocks to a pinned CPU block pool and load them back.

The names below are the public API; submodules documented in ``docs/api.md`` hold the rest.
Each name is imported from its module on first use, so ``import kvoffload`` (and the
``kvoffload`` command's ``--version`` and ``--help``) stays light: torch loads only when a
name that needs it is used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvoffload.config import OffloadConfig
    from kvoffload.errors import (
        BlockStateError,
        BlockTableError,
        ClosedError,
        ConfigError,
        ForkedProcessError,
        HostMemoryError,
        InputTypeError,
        IntegrityError,
        InvalidInputError,
        InvariantError,
        KvOffloadError,
        LayoutMismatchError,
        LoadAbandonedError,
        OutOfBlocksError,
        PinnerError,
        RequestStateError,
        TierError,
        TransferError,
        TransferNotFinishedError,
        UnhashedBlocksWarning,
        UnknownRequestError,
        WrongContextError,
    )
    from kvoffload.groups import GroupKind, KVCacheGroup
    from kvoffload.hashing import (
        BlockHash,
        BlockHasher,
        HashNamespace,
        hash_block_tokens,
        hash_prompt,
    )
    from kvoffload.layout import DTypeName, KVLayout, LayoutKind
    from kvoffload.offloader import KVOffloader, OffloaderStatistics
    from kvoffload.pinner import GpuBlockPinner, NoOpPinner, RefCountPinner
    from kvoffload.pool import (
        AllBlocksCleared,
        BlockId,
        BlockRemoved,
        BlockStored,
        CpuBlock,
        CpuBlockPool,
        LruFreeQueue,
        PoolEvent,
        PoolStatistics,
    )
    from kvoffload.request import OffloadRequest
    from kvoffload.request_state import RequestOffloadState
    from kvoffload.scheduler import (
        GpuCacheView,
        GroupedPlan,
        GroupedScheduler,
        GroupStatistics,
        MissReason,
        OffloadScheduler,
        SchedulerStatistics,
    )
    from kvoffload.storage import HostKVBuffer
    from kvoffload.tiers import (
        DiskTier,
        DiskTierSettings,
        RedisClusterTierSettings,
        RedisTierSettings,
        SecondaryTier,
        TierManager,
        TierManagerStatistics,
        TierStatistics,
    )
    from kvoffload.transfer import (
        CompletionPoller,
        CopyEngine,
        CudaCopyEngine,
        LoadPlan,
        PollerStatistics,
        StorePlan,
        ThreadCopyEngine,
        TransferPlan,
        TransferResult,
        TransferStatus,
        TransferTask,
    )

__version__ = "0.1.0.dev0"

_WHERE: dict[str, str] = {
    "AllBlocksCleared": "kvoffload.pool",
    "BlockHash": "kvoffload.hashing",
    "BlockHasher": "kvoffload.hashing",
    "BlockId": "kvoffload.pool",
    "BlockRemoved": "kvoffload.pool",
    "BlockStateError": "kvoffload.errors",
    "BlockStored": "kvoffload.pool",
    "BlockTableError": "kvoffload.errors",
    "ClosedError": "kvoffload.errors",
    "CompletionPoller": "kvoffload.transfer",
    "ConfigError": "kvoffload.errors",
    "CopyEngine": "kvoffload.transfer",
    "CpuBlock": "kvoffload.pool",
    "CpuBlockPool": "kvoffload.pool",
    "CudaCopyEngine": "kvoffload.transfer",
    "DTypeName": "kvoffload.layout",
    "DiskTier": "kvoffload.tiers",
    "DiskTierSettings": "kvoffload.tiers",
    "ForkedProcessError": "kvoffload.errors",
    "GpuBlockPinner": "kvoffload.pinner",
    "GpuCacheView": "kvoffload.scheduler",
    "GroupKind": "kvoffload.groups",
    "GroupStatistics": "kvoffload.scheduler",
    "GroupedPlan": "kvoffload.scheduler",
    "GroupedScheduler": "kvoffload.scheduler",
    "HashNamespace": "kvoffload.hashing",
    "HostKVBuffer": "kvoffload.storage",
    "HostMemoryError": "kvoffload.errors",
    "InputTypeError": "kvoffload.errors",
    "IntegrityError": "kvoffload.errors",
    "InvalidInputError": "kvoffload.errors",
    "InvariantError": "kvoffload.errors",
    "KVCacheGroup": "kvoffload.groups",
    "KVLayout": "kvoffload.layout",
    "KVOffloader": "kvoffload.offloader",
    "KvOffloadError": "kvoffload.errors",
    "LayoutKind": "kvoffload.layout",
    "LayoutMismatchError": "kvoffload.errors",
    "LoadAbandonedError": "kvoffload.errors",
    "LoadPlan": "kvoffload.transfer",
    "LruFreeQueue": "kvoffload.pool",
    "MissReason": "kvoffload.scheduler",
    "NoOpPinner": "kvoffload.pinner",
    "OffloadConfig": "kvoffload.config",
    "OffloadRequest": "kvoffload.request",
    "OffloadScheduler": "kvoffload.scheduler",
    "OffloaderStatistics": "kvoffload.offloader",
    "OutOfBlocksError": "kvoffload.errors",
    "PinnerError": "kvoffload.errors",
    "PollerStatistics": "kvoffload.transfer",
    "PoolEvent": "kvoffload.pool",
    "PoolStatistics": "kvoffload.pool",
    "RedisClusterTierSettings": "kvoffload.tiers",
    "RedisTierSettings": "kvoffload.tiers",
    "RefCountPinner": "kvoffload.pinner",
    "RequestOffloadState": "kvoffload.request_state",
    "RequestStateError": "kvoffload.errors",
    "SchedulerStatistics": "kvoffload.scheduler",
    "SecondaryTier": "kvoffload.tiers",
    "StorePlan": "kvoffload.transfer",
    "ThreadCopyEngine": "kvoffload.transfer",
    "TierError": "kvoffload.errors",
    "TierManager": "kvoffload.tiers",
    "TierManagerStatistics": "kvoffload.tiers",
    "TierStatistics": "kvoffload.tiers",
    "TransferError": "kvoffload.errors",
    "TransferNotFinishedError": "kvoffload.errors",
    "TransferPlan": "kvoffload.transfer",
    "TransferResult": "kvoffload.transfer",
    "TransferStatus": "kvoffload.transfer",
    "TransferTask": "kvoffload.transfer",
    "UnhashedBlocksWarning": "kvoffload.errors",
    "UnknownRequestError": "kvoffload.errors",
    "WrongContextError": "kvoffload.errors",
    "hash_block_tokens": "kvoffload.hashing",
    "hash_prompt": "kvoffload.hashing",
}
"""The module each public name is imported from."""

__all__ = [
    "AllBlocksCleared",
    "BlockHash",
    "BlockHasher",
    "BlockId",
    "BlockRemoved",
    "BlockStateError",
    "BlockStored",
    "BlockTableError",
    "ClosedError",
    "CompletionPoller",
    "ConfigError",
    "CopyEngine",
    "CpuBlock",
    "CpuBlockPool",
    "CudaCopyEngine",
    "DTypeName",
    "DiskTier",
    "DiskTierSettings",
    "ForkedProcessError",
    "GpuBlockPinner",
    "GpuCacheView",
    "GroupKind",
    "GroupStatistics",
    "GroupedPlan",
    "GroupedScheduler",
    "HashNamespace",
    "HostKVBuffer",
    "HostMemoryError",
    "InputTypeError",
    "IntegrityError",
    "InvalidInputError",
    "InvariantError",
    "KVCacheGroup",
    "KVLayout",
    "KVOffloader",
    "KvOffloadError",
    "LayoutKind",
    "LayoutMismatchError",
    "LoadAbandonedError",
    "LoadPlan",
    "LruFreeQueue",
    "MissReason",
    "NoOpPinner",
    "OffloadConfig",
    "OffloadRequest",
    "OffloadScheduler",
    "OffloaderStatistics",
    "OutOfBlocksError",
    "PinnerError",
    "PollerStatistics",
    "PoolEvent",
    "PoolStatistics",
    "RedisClusterTierSettings",
    "RedisTierSettings",
    "RefCountPinner",
    "RequestOffloadState",
    "RequestStateError",
    "SchedulerStatistics",
    "SecondaryTier",
    "StorePlan",
    "ThreadCopyEngine",
    "TierError",
    "TierManager",
    "TierManagerStatistics",
    "TierStatistics",
    "TransferError",
    "TransferNotFinishedError",
    "TransferPlan",
    "TransferResult",
    "TransferStatus",
    "TransferTask",
    "UnhashedBlocksWarning",
    "UnknownRequestError",
    "WrongContextError",
    "__version__",
    "hash_block_tokens",
    "hash_prompt",
]


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'kvoffload' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
