"""RefCountPinner: pin counts per GPU block and the release hook an allocator listens to."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvoffload import BlockStateError, RefCountPinner


def test_counts_pins_per_block_and_reports_last_release() -> None:
    released: list[list[int]] = []
    pinner = RefCountPinner(on_release=lambda ids: released.append(list(ids)))
    pinner.pin([1, 2, 3])
    pinner.pin([2, 2])  # two transfers naming block 2 (one names it twice)
    assert [pinner.pin_count(b) for b in range(5)] == [0, 1, 3, 1, 0]
    assert pinner.is_pinned(2)
    assert not pinner.is_pinned(0)
    pinner.unpin([1, 2, 3])
    assert released == [[1, 3]]
    assert pinner.is_pinned(2)
    assert not pinner.is_pinned(1)
    pinner.unpin([2, 2])
    assert released == [[1, 3], [2]]
    assert pinner.num_pinned == 0
    assert tuple(pinner.pinned_blocks()) == ()


def test_unpinning_more_than_pinned_raises_and_changes_nothing() -> None:
    released: list[list[int]] = []
    pinner = RefCountPinner(on_release=lambda ids: released.append(list(ids)))
    pinner.pin([4, 5])
    with pytest.raises(BlockStateError, match=r"GPU block 5 unpinned 2 time\(s\) but holds 1"):
        pinner.unpin([4, 5, 5])
    assert pinner.pin_count(4) == 1
    assert pinner.pin_count(5) == 1
    assert released == []


def test_without_a_hook_release_is_silent() -> None:
    pinner = RefCountPinner()
    pinner.pin([7])
    pinner.unpin([7])
    assert not pinner.is_pinned(7)
    assert "pinned_blocks=0" in repr(pinner)


@given(
    st.lists(
        st.tuples(st.booleans(), st.lists(st.integers(0, 7), max_size=5)),
        max_size=40,
    )
)
def test_matches_a_counter_model(ops: list[tuple[bool, list[int]]]) -> None:
    released: list[int] = []
    pinner = RefCountPinner(on_release=released.extend)
    model: Counter[int] = Counter()
    for is_pin, ids in ops:
        if is_pin:
            pinner.pin(ids)
            model.update(ids)
            continue
        want = Counter(ids)
        if any(model[b] < n for b, n in want.items()):
            with pytest.raises(BlockStateError):
                pinner.unpin(ids)
            continue
        before = set(+model)
        pinner.unpin(ids)
        model.subtract(ids)
        model = +model
        assert set(released[-len(before - set(model)) :] if before - set(model) else []) == (
            before - set(model)
        )
        for b in range(8):
            assert pinner.pin_count(b) == model[b]
            assert pinner.is_pinned(b) == (model[b] > 0)
    assert set(pinner.pinned_blocks()) == set(model)
