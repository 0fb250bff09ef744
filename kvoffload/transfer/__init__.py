"""Moving blocks: plans, awaitable tasks, copy engines and the completion poller."""

from kvoffload.transfer.cuda_engine import (
    CudaCopyEngine,
    EventLike,
    StreamBackend,
    StreamLike,
    TorchCudaBackend,
)
from kvoffload.transfer.engine import CopyEngine
from kvoffload.transfer.gather import BlockMover
from kvoffload.transfer.plan import LoadPlan, StorePlan, TransferKind, TransferPlan
from kvoffload.transfer.poller import CompletionPoller, PollerStatistics
from kvoffload.transfer.task import TransferResult, TransferStatus, TransferTask
from kvoffload.transfer.thread_engine import CopyHook, ThreadCopyEngine

__all__ = [
    "BlockMover",
    "CompletionPoller",
    "CopyEngine",
    "CopyHook",
    "CudaCopyEngine",
    "EventLike",
    "LoadPlan",
    "PollerStatistics",
    "StorePlan",
    "StreamBackend",
    "StreamLike",
    "ThreadCopyEngine",
    "TorchCudaBackend",
    "TransferKind",
    "TransferPlan",
    "TransferResult",
    "TransferStatus",
    "TransferTask",
]
