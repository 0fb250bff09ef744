"""`RecentBlocks`: the one memory of blocks a tier lacks (or recently failed on), used by
the tier manager's promotions and by the vLLM connector's tiers alike."""

from __future__ import annotations

import math

import pytest

from kvoffload.hashing import BlockHash
from kvoffload.tiers import promote
from kvoffload.tiers.promote import ABSENT_TTL_S, RecentBlocks


def h(i: int) -> BlockHash:
    return BlockHash(i.to_bytes(32, "big"))


def test_a_hash_is_remembered_until_it_expires(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    monkeypatch.setattr(promote.time, "monotonic", lambda: now[0])
    recent = RecentBlocks()
    recent.add(h(1))
    assert h(1) in recent
    assert h(2) not in recent
    now[0] += ABSENT_TTL_S - 0.01
    assert h(1) in recent
    now[0] += 0.02
    assert h(1) not in recent
    assert len(recent) == 0  # an expired hash is forgotten when asked


def test_the_oldest_hash_is_forgotten_past_the_bound() -> None:
    recent = RecentBlocks(math.inf, max_blocks=3)
    for i in range(4):
        recent.add(h(i))
    assert [h(i) in recent for i in range(4)] == [False, True, True, True]
    recent.add(h(1))  # remembered again: the newest
    recent.add(h(9))
    assert h(2) not in recent
    assert h(1) in recent


def test_forget_and_clear() -> None:
    recent = RecentBlocks()
    for i in range(3):
        recent.add(h(i))
    recent.forget([h(0), None, h(7)])
    assert h(0) not in recent
    assert h(1) in recent
    recent.clear()
    assert len(recent) == 0
