"""One way to build the core: `build_core()` and `plan_core()`.

Every entry point builds the CPU block pool (with its eviction policy) and the
`OffloadScheduler` (with its store admission filter) here, from one `OffloadConfig`:
`KVOffloader`, and the scheduler side of the vLLM connector. So a setting reaches the same
objects whichever way kvoffload is embedded.

`plan_core()` sizes the pool and checks that it fits in the memory this process can still
use, before anything is allocated; `CorePlan.build()` then builds it (a large pool takes a
while: `KVOffloader` builds one above `INLINE_POOL_BLOCKS` blocks in a worker thread).

Each `OffloadConfig` field is read by exactly one kind of part, listed in `CORE_FIELDS`,
`TIER_FIELDS` and `ENTRY_POINT_FIELDS`. Which fields each entry point cannot honour yet is
`REFUSED`, checked by `check_settings()` when that entry point is built: no setting is
silently ignored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, final

from kvoffload.config import KVLayout, OffloadConfig
from kvoffload.errors import ConfigError, HostMemoryError
from kvoffload.pool.block_pool import CpuBlockPool
from kvoffload.pool.priority import default_max_retained
from kvoffload.scheduler import OffloadScheduler
from kvoffload.storage.host_buffer import available_host_memory
from kvoffload.tiers.build import build_tier
from kvoffload.tiers.manager import TierManager

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from kvoffload.groups import KVCacheGroup
    from kvoffload.hashing import HashNamespace
    from kvoffload.pool.policies import EvictionPolicy
    from kvoffload.scheduler.groups import GroupedScheduler
    from kvoffload.storage.host_buffer import HostKVBuffer

__all__ = [
    "CORE_FIELDS",
    "ENTRY_POINTS",
    "ENTRY_POINT_FIELDS",
    "GROUP_FIELDS",
    "INLINE_POOL_BLOCKS",
    "POOL_BOOKKEEPING_BYTES_PER_BLOCK",
    "REFUSED",
    "TIER_FIELDS",
    "Core",
    "CorePlan",
    "EntryPoint",
    "build_core",
    "build_grouped_scheduler",
    "build_tiers",
    "check_host_memory",
    "check_settings",
    "grouped_pool_sizes",
    "lazy_refusal",
    "plan_core",
]

POOL_BOOKKEEPING_BYTES_PER_BLOCK = 144
"""Python memory the CPU block pool needs per block, rounded up (about 128 bytes measured:
see ``python -m kvoffload.bench pool``), counted with the host buffer before anything is
allocated."""

INLINE_POOL_BLOCKS = 1 << 16
"""`KVOffloader` builds pools up to this many blocks at once, larger ones in a worker
thread on entering ``async with``."""

CORE_FIELDS: frozenset[str] = frozenset(
    {
        # the pool: its size, eviction policy, events and retention bound
        "num_cpu_blocks",
        "cpu_bytes",
        "eviction_policy",
        "enable_events",
        "max_retained_fraction",
        # the scheduler: it reads these from the config it is given
        "block_size",
        "store_mode",
        "lazy_offload_blocks",
        "restore_evicted",
        "max_store_blocks_per_step",
        "store_admission",
        "hold_blocks_on_finish",
        "hold_max_blocks",
        "hold_max_steps",
    }
)
"""The `OffloadConfig` fields that configure the core (pool, policy, admission, scheduler):
`build_core()` hands them on, the same way for every entry point."""

GROUP_FIELDS: frozenset[str] = frozenset({"checkpoint_tokens"})
"""The `OffloadConfig` fields only a model with several KV cache groups reads
(`build_grouped_scheduler()`)."""

TIER_FIELDS: frozenset[str] = frozenset({"tiers", "max_prefetch_fraction"})
"""The `OffloadConfig` fields that configure the secondary tiers (`build_tiers()`)."""

ENTRY_POINT_FIELDS: frozenset[str] = frozenset(
    {"pin_memory", "pin_chunk_bytes", "poll_interval_s", "model_id", "hash_salt"}
)
"""The `OffloadConfig` fields the entry point reads itself, not the core: the host buffer's
pinning, the completion poller's interval, and the hash namespace."""


EntryPoint = Literal["offloader", "offloader_groups", "vllm", "vllm_groups"]
"""The ways kvoffload is embedded, as `check_settings()` names them."""

ENTRY_POINTS: dict[EntryPoint, str] = {
    "offloader": "KVOffloader with one full-attention group",
    "offloader_groups": "KVOffloader with several KV cache groups",
    "vllm": "the vLLM connector",
    "vllm_groups": "the vLLM connector with several KV cache groups",
}
"""Each entry point, as error messages name it."""

