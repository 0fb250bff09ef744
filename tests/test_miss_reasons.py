"""Every lookup says why its hit stopped (`MissReason`): each reason from a scenario that
can only produce it, with one KV cache group and with several, and the statistics agree
with a tally kept here."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
from prometheus_client import CollectorRegistry

from kvoffload import MissReason, OffloadScheduler
from kvoffload.metrics import OffloaderCollector
from tests.groups_helpers import Rig, group
from tests.scheduler_helpers import hashes, make, run_request, tokens
from tests.test_groups import FULL4, Tables, _store_prompt
from tests.test_groups import tokens as group_tokens
from tests.test_metrics import fake_statistics, scrape

R = MissReason


class Tally:
    """Looks up through the scheduler and counts each reason as the test sees it."""

    def __init__(self, sched: OffloadScheduler) -> None:
        self.sched = sched
        self.lookups: Counter[MissReason] = Counter()
        self.tokens: Counter[MissReason] = Counter()

    def lookup(self, rid: str, toks: list[int], computed: int = 0, **kw: bool) -> MissReason:
        hit = self.sched.lookup(rid, hashes(toks), len(toks), computed, **kw)
        reason = self.sched.request_state(rid).miss_reason
        missed = len(toks) - computed - hit
        if reason is not R.NONE:
            self.lookups[reason] += 1
            self.tokens[reason] += missed
        else:
            assert missed == 0
        self.sched.release(rid)
        self.sched.check_invariants()
        return reason

    def check(self) -> None:
        stats = self.sched.statistics()
        assert dict(stats.lookup_misses) == dict(self.lookups)
        assert dict(stats.miss_reason_tokens) == dict(self.tokens)
        assert sum(stats.miss_reason_tokens.values()) == stats.miss_tokens


def test_each_reason_from_a_scenario_that_only_it_explains() -> None:
    t = Tally(make(16))
    assert t.lookup("new", tokens(1, 3)) is R.NEVER_STORED
    assert t.lookup("unread", tokens(1, 3), no_read=True) is R.NOT_READ
    assert t.lookup("all-computed", tokens(1, 3), computed=12) is R.NONE
    run_request(t.sched, "a", tokens(1, 3), [0, 1, 2])
    # 12 tokens: blocks 0 and 1 hit; block 2 holds the last token, never loaded
    assert t.lookup("b", tokens(1, 3)) is R.LAST_TOKEN
    run_request(t.sched, "c", tokens(2, 3, extra=2), [3, 4, 5])
    # 14 tokens: every full block hits; the 2-token tail is not a block
    assert t.lookup("d", tokens(2, 3, extra=2)) is R.BOUNDARY
    t.sched.update("e", [6, 7, 8], hashes(tokens(3, 3)), 12)
    plan = t.sched.plan_stores()
    assert plan is not None
    assert t.lookup("f", tokens(3, 3)) is R.IN_FLIGHT  # its store is not complete yet
    t.sched.complete(plan, ok=True)
    assert t.lookup("g", tokens(3, 3)) is R.LAST_TOKEN
    t.check()


def test_evicted_is_told_from_never_stored_as_far_back_as_the_pool_size() -> None:
    t = Tally(make(4))
    run_request(t.sched, "a", tokens(1, 3), [0, 1, 2])
    run_request(t.sched, "b", tokens(2, 4), [3, 4, 5, 6])  # evicts a's three blocks
    assert t.lookup("a2", tokens(1, 3)) is R.EVICTED
    # the memory holds the pool's last 4 evictions: 8 more push a's blocks out of it
    run_request(t.sched, "c", tokens(3, 4), [7, 8, 9, 10])
    run_request(t.sched, "d", tokens(4, 4), [11, 12, 13, 14])
    assert t.lookup("a3", tokens(1, 3)) is R.NEVER_STORED
    assert t.lookup("c2", tokens(3, 4)) is R.EVICTED
    t.check()


def test_a_store_cut_by_the_step_limit_reads_store_skipped() -> None:
    t = Tally(make(16, max_store_blocks_per_step=1))
    t.sched.update("a", [0, 1, 2], hashes(tokens(1, 3)), 12)
    plan = t.sched.plan_stores()  # one block; the other two are deferred
    assert plan is not None
    assert plan.num_blocks == 1
    t.sched.complete(plan, ok=True)
    t.sched.finish("a")
    assert t.lookup("b", tokens(1, 3)) is R.STORE_SKIPPED
    t.check()


def test_the_handle_and_a_reset_report_the_reason() -> None:
    sched = make(4)
    run_request(sched, "a", tokens(1, 3), [0, 1, 2])
    run_request(sched, "b", tokens(2, 4), [3, 4, 5, 6])
    assert sched.lookup("x", hashes(tokens(1, 3)), 12) == 0
    assert sched.request_state("x").miss_reason is R.EVICTED
    sched.release("x")
    assert sched.reset()
    sched.lookup("y", hashes(tokens(1, 3)), 12)
    assert sched.request_state("y").miss_reason is R.NEVER_STORED  # a reset forgets


# -- several KV cache groups ---------------------------------------------------------------


def test_groups_each_reason_and_the_group_blamed() -> None:
    sw = group("win", "sliding_window", 6, window=13)
    rig = Rig([FULL4, sw], checkpoint_tokens=24)
    sched = rig.sched
    h = rig.hashes(group_tokens(60))
    assert sched.lookup("new", h, 60) == 0
    assert sched.miss_reason("new") is R.NEVER_STORED
    _store_prompt(rig, "a", 48)
    assert sched.lookup("b", h, 60) == 48
    assert sched.miss_reason("b") is R.LAST_TOKEN  # 60 would cover the last token
    # 47 tokens: the full group holds 36, the window group stores only at 24 and 48
    assert sched.lookup("c", h, 47) == 24
    assert sched.miss_reason("c") is R.BOUNDARY
    sched.release("b")
    sched.release("c")
    stats = sched.statistics()
    assert dict(stats["attn"].lookup_misses) == {R.NEVER_STORED: 1}
    assert dict(stats["win"].lookup_misses) == {R.BOUNDARY: 1}
    sched.check_invariants()


def test_groups_in_flight_and_group_missing() -> None:
    sw = group("win", "sliding_window", 4, window=9)
    rig = Rig([FULL4, sw], checkpoint_tokens=16)
    tabs = Tables(rig, 16)
    rig.fill(tabs.t)
    h = rig.hashes(group_tokens(17))
    rig.sched.update("a", tabs.t, {k: v[:4] for k, v in h.items()}, 16)
    plan = rig.sched.plan_stores()
    assert plan is not None
    rig.sched.complete("attn", plan.plans["attn"], True)
    assert rig.sched.lookup("b", h, 17) == 0
    assert rig.sched.miss_reason("b") is R.IN_FLIGHT  # the window group's store runs
    rig.sched.complete("win", plan.plans["win"], True)
    # the window group's block is dropped (not an eviction the pool remembers)
    block = rig.pools["win"].get_cached(h["win"][3])
    assert block is not None
    rig.pools["win"].unpublish(block)
    assert rig.sched.lookup("c", h, 17) == 0
    assert rig.sched.miss_reason("c") is R.GROUP_MISSING
    rig.sched.release("c")
    stats = rig.sched.statistics()
    assert dict(stats["win"].lookup_misses) == {R.IN_FLIGHT: 1, R.GROUP_MISSING: 1}
    assert not stats["attn"].lookup_misses
    rig.sched.check_invariants()


def test_groups_unknown_request_is_refused() -> None:
    rig = Rig([FULL4, group("win", "sliding_window", 4, window=9)], checkpoint_tokens=16)
    with pytest.raises(Exception, match="nope"):
        rig.sched.miss_reason("nope")


def test_miss_reason_values_are_stable_labels() -> None:
    assert [r.value for r in MissReason] == [
        "none",
        "not_read",
        "last_token",
        "boundary",
        "in_flight",
        "tier_failed",
        "evicted",
        "store_skipped",
        "group_missing",
        "never_stored",
    ]


def test_prometheus_exports_the_counts_the_test_tallied() -> None:
    t = Tally(make(4))
    t.lookup("new", tokens(1, 3))
    run_request(t.sched, "a", tokens(1, 3), [0, 1, 2])
    run_request(t.sched, "b", tokens(2, 4), [3, 4, 5, 6])
    t.lookup("a2", tokens(1, 3))
    t.lookup("b2", tokens(2, 4))
    stats = dataclasses.replace(
        fake_statistics(0, tiers=False), scheduler=t.sched.statistics(), groups=None
    )
    registry = CollectorRegistry()
    registry.register(OffloaderCollector(lambda: stats))
    families = scrape(registry)
    for family, tally in (
        ("kvoffload_lookup_misses", t.lookups),
        ("kvoffload_lookup_miss_tokens", t.tokens),
    ):
        kind, samples = families[family]
        assert kind == "counter"
        assert {labels["reason"]: value for labels, value in samples} == {
            r.value: float(n) for r, n in tally.items()
        }
    assert t.lookups == {R.NEVER_STORED: 1, R.EVICTED: 1, R.LAST_TOKEN: 1}
