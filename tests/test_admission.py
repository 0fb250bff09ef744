"""Admission filters: counting offers within a window, bounded memory, the scheduler hook."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffload import KVLayout, KVOffloader
from kvoffload.config import OffloadConfig
from kvoffload.errors import ConfigError
from kvoffload.hashing import BlockHash
from kvoffload.pool.policies.admission import (
    AdmissionFilter,
    AlwaysAdmit,
    SeenCountAdmission,
    make_admission,
    parse_admission,
)
from tests.scheduler_helpers import BS, hashes, make, run_request, tokens


def h(i: int) -> BlockHash:
    return BlockHash(i.to_bytes(8, "little"))


def test_specs() -> None:
    assert parse_admission("always") is None
    assert parse_admission(" Seen_Twice ") == (2, 100_000)
    assert parse_admission("seen:3") == (3, 100_000)
    assert parse_admission("seen:3:50") == (3, 50)
    for bad in ("", "twice", "seen:0", "seen:2:0", "seen:x", "seen:2:1:1"):
        with pytest.raises(ValueError, match="unknown store admission"):
            parse_admission(bad)
    assert isinstance(make_admission("always"), AlwaysAdmit)
    f = make_admission("seen:4:9")
    assert isinstance(f, SeenCountAdmission)
    assert isinstance(f, AdmissionFilter)
    assert (f.threshold, f.window, f.name) == (4, 9, "seen:4:9")
    with pytest.raises(ConfigError, match="seen_twice"):
        make_admission("nope")


def test_second_offer_within_the_window_is_admitted() -> None:
    f = SeenCountAdmission(2, window=3)
    assert not f.admit(h(1))
    assert f.admit(h(1))  # second offer
    assert not f.admit(h(1))  # admitted hashes are forgotten: it must earn its place again
    assert not f.admit(h(2))
    for i in range(3, 6):
        assert not f.admit(h(i))
    assert not f.admit(h(2))  # its first offer fell out of the 3-offer window


@settings(max_examples=100, deadline=None)
@given(
    offers=st.lists(st.integers(0, 20), max_size=200),
    threshold=st.integers(1, 4),
    window=st.integers(1, 30),
)
def test_matches_a_sliding_window_model_with_bounded_memory(
    offers: list[int], threshold: int, window: int
) -> None:
    f = SeenCountAdmission(threshold, window)
    history: list[int] = []  # the offers since each hash was last admitted
    admitted_at: dict[int, int] = {}
    for t, key in enumerate(offers):
        # the model: offers of `key` among the last `window` offers, counting only a run of
        # offers each within `window` of the previous one, since it was last admitted
        history.append(key)
        got = f.admit(h(key))
        assert len(f) <= window
        recent = [i for i in range(admitted_at.get(key, -1) + 1, t + 1) if history[i] == key]
        run = 1
        for a, b in zip(recent[::-1], recent[-2::-1], strict=False):
            if a - b >= window:
                break
            run += 1
        expected = run >= threshold
        assert got == expected, (t, key, recent)
        if got:
            admitted_at[key] = t


def test_config_fields_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    c = OffloadConfig(num_cpu_blocks=8)
    assert (c.eviction_policy, c.store_admission) == ("lru", "always")
    monkeypatch.setenv("KVOFFLOAD_EVICTION_POLICY", "S3FIFO")
    monkeypatch.setenv("KVOFFLOAD_STORE_ADMISSION", "seen:3:1000")
    c = OffloadConfig(num_cpu_blocks=8)
    assert (c.eviction_policy, c.store_admission) == ("s3fifo", "seen:3:1000")
    with pytest.raises(
        ConfigError, match=r"eviction_policy \(env KVOFFLOAD_EVICTION_POLICY\).*lru, arc"
    ):
        OffloadConfig(num_cpu_blocks=8, eviction_policy="fifo")
    with pytest.raises(ConfigError, match=r"store_admission .*'sometimes'"):
        OffloadConfig(num_cpu_blocks=8, store_admission="sometimes")


def test_scheduler_stores_a_block_on_its_second_offer() -> None:
    sched = make(16, store_admission="seen_twice")
    toks = tokens(1, 3, extra=1)
    assert run_request(sched, "a", toks, [0, 1, 2]) is None  # first offer: nothing stored
    assert sched.lookup("b", hashes(toks), len(toks)) == 0
    sched.release("b")
    plan = run_request(sched, "c", toks, [3, 4, 5])  # second offer: stored
    assert plan is not None
    assert plan.block_hashes == tuple(hashes(toks))
    assert sched.lookup("d", hashes(toks), len(toks)) == 3 * BS
    sched.check_invariants()


def test_undo_voids_the_offers_of_a_cancelled_store() -> None:
    f = SeenCountAdmission(2, window=100)
    assert not f.admit(h(1))
    assert f.admit(h(1))  # admitted for a store that is then undone
    assert not f.admit(h(2))  # refused while the same store was built
    f.undo([h(1)], [h(2)])
    assert f.admit(h(1))  # its admission was not spent
    assert not f.admit(h(2))  # the voided offer does not count: this is its first again
    assert f.admit(h(2))
    AlwaysAdmit().undo([h(1)], [h(2)])  # nothing to undo, and no error


def test_scheduler_cancel_plans_the_same_store_again() -> None:
    sched = make(16, store_admission="seen_twice")
    toks = tokens(1, 3, extra=1)
    assert run_request(sched, "a", toks, [0, 1, 2]) is None  # first offer
    sched.update("c", [3, 4, 5], hashes(toks), len(toks))
    plan = sched.plan_stores()  # second offer: admitted
    assert plan is not None
    assert sched.cancel(plan)  # e.g. the engine's pinner raised
    again = sched.plan_stores()
    assert again is not None
    assert again.block_hashes == plan.block_hashes
    sched.check_invariants()


def test_offloader_pool_uses_the_configured_policy() -> None:
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_size=4, dtype="float32", block_size=BS)
    gpu = [torch.zeros(layout.tensor_shape(4))]
    config = OffloadConfig(
        block_size=BS, num_cpu_blocks=4, eviction_policy="arc", pin_memory="never"
    )
    off = KVOffloader(config, gpu_kv=gpu)
    assert off.pool.policy.name == "arc"