_VLLM_GROUPS_EAGER = (
    "the connector stores a model with several KV cache groups eagerly: vLLM gives several "
    "groups mostly to hybrid models, whose sliding-window, chunked or recurrent group "
    "refuses lazy stores anyway (kvoffload.build.lazy_refusal()), and lazy stores of "
    "several full-attention groups are not tested with vLLM yet (KVOffloader stores "
    "them lazily)"
)


def lazy_refusal(groups: Sequence[KVCacheGroup]) -> str:
    """Why ``store_mode="lazy"`` is refused for these groups, group by group (``""``:
    every cacheable group is full attention, and lazy stores work;
    `kvoffload.scheduler.group_stores.LAZY_BY_KIND` says why for each other kind)."""
    from kvoffload.scheduler.group_stores import lazy_refusal as refusal  # noqa: PLC0415

    return refusal(groups)


_GROUPS_ONLY = (
    "it spaces the store points of a model with several KV cache groups; one "
    "full-attention group stores every full block"
)
_VLLM_NO_HOLDS = (
    "vLLM frees a finished request's GPU blocks at once (request_finished), so the "
    "connector cannot hold them (hold_blocks_on_finish) for now"
)
_VLLM_NO_RETAIN = "the connector has no retain_prefix(), the only reader of this bound"
_VLLM_NO_PREFETCH = "the connector has no prefetch(), the only reader of this bound"

REFUSED: dict[EntryPoint, dict[str, str]] = {
    "offloader": {"checkpoint_tokens": _GROUPS_ONLY},
    "offloader_groups": {},
    "vllm": {
        "checkpoint_tokens": _GROUPS_ONLY,
        "hold_blocks_on_finish": _VLLM_NO_HOLDS,
        "hold_max_blocks": _VLLM_NO_HOLDS,
        "hold_max_steps": _VLLM_NO_HOLDS,
        "max_retained_fraction": _VLLM_NO_RETAIN,
        "max_prefetch_fraction": _VLLM_NO_PREFETCH,
    },
    "vllm_groups": {
        "checkpoint_tokens": "the connector puts a store point at every multiple of the "
        "groups' hit alignment (a recurrent state is in vLLM's table only right after the "
        "step that computed it), so it cannot space them otherwise",
        "store_mode": _VLLM_GROUPS_EAGER,
        "lazy_offload_blocks": "a setting of store_mode='lazy': " + _VLLM_GROUPS_EAGER[4:],
        "hold_blocks_on_finish": _VLLM_NO_HOLDS,
        "hold_max_blocks": _VLLM_NO_HOLDS,
        "hold_max_steps": _VLLM_NO_HOLDS,
        "max_retained_fraction": _VLLM_NO_RETAIN,
        "max_prefetch_fraction": _VLLM_NO_PREFETCH,
    },
}
"""Per entry point, the `OffloadConfig` fields it cannot honour and why: `check_settings()`
refuses each one set to anything but its default. Every other field is honoured there."""


def _shown(config: OffloadConfig, name: str) -> str:
    value = getattr(config, name)
    if name == "tiers":  # names only: a tier URL may hold a password
        return f"tiers=[{', '.join(t.name or t.kind for t in value)}]"
    return f"{name}={value!r}"


def check_settings(
    config: OffloadConfig,
    entry_point: EntryPoint,
    *,
    groups: Sequence[KVCacheGroup] = (),
    refused: Mapping[str, str] | None = None,
) -> None:
    """Refuse the settings ``entry_point`` cannot honour (`REFUSED`), unless at their default.

    With ``groups`` (``offloader_groups``), a ``block_size`` other than the default must
    be every cacheable group's (each group has its own; `KVCacheGroup.block_size`), and
    lazy stores are refused unless every cacheable group is full attention, saying why
    for each other group's kind (`lazy_refusal()`).
    ``refused`` checks only those of ``entry_point``'s fields (a check made before the
    model is known).

    Raises:
        ConfigError: naming each such setting and its value, the entry point and why.
    """
    fields = OffloadConfig.model_fields
    if refused is None:
        refused = REFUSED[entry_point]
    lazy = lazy_refusal(groups) if groups and "store_mode" not in refused else ""
    if lazy:  # say why for each group that is not full attention, once
        why = f"lazy stores walk each full-attention group's eviction order of GPU blocks: {lazy}"
        alone = config.store_mode == fields["store_mode"].default
        refused = {
            **refused,
            "store_mode": why,
            "lazy_offload_blocks": "a setting of store_mode='lazy', refused with these groups"
            + (f": {why}" if alone else " (see store_mode)"),
        }
    wrong = [
        f"{_shown(config, name)} ({why})"
        for name, why in refused.items()
        if getattr(config, name) != fields[name].default
    ]
    sizes = sorted({g.block_size for g in groups if g.cacheable})
    if sizes and config.block_size != fields["block_size"].default and sizes != [config.block_size]:
        wrong.append(
            f"block_size={config.block_size!r} (each KV cache group has its own block size, "
            f"here {sizes}: set it on the KVCacheGroup)"
        )
    if wrong:
        raise ConfigError(
            f"{ENTRY_POINTS[entry_point]} cannot honour {'; '.join(wrong)}: leave "
            f"{'it' if len(wrong) == 1 else 'them'} out"
        )


