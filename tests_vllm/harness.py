"""Drive vLLM's real v1 `Scheduler` with `KVOffloadConnector` on CPU, with a fake model.

The fake forward pass writes, for every token a step computes, a value derived from the
token id, its position, the layer and the rank into that token's KV slot. After any
sequence of steps, a request's KV is right exactly when every one of its slots holds that
value; a load that brought wrong bytes, or a block overwritten while a store read it,
shows up as a wrong slot.
"""

from __future__ import annotations

import functools
import json
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from kvoffload.integrations.vllm import KVOffloadConnector
from kvoffload.pool.block_pool import CpuBlockPool
from kvoffload.scheduler.stats import SchedulerStatistics
from kvoffload.transfer.plan import TransferPlan

BLOCK_SIZE = 16
NUM_LAYERS = 2
NUM_KV_HEADS = 2
HEAD_SIZE = 32
EOS = 1

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": NUM_KV_HEADS,
    "head_dim": HEAD_SIZE,
    "num_hidden_layers": NUM_LAYERS,
    "vocab_size": 512,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "bos_token_id": 0,
    "eos_token_id": EOS,
}


def write_tiny_llama(directory: Path, **overrides: Any) -> Path:
    """A model directory holding only a Llama ``config.json`` (random weights, no download)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({**TINY_LLAMA, **overrides}))
    return directory


def kv_cache_config(num_gpu_blocks: int, *, groups: int = 1) -> KVCacheConfig:
    """One full-attention group over the tiny model's layers (or ``groups`` of them)."""
    spec = FullAttentionSpec(
        block_size=BLOCK_SIZE,
        num_kv_heads=NUM_KV_HEADS,
        head_size=HEAD_SIZE,
        dtype=torch.float32,
    )
    names = [f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS)]
    per = max(1, NUM_LAYERS // groups)
    return KVCacheConfig(
        num_blocks=num_gpu_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(names[g * per : (g + 1) * per], spec) for g in range(groups)
        ],
    )


def vllm_config(
    model_dir: Path,
    extra: dict[str, Any],
    *,
    num_gpu_blocks: int,
    max_num_batched_tokens: int = 256,
    world_size: int = 1,
    connector: str = "KVOffloadConnector",
    module: str = "kvoffload.integrations.vllm",
) -> VllmConfig:
    """A CPU `VllmConfig` whose KV transfer config names the connector."""
    model_config = ModelConfig(
        model=str(model_dir), skip_tokenizer_init=True, dtype="float32", seed=0
    )
    config = VllmConfig(
        model_config=model_config,
        scheduler_config=SchedulerConfig(
            max_num_seqs=8,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=4096,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
        ),
        cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True),
        parallel_config=ParallelConfig(),
        kv_transfer_config=KVTransferConfig(
            kv_connector=connector,
            kv_connector_module_path=module,
            kv_role="kv_both",
            kv_connector_extra_config=extra,
            kv_load_failure_policy="recompute",
        ),
        device_config=DeviceConfig("cpu"),
    )
    config.cache_config.num_gpu_blocks = num_gpu_blocks
    if world_size != 1:
        config.parallel_config.tensor_parallel_size = world_size
        config.parallel_config.world_size = world_size
    return config


@functools.cache
def _init_vllm_hashing() -> None:
    init_none_hash(sha256)


def make_request(
    request_id: str, prompt: Sequence[int], max_tokens: int = 4, *, cache_salt: str | None = None
) -> Request:
    """A vLLM request with token-id prompt and vLLM's own block hasher."""
    _init_vllm_hashing()
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    params.update_from_generation_config({}, EOS)
    return Request(
        request_id=request_id,
        prompt_token_ids=list(prompt),
        sampling_params=params,
        pooling_params=None,
        mm_features=None,
        cache_salt=cache_salt,
        block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256),
    )


def slot_value(token: int, position: int, layer: int, rank: int) -> float:
    """What the fake forward writes for a token (exact in float32)."""
    return float(token * 4096 + position) + layer * 0.5 + rank * 0.25


