"""A `KVOffloadConnector` whose CPU copies fail on a schedule, for end-to-end tests.

vLLM loads it by module path (``kv_connector_module_path="faulty_connector"``).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

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