@final
@dataclass(frozen=True, slots=True)
class Core:
    """The built core: the CPU block pool and the scheduler that owns its references.

    The eviction policy is attached to the pool (`policy`); the store admission filter is
    the scheduler's, made from ``config.store_admission``.
    """

    pool: CpuBlockPool
    scheduler: OffloadScheduler

    @property
    def policy(self) -> EvictionPolicy:
        """The pool's eviction policy (``config.eviction_policy``)."""
        return self.pool.policy


@final
@dataclass(frozen=True, slots=True)
class CorePlan:
    """A core sized and checked against the memory left, not built yet (`plan_core()`)."""

    config: OffloadConfig
    num_cpu_blocks: int
    """CPU blocks of the pool."""
    bytes_per_block: int
    """Bytes one CPU block stands for, for the scheduler's byte counters."""
    num_gpu_blocks: int | None
    """The engine's GPU block count (``None``: block ids are only checked to be >= 0)."""

    @property
    def builds_inline(self) -> bool:
        """Whether the pool is small enough to build on the event loop's thread."""
        return self.num_cpu_blocks <= INLINE_POOL_BLOCKS

    def build(self) -> Core:
        """Build the pool (policy, events and retention bound from the config) and its
        scheduler."""
        config = self.config
        pool = make_pool(config, self.num_cpu_blocks)
        scheduler = OffloadScheduler(
            config,
            pool,
            bytes_per_block=self.bytes_per_block,
            num_gpu_blocks=self.num_gpu_blocks,
        )
        return Core(pool, scheduler)


def make_pool(config: OffloadConfig, num_blocks: int) -> CpuBlockPool:
    """A CPU block pool of ``num_blocks`` with the config's eviction policy, events and
    retention bound (``max_retained_fraction``)."""
    return CpuBlockPool(
        num_blocks,
        enable_events=config.enable_events,
        policy=config.eviction_policy,
        max_retained_blocks=default_max_retained(num_blocks, config.max_retained_fraction),
    )


def plan_core(
    config: OffloadConfig,
    layout: KVLayout,
    *,
    num_gpu_blocks: int | None = None,
    world_size: int = 1,
    host_buffer: bool,
) -> CorePlan:
    """Size the core for ``layout`` and check that it fits in memory; build nothing yet.

    Args:
        config: the settings.
        layout: one CPU block's geometry (with ``world_size > 1``, one rank's shard).
        num_gpu_blocks: the engine's GPU block count, when known.
        world_size: ranks that each hold a shard of every block (the byte counters count
            all of them).
        host_buffer: whether this process also allocates the host buffer (its bytes are
            counted with the pool's bookkeeping).

    Raises:
        ConfigError: the pool size or block size does not fit the layout.
        HostMemoryError: see `check_host_memory()`.
    """
    num_cpu_blocks = config.resolve_num_cpu_blocks(layout)
    check_host_memory(num_cpu_blocks, layout, host_buffer=host_buffer)
    return CorePlan(
        config,
        num_cpu_blocks,
        bytes_per_block=layout.bytes_per_block * world_size,
        num_gpu_blocks=num_gpu_blocks,
    )


def build_core(
    config: OffloadConfig,
    layout: KVLayout,
    *,
    num_gpu_blocks: int | None = None,
    world_size: int = 1,
    host_buffer: bool,
) -> Core:
    """`plan_core()`, then build the core at once. Same arguments and errors."""
    return plan_core(
        config,
        layout,
        num_gpu_blocks=num_gpu_blocks,
        world_size=world_size,
        host_buffer=host_buffer,
    ).build()


