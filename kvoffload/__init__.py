"""kvoffload: offload LLM KV-cache blocks to a pinned CPU block pool and load them back.

The names below are the public API; submodules documented in ``docs/api.md`` hold the rest.
"""

from kvoffload.config import DTypeName, KVLayout, LayoutKind, OffloadConfig
from kvoffload.errors import (
    BlockStateError,
    ClosedError,
    ConfigError,
    ForkedProcessError,
    HostMemoryError,
    IntegrityError,
    InvariantError,
    KvOffloadError,
    LayoutMismatchError,
    OutOfBlocksError,
    RequestStateError,
    TierError,
    TransferError,
    TransferNotFinishedError,
    UnknownRequestError,
)
from kvoffload.hashing import BlockHash, HashNamespace, hash_block_tokens, hash_prompt
from kvoffload.offloader import GpuBlockPinner, KVOffloader, NoOpPinner, OffloaderStatistics
from kvoffload.pinner import RefCountPinner
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
from kvoffload.scheduler import GpuCacheView, OffloadScheduler, SchedulerStatistics
from kvoffload.storage import HostKVBuffer
from kvoffload.tiers import (
    DiskTier,
    DiskTierSettings,
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

__all__ = [
    "AllBlocksCleared",
    "BlockHash",
    "BlockId",
    "BlockRemoved",
    "BlockStateError",
    "BlockStored",
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
    "HashNamespace",
    "HostKVBuffer",
    "HostMemoryError",
    "IntegrityError",
    "InvariantError",
    "KVLayout",
    "KVOffloader",
    "KvOffloadError",
    "LayoutKind",
    "LayoutMismatchError",
    "LoadPlan",
    "LruFreeQueue",
    "NoOpPinner",
    "OffloadConfig",
    "OffloadRequest",
    "OffloadScheduler",
    "OffloaderStatistics",
    "OutOfBlocksError",
    "PollerStatistics",
    "PoolEvent",
    "PoolStatistics",
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
    "UnknownRequestError",
    "__version__",
    "hash_block_tokens",
    "hash_prompt",
]
