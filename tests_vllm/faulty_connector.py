"""Subclasses of `KVOffloadConnector` whose CPU copies fail on a schedule, or whose loads deliver
wrong bytes for one group, for end-to-end tests.

vLLM loads it by module path (``kv_connector_module_path="faulty_connector"``).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch

from kvoffload.integrations.vllm import KVOffloadConnector
from kvoffload.transfer.plan import TransferPlan

FAIL_EVERY = 3
"""Per direction, copy number k (0-based) fails when k % FAIL_EVERY == 1 (each direction
runs its copies in submission order on one worker thread, so the schedule is fixed)."""

failures: dict[str, int] = {"load": 0, "store": 0}


class FaultyKVOffloadConnector(KVOffloadConnector):
    """Fails every third copy of each direction in the worker thread, as a broken device
    or bus would."""

    def _copy_hook(self) -> Callable[[TransferPlan], None]:
        counters = {"load": itertools.count(), "store": itertools.count()}

        def hook(plan: TransferPlan) -> None:
            k = next(counters[plan.kind])
            if k % FAIL_EVERY == 1:
                failures[plan.kind] += 1
                raise OSError(f"injected failure of copy {k} ({plan.kind} plan {plan.plan_id})")

        return hook


corrupt: dict[str, int | None] = {"group": None, "loads": 0}
"""``group``: the vLLM group id whose loaded blocks `CorruptingKVOffloadConnector` overwrites
after each load (``None``: none); ``loads``: how many group loads it corrupted."""


class CorruptingKVOffloadConnector(KVOffloadConnector):
    """Overwrites the first loaded block of one group (``corrupt["group"]``) with garbage
    right after the step's loads, as a copy that silently delivered wrong bytes would: a
    negative control for the end-to-end checks."""

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        super().start_load_kv(forward_context, **kwargs)
        worker = self.worker_side
        meta = getattr(worker, "_meta", None)
        group = corrupt["group"]
        if worker is None or meta is None or group is None:
            return
        for transfer in meta.group_loads:
            if transfer.group == group and transfer.plan.gpu_block_ids:
                block = transfer.plan.gpu_block_ids[0]
                for view in worker.groups[group].views:
                    page = view[block]
                    page.copy_(torch.randint_like(page, 0, 255))
                corrupt["loads"] += 1