def build_grouped_scheduler(
    config: OffloadConfig,
    groups: Sequence[KVCacheGroup],
    *,
    checkpoint_tokens: int | None = None,
    num_gpu_blocks: Mapping[str, int] | None = None,
) -> GroupedScheduler:
    """The `GroupedScheduler` of a multi-group model, one pool per cacheable group.

    With ``config.cpu_bytes``, the bytes are split by need (`split_capacity()`: a
    group's ``cpu_bytes`` or ``cpu_share`` overrides its share); with
    ``config.num_cpu_blocks``, every cacheable group gets that many blocks. Each pool
    takes ``config.eviction_policy`` and ``config.enable_events``; the scheduler takes
    ``config.max_store_blocks_per_step`` and ``config.store_admission`` (per group pool:
    `GroupedScheduler`). ``checkpoint_tokens``
    (default ``config.checkpoint_tokens``, then `default_checkpoint_tokens()`) spaces the
    store points. The group code is imported here, on first use: a single-group model
    never loads it.

    Raises:
        ConfigError: a group would get less than one block, the overrides exceed
            ``cpu_bytes``, or the groups, ``checkpoint_tokens`` or
            ``max_store_blocks_per_step`` are refused by `GroupedScheduler`.
    """
    from kvoffload.groups import default_checkpoint_tokens  # noqa: PLC0415
    from kvoffload.scheduler.groups import GroupedScheduler  # noqa: PLC0415

    if checkpoint_tokens is None:
        checkpoint_tokens = config.checkpoint_tokens
    if checkpoint_tokens is None:
        checkpoint_tokens = default_checkpoint_tokens(groups)
    sizes = grouped_pool_sizes(config, groups, checkpoint_tokens)
    pools = {name: make_pool(config, n) for name, n in sizes.items()}
    return GroupedScheduler(
        groups,
        pools,
        checkpoint_tokens=checkpoint_tokens,
        num_gpu_blocks=num_gpu_blocks,
        config=config,
    )


def grouped_pool_sizes(
    config: OffloadConfig, groups: Sequence[KVCacheGroup], checkpoint_tokens: int
) -> dict[str, int]:
    """CPU blocks per cacheable group, as `build_grouped_scheduler()` sizes its pools
    (an engine that allocates a host buffer per group elsewhere sizes it with this).

    Raises:
        ConfigError: as `split_capacity()`.
    """
    from kvoffload.groups import split_capacity  # noqa: PLC0415

    if config.num_cpu_blocks is not None:
        return {g.name: config.num_cpu_blocks for g in groups if g.cacheable}
    # the config holds exactly one of the two
    return split_capacity(groups, int(config.cpu_bytes or 0), checkpoint_tokens)


def check_host_memory(num_blocks: int, layout: KVLayout, *, host_buffer: bool) -> None:
    """Refuse a pool whose host buffer and bookkeeping exceed the memory left.

    Args:
        num_blocks: CPU blocks of the pool.
        layout: one CPU block's geometry.
        host_buffer: count the host buffer too (``num_blocks * layout.bytes_per_block``);
            otherwise only the bookkeeping (`POOL_BOOKKEEPING_BYTES_PER_BLOCK` per block).

    Raises:
        HostMemoryError: the total exceeds what this process can still use (MemAvailable
            and the cgroup limit; not checked where neither can be read).
    """
    available = available_host_memory()
    if available is None:
        return
    host = num_blocks * layout.bytes_per_block if host_buffer else 0
    bookkeeping = num_blocks * POOL_BOOKKEEPING_BYTES_PER_BLOCK
    if host + bookkeeping > available:
        raise HostMemoryError(
            f"a CPU pool of {num_blocks} blocks needs {host} bytes of host buffer "
            f"({layout.bytes_per_block} per block) and about {bookkeeping} bytes of "
            f"bookkeeping ({POOL_BOOKKEEPING_BYTES_PER_BLOCK} per block), {host + bookkeeping} "
            f"in all, but this process can still use {available} bytes (MemAvailable and the "
            "cgroup limit); lower num_cpu_blocks or cpu_bytes"
        )


def build_tiers(
    config: OffloadConfig,
    layout: KVLayout,
    scheduler: OffloadScheduler,
    host: HostKVBuffer | None,
    namespace: HashNamespace,
) -> TierManager:
    """The tier manager for ``config.tiers`` over a built core (tiers not opened yet).

    Args:
        config: the settings.
        layout: one CPU block's geometry.
        scheduler: the core's scheduler.
        host: the host buffer the tiers read and write (``None``: the caller gave its own
            copy engine, and tiers cannot be used).
        namespace: the hash namespace; its root namespaces every tier's keys.

    Raises:
        ConfigError: no host buffer, or a tier's settings do not fit (see `build_tier()`).
    """
    if host is None:
        raise ConfigError(
            "tiers need the host buffer this offloader makes; they cannot be used with "
            "a copy_engine given by the caller"
        )
    digest = namespace.root
    nbytes = layout.bytes_per_block
    tiers = [
        (build_tier(s, i, namespace=digest, block_nbytes=nbytes), s)
        for i, s in enumerate(config.tiers)
    ]
    return TierManager(
        tiers,
        scheduler=scheduler,
        host=host,
        namespace=digest,
        max_prefetch_fraction=config.max_prefetch_fraction,
    )
