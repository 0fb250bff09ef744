"""How a `KVOffloader` is set up: its session, for one KV cache group or several.

`make_session()` turns the constructor's arguments into a `Session` over its `Front`:
one full-attention group's (the layout given or inferred, the pool sized and checked),
or several groups' (each group's layout and tensors keyed by its name); with the layout,
namespace and pool size the offloader reports.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, TypeVar

import torch

from kvoffload._front import GROUP, Front
from kvoffload._session import Session
from kvoffload.build import CorePlan, check_settings, plan_core
from kvoffload.config import KVLayout, OffloadConfig
from kvoffload.errors import ConfigError, InvalidInputError, LayoutMismatchError
from kvoffload.hashing import HashNamespace
from kvoffload.pinner import GpuBlockPinner, NoOpPinner
from kvoffload.transfer.engine import CopyEngine

if TYPE_CHECKING:
    from kvoffload.groups import KVCacheGroup

__all__ = ["make_session"]

_V = TypeVar("_V")


def _by_group(value: _V | Mapping[str, _V]) -> dict[str, _V]:
    """A per-group argument as a dict (a single value is refused with several groups)."""
    if not isinstance(value, Mapping):
        raise InvalidInputError(
            f"with several KV cache groups, give one value per group name, not a "
            f"{type(value).__name__}"
        )
    return dict(value)


def _one(value: _V | Mapping[str, _V] | None) -> _V | None:
    """A one-group argument: the value itself, or the one value of a mapping."""
    if isinstance(value, Mapping):
        if len(value) != 1:
            raise InvalidInputError(f"one KV cache group: give one value, got {sorted(value)}")
        return next(iter(value.values()))
    return value


def make_session(  # noqa: PLR0917 - the constructor's arguments, in its order
    config: OffloadConfig,
    gpu_kv: Sequence[torch.Tensor] | Mapping[str, Sequence[torch.Tensor]],
    layout: KVLayout | None,
    copy_engine: CopyEngine | Mapping[str, CopyEngine] | None,
    pinner: GpuBlockPinner | Mapping[str, GpuBlockPinner] | None,
    groups: Sequence[KVCacheGroup] | None,
) -> tuple[Session, KVLayout, HashNamespace, int]:
    """The session of a `KVOffloader`, its (first group's) layout, namespace and pool size.

    Several groups, or one that is not ``full``, make `Front.for_groups()`; one
    ``full`` group keeps one group's API (`Front.for_one_group()`): its layout (given,
    the group's, or inferred from 5-d K/V tensors), or, for a page with no K/V layout
    (an MLA latent), the page as opaque bytes (`page_layout()` with the group's block
    size). Either way the settings that path cannot honour are refused first
    (`check_settings()`).
    """
    if groups is not None and (len(groups) != 1 or groups[0].kind != "full"):
        return _several(
            config,
            groups,
            _by_group(gpu_kv),
            None if pinner is None else _by_group(pinner),
            None if copy_engine is None else _by_group(copy_engine),
        )
    check_settings(config, "offloader")
    kv: Sequence[torch.Tensor] | Mapping[str, Sequence[torch.Tensor]] | None = gpu_kv
    engine, pin = copy_engine, pinner
    if groups is not None:  # one full-attention group: the single-group offloader
        kv, engine, pin = _one(gpu_kv), _one(copy_engine), _one(pinner)
        layout = layout or groups[0].layout
        if layout is None and kv is not None and not isinstance(kv, Mapping):
            from kvoffload.groups import page_layout  # noqa: PLC0415 - groups only

            # opaque pages (an MLA latent): uint8 views, block_size tokens per block
            layout, kv = page_layout(groups[0], kv, block_size=groups[0].block_size)
    if (
        kv is None
        or isinstance(kv, Mapping)
        or isinstance(engine, Mapping)
        or isinstance(pin, Mapping)
    ):
        raise InvalidInputError(
            "gpu_kv, pinner and copy_engine take one value per group only with groups="
        )
    layout, plan = _plan_core(config, kv, layout, host_buffer=engine is None)
    namespace = HashNamespace.from_layout(layout, model_id=config.model_id, salt=config.hash_salt)
    session = Session(
        config,
        Front.for_one_group(plan, layout, namespace, None if groups is None else groups[0].name),
        {GROUP: layout},
        {GROUP: kv},
        {GROUP: pin if pin is not None else NoOpPinner()},
        None if engine is None else {GROUP: engine},
    )
    return session, layout, namespace, plan.num_cpu_blocks


def _several(
    config: OffloadConfig,
    groups: Sequence[KVCacheGroup],
    gpu_kv: Mapping[str, Sequence[torch.Tensor]],
    pinners: Mapping[str, GpuBlockPinner] | None,
    engines: Mapping[str, CopyEngine] | None,
) -> tuple[Session, KVLayout, HashNamespace, int]:
    """`make_session()` of several groups (or one that is not ``full``).

    Raises:
        ConfigError: groups refused by `check_groups()` (no cacheable group, names not
            unique, an alignment that allows no hit), a setting refused for them
            (`check_settings()`), tiers with copy engines given by the caller, a tensor,
            pinner or copy engine mapping that misses a group or names an unknown one,
            or a pool that does not fit (see `build_grouped_scheduler()`).
        LayoutMismatchError: a group's tensors disagree with it.
        HostMemoryError: the host buffers exceed the memory left.
    """
    from kvoffload.groups import check_groups, page_layout  # noqa: PLC0415 - groups only

    check_groups(groups)  # what the groups are comes before what a setting asks of them
    check_settings(config, "offloader_groups", groups=groups)
    if config.tiers and engines is not None:
        raise ConfigError(
            "tiers need the host buffers this offloader makes; they cannot be used with "
            f"a copy_engine given by the caller (groups {[g.name for g in groups]})"
        )
    cacheable = [g for g in groups if g.cacheable]
    names = {g.name for g in cacheable}
    for what, given in (("gpu_kv", gpu_kv), ("copy_engine", engines), ("pinner", pinners)):
        if given is not None and set(given) != names:
            raise ConfigError(
                f"{what} must name exactly the cacheable groups {sorted(names)}; missing "
                f"{sorted(names - set(given))}, unknown {sorted(set(given) - names)}"
            )
    layouts: dict[str, KVLayout] = {}
    kv: dict[str, list[torch.Tensor]] = {}
    for g in cacheable:
        layouts[g.name], kv[g.name] = page_layout(g, gpu_kv[g.name])
    num_gpu = {name: layouts[name].num_gpu_blocks(kv[name]) for name in layouts}
    front = Front.for_groups(config, groups, layouts, num_gpu, host_buffer=engines is None)
    session = Session(config, front, layouts, kv, pinners or {}, engines)
    first = cacheable[0].name
    return (
        session,
        layouts[first],
        front.namespaces[first],
        sum(front.pool_blocks().values()),
    )


def _plan_core(
    config: OffloadConfig,
    gpu_kv: Sequence[torch.Tensor],
    layout: KVLayout | None,
    *,
    host_buffer: bool,
) -> tuple[KVLayout, CorePlan]:
    """The layout of ``gpu_kv`` (inferred when ``None``) and the core sized for it.

    Raises:
        LayoutMismatchError: the tensors disagree with ``layout`` or with each other, or
            hold no GPU block.
        ConfigError, HostMemoryError: see `plan_core()`.
    """
    if layout is None:
        layout = KVLayout.from_tensors(gpu_kv, block_size=config.block_size)
    num_gpu_blocks = layout.num_gpu_blocks(gpu_kv)
    if num_gpu_blocks < 1:
        raise LayoutMismatchError(
            f"the KV tensors hold no GPU block (shape {tuple(gpu_kv[0].shape)})"
        )
    return layout, plan_core(config, layout, num_gpu_blocks=num_gpu_blocks, host_buffer=host_buffer)
