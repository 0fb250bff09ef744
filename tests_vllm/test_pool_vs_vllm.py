"""scripts/pool_vs_vllm_instructions.py replays the same requests through both pools: vLLM's
``BlockPool`` reaches the hits `CpuBlockPool` reaches, block for block."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TRACE = Path(
    os.environ.get(
        "KVOFFLOAD_TEST_TRACE", ROOT.parent / "shared" / "traces" / "synthetic_trace.jsonl"
    )
)

sys.path.insert(0, str(ROOT / "scripts"))

from pool_vs_vllm_instructions import new_vllm_pool, replay_vllm  # noqa: E402

from kvoffload.bench.pool import load_trace_keys, replay  # noqa: E402
from kvoffload.pool.block_pool import CpuBlockPool  # noqa: E402


@pytest.mark.parametrize("capacity", [64, 400])
def test_both_pools_reach_the_same_hits(capacity: int) -> None:
    if not TRACE.is_file():
        pytest.skip(f"trace not found at {TRACE}")
    keys = load_trace_keys(TRACE)[:120]
    ours = replay(CpuBlockPool(capacity), keys)
    theirs = replay_vllm(new_vllm_pool(capacity), keys)
    assert theirs == ours
    assert 0 < ours.hit_blocks < ours.total_blocks