class TestConnector(KVOffloadConnector):
    """The connector with a rank chosen by the test, and copies that fail on demand."""

    __test__ = False
    next_rank: int = 0
    fail_kinds: ClassVar[set[str]] = set()
    store_gate: ClassVar[threading.Event | None] = None

    def _worker_rank(self) -> int | None:
        return TestConnector.next_rank

    def _copy_hook(self) -> Callable[[TransferPlan], None]:
        def hook(plan: TransferPlan) -> None:
            gate = TestConnector.store_gate
            if plan.kind == "store" and gate is not None:
                gate.wait(timeout=60)
            if plan.kind in TestConnector.fail_kinds:
                raise OSError(f"injected failure of {plan.kind} plan {plan.plan_id}")

        return hook


@dataclass
class Worker:
    """One simulated worker: its connector and its KV tensors."""

    connector: KVOffloadConnector
    kv: list[torch.Tensor]
    rank: int
    hold_reports: bool = False
    held: list[Any] = field(default_factory=list)


def real_scheduler(config: VllmConfig, kv_config: KVCacheConfig) -> Scheduler:
    """vLLM's own v1 `Scheduler` (statistics on) over ``kv_config``, with the connector
    ``config`` names."""
    return Scheduler(
        vllm_config=config,
        kv_cache_config=kv_config,
        structured_output_manager=StructuredOutputManager(config),
        block_size=BLOCK_SIZE,
        log_stats=True,
    )


class Stepping:
    """What a harness over vLLM's `Scheduler` does with its `step()` (subclasses provide
    ``scheduler``, ``side``, `step` and `drain_copies`)."""

    scheduler: Scheduler
    connector_stats: list[dict[str, Any]]
    """The connector statistics of every step's `SchedulerStats`, as vLLM's loggers get
    them."""

    def record_stats(self, outputs: dict[int, Any]) -> None:
        """Keep the connector statistics of a step's engine core outputs."""
        for eco in outputs.values():
            stats = eco.scheduler_stats
            if stats is not None and stats.kv_connector_stats is not None:
                self.connector_stats.append(stats.kv_connector_stats)

    def step(self) -> SchedulerOutput:
        """Schedule, run the workers (loads, forward, stores), and feed back the output."""
        raise NotImplementedError

    def drain_copies(self) -> None:
        """Let every worker's copies end (reports go out with the next step)."""
        raise NotImplementedError

    def run(self, request: Request, *, max_steps: int = 200) -> None:
        """Add ``request`` and step until it finished."""
        self.scheduler.add_request(request)
        for _ in range(max_steps):
            self.step()
            if request.is_finished():
                return
        raise AssertionError(f"request {request.request_id} did not finish in {max_steps} steps")

    def settle(self, *, max_steps: int = 20) -> None:
        """Step (empty steps included) until no copy is in flight anywhere."""
        for _ in range(max_steps):
            self.drain_copies()
            self.step()
            if not self.side.in_flight_plan_ids():  # type: ignore[attr-defined]
                return
        raise AssertionError("copies still in flight")


class Harness(Stepping):
    """A real `Scheduler` plus ``world_size`` simulated workers.

    Args:
        config: the vLLM config (its KV transfer config names the connector class).
        kv_config: the KV cache config.
        world_size: simulated workers.
    """

    def __init__(self, config: VllmConfig, kv_config: KVCacheConfig, world_size: int = 1) -> None:
        self.config = config
        self.kv_config = kv_config
        self.scheduler = real_scheduler(config, kv_config)
        connector = self.scheduler.connector
        assert isinstance(connector, KVOffloadConnector)
        self.connector = connector
        self.side = connector.scheduler_side
        assert self.side is not None
        self.workers: list[Worker] = []
        for rank in range(world_size):
            TestConnector.next_rank = rank
            worker = TestConnector(config, KVConnectorRole.WORKER, kv_config)
            shape = (kv_config.num_blocks, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE)
            kv = [torch.full(shape, -1.0) for _ in range(NUM_LAYERS)]
            names = kv_config.kv_cache_groups[0].layer_names
            worker.register_kv_caches(dict(zip(names, kv, strict=True)))
            self.workers.append(Worker(worker, kv, rank))
        self.aggregator = KVOutputAggregator(world_size)
        self.connector_stats = []
        self.outputs: list[SchedulerOutput] = []
        self.loaded_tokens: dict[str, int] = {}

    # -- one engine step ---------------------------------------------------------------

    def _forward(self, worker: Worker, out: SchedulerOutput) -> None:
        """Write the KV of every token this step computes."""
        for rid, n in out.num_scheduled_tokens.items():
            request = self.scheduler.requests[rid]
            start = request.num_computed_tokens - n  # already advanced by schedule()
            blocks = self.scheduler.kv_cache_manager.get_block_ids(rid)[0]
            tokens = request.all_token_ids
            for pos in range(start, start + n):
                gpu = blocks[pos // BLOCK_SIZE]
                for layer, tensor in enumerate(worker.kv):
                    tensor[gpu, :, pos % BLOCK_SIZE] = slot_value(
                        tokens[pos], pos, layer, worker.rank
                    )

    def step(self) -> SchedulerOutput:
        """Schedule, run every worker (loads, forward, stores), and feed back the output."""
        out = self.scheduler.schedule()
        self.outputs.append(out)
        meta = out.kv_connector_metadata
        for plan in (t.plan for t in getattr(meta, "group_loads", ())):
            self.loaded_tokens[plan.request_id] = (
                self.loaded_tokens.get(plan.request_id, 0) + plan.num_tokens
            )
        runner_outputs = []
        req_ids = list(out.num_scheduled_tokens)
        for worker in self.workers:
            conn = worker.connector
            conn.bind_connector_metadata(meta)
            conn.start_load_kv(None)
            self._forward(worker, out)
            conn.wait_for_save()
            kv_out = KVConnectorOutput(
                invalid_block_ids=conn.get_block_ids_with_load_errors(),
                kv_connector_worker_meta=None,
                kv_connector_stats=conn.get_kv_connector_stats(),  # as vLLM's runner
            )
            report = conn.build_connector_worker_meta()
            if worker.hold_reports:
                if report is not None:
                    worker.held.append(report)
            else:
                for held in worker.held:
                    report = held if report is None else held.aggregate(report)
                worker.held = []
                kv_out.kv_connector_worker_meta = report
            conn.clear_connector_metadata()
            runner_outputs.append(
                ModelRunnerOutput(
                    req_ids=req_ids,
                    req_id_to_index={r: i for i, r in enumerate(req_ids)},
                    sampled_token_ids=[[7 + i] for i in range(len(req_ids))],
                    kv_connector_output=kv_out,
                )
            )
        merged = self.aggregator.aggregate(runner_outputs)
        assert merged is not None
        self.record_stats(self.scheduler.update_from_output(out, merged))
        return out

    def drain_copies(self) -> None:
        """Let every worker's copies end (reports go out with the next step)."""
        for worker in self.workers:
            worker.connector.worker_side.wait_idle()  # type: ignore[union-attr]

    # -- checks ------------------------------------------------------------------------

    def wrong_slots(self, request: Request, upto: int | None = None) -> list[tuple[int, int]]:
        """``(position, rank)`` of every KV slot of ``request`` that holds the wrong value."""
        blocks = self.scheduler.kv_cache_manager.get_block_ids(request.request_id)[0]
        tokens = request.all_token_ids
        end = request.num_computed_tokens if upto is None else upto
        wrong = []
        for worker in self.workers:
            for pos in range(end):
                gpu = blocks[pos // BLOCK_SIZE]
                for layer, tensor in enumerate(worker.kv):
                    want = slot_value(tokens[pos], pos, layer, worker.rank)
                    if not bool((tensor[gpu, :, pos % BLOCK_SIZE] == want).all()):
                        wrong.append((pos, worker.rank))
                        break
        return wrong

    @property
    def pool(self) -> CpuBlockPool:
        """The CPU block pool of the model's one group."""
        return self.side.scheduler.ledger("g0").pool  # type: ignore[union-attr]

    def stats(self) -> SchedulerStatistics:
        """The scheduler side's whole-model counters."""
        own = self.side.statistics().scheduler  # type: ignore[union-attr]
        assert own is not None
        return own

    def check(self) -> None:
        """Every invariant of the CPU pool and of kvoffload's scheduler."""
        self.side.scheduler.check_invariants()  # type: ignore[union-attr]
