from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import textwrap

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffload.config import KVLayout
from kvoffload.errors import InputTypeError
from kvoffload.hashing import (
    BlockHash,
    BlockHasher,
    HashNamespace,
    hash_block_tokens,
    hash_prompt,
)
from kvoffload.pool.block_pool import CpuBlockPool
from kvoffload.request import hash_new_blocks

INT64 = st.integers(min_value=-(1 << 63), max_value=(1 << 63) - 1)
BLOCK = st.lists(INT64, min_size=1, max_size=8)

_CHILD = textwrap.dedent(
    """
    from kvoffload.hashing import HashNamespace, hash_prompt
    ns = HashNamespace(model_id="m@rev", dtype="bfloat16", layout="L2", salt="tenant")
    tokens = list(range(1000, 1100)) + [-5, 2**62]
    print(",".join(h.hex() for h in hash_prompt(tokens, 16, ns)))
    print(hash(("a", "b")))
    """
)


def _child_hashes(seed: str) -> tuple[list[str], str]:
    env = dict(os.environ, PYTHONHASHSEED=seed)
    out = subprocess.run(
        [sys.executable, "-c", _CHILD],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.splitlines()
    return out[0].split(","), out[1]


def test_hashes_are_identical_across_processes_with_different_hash_seeds() -> None:
    a, hash_a = _child_hashes("1")
    b, hash_b = _child_hashes("2")
    # the seeds do differ: Python's own hash() of the same tuple changed
    assert hash_a != hash_b
    assert a == b
    ns = HashNamespace(model_id="m@rev", dtype="bfloat16", layout="L2", salt="tenant")
    tokens = [*range(1000, 1100), -5, 2**62]
    assert a == [h.hex() for h in hash_prompt(tokens, 16, ns)]
    assert len(a) == len(tokens) // 16


def test_hash_is_32_byte_sha256() -> None:
    h = hash_block_tokens(HashNamespace().root, [1, 2, 3])
    assert isinstance(h, bytes)
    assert len(h) == 32
    assert len(HashNamespace().root) == 32


def test_known_value_is_stable() -> None:
    """The encoding is part of the contract: persisted keys must stay valid."""
    root = HashNamespace().root
    expected_root = hashlib.sha256(b"kvoffload-block-hash-v1" + (b"\0" * 8) * 4).digest()
    assert root == expected_root
    expected = hashlib.sha256(
        root
        + (2).to_bytes(8, "little")
        + (0).to_bytes(8, "little")
        + (7).to_bytes(8, "little", signed=True)
        + (-1).to_bytes(8, "little", signed=True)
    ).digest()
    assert hash_block_tokens(root, [7, -1]) == expected


def test_only_full_blocks_are_hashed() -> None:
    ns = HashNamespace()
    assert hash_prompt([], 4, ns) == []
    assert hash_prompt([1, 2, 3], 4, ns) == []
    full = hash_prompt([1, 2, 3, 4], 4, ns)
    assert len(full) == 1
    assert hash_prompt([1, 2, 3, 4, 5, 6, 7], 4, ns) == full
    two = hash_prompt(list(range(8)), 4, ns)
    assert len(two) == 2
    assert two[1] == hash_block_tokens(hash_block_tokens(ns.root, [0, 1, 2, 3]), [4, 5, 6, 7])


def test_hash_prompt_accepts_tuples_and_lists_alike() -> None:
    ns = HashNamespace(salt="x")
    assert hash_prompt(tuple(range(10)), 3, ns) == hash_prompt(list(range(10)), 3, ns)


def test_bad_block_size() -> None:
    with pytest.raises(ValueError, match="block_size must be >= 1, got 0"):
        hash_prompt([1, 2], 0, HashNamespace())


@pytest.mark.parametrize(
    ("tokens", "bad"),
    [([1, 2**63], "token_ids[1]=9223372036854775808"), ([1.5, 2], "token_ids[0]=1.5")],
)
def test_bad_tokens(tokens: list[object], bad: str) -> None:
    with pytest.raises(ValueError, match=r"is not a 64-bit int") as info:
        hash_block_tokens(HashNamespace().root, tokens)  # type: ignore[arg-type]
    assert bad in str(info.value)


def test_extra_changes_the_key() -> None:
    root = HashNamespace().root
    assert hash_block_tokens(root, [1, 2]) != hash_block_tokens(root, [1, 2], extra=b"lora-1")
    assert hash_block_tokens(root, [1, 2], b"a") != hash_block_tokens(root, [1, 2], b"b")


def test_namespace_is_slotted_and_frozen() -> None:
    ns = HashNamespace()
    assert not hasattr(ns, "__dict__")
    with pytest.raises(AttributeError):
        ns.salt = "x"  # type: ignore[misc]


NAMESPACE_VARIANTS = {
    "model": HashNamespace(model_id="llama@rev2", dtype="bfloat16", layout="g", salt=""),
    "dtype": HashNamespace(model_id="llama@rev1", dtype="float16", layout="g", salt=""),
    "layout": HashNamespace(model_id="llama@rev1", dtype="bfloat16", layout="h", salt=""),
    "salt": HashNamespace(model_id="llama@rev1", dtype="bfloat16", layout="g", salt="tenant"),
}
BASE_NAMESPACE = HashNamespace(model_id="llama@rev1", dtype="bfloat16", layout="g", salt="")


@pytest.mark.parametrize("which", sorted(NAMESPACE_VARIANTS))
def test_different_namespace_shares_no_key(which: str) -> None:
    tokens = list(range(256))
    base = hash_prompt(tokens, 16, BASE_NAMESPACE)
    other = hash_prompt(tokens, 16, NAMESPACE_VARIANTS[which])
    assert len(base) == len(other) == 16
    assert not set(base) & set(other)


def test_namespace_fields_do_not_run_together() -> None:
    """Length-prefixed fields: moving a character between fields changes the root."""
    assert (
        HashNamespace(model_id="ab", dtype="c").root != HashNamespace(model_id="a", dtype="bc").root
    )


def _layout(**overrides: object) -> KVLayout:
    values: dict[str, object] = {
        "num_layers": 4,
        "num_kv_heads": 8,
        "head_size": 64,
        "dtype": "bfloat16",
        "block_size": 16,
    }
    values.update(overrides)
    return KVLayout(**values)


# FM-36: a cache written under one dtype / layout / model revision / block size yields no
# hit for another, even where the bytes per block are the same.
FM36_VARIANTS = {
    "dtype": (_layout(dtype="float16"), "llama@rev1"),  # same page size as bfloat16
    "kind": (_layout(kind="kv_first"), "llama@rev1"),
    "geometry": (_layout(num_kv_heads=4, head_size=128), "llama@rev1"),  # same page size
    "layers": (_layout(num_layers=2), "llama@rev1"),
    "model_revision": (_layout(), "llama@rev2"),
    "block_size": (_layout(block_size=8), "llama@rev1"),
}


@pytest.mark.parametrize("which", sorted(FM36_VARIANTS))
def test_fm36_namespace_change_gives_zero_hits(which: str) -> None:
    tokens = list(range(10_000, 10_512))
    stored_layout = _layout()
    stored_ns = HashNamespace.from_layout(stored_layout, model_id="llama@rev1")
    stored = hash_prompt(tokens, stored_layout.block_size, stored_ns)

    pool = CpuBlockPool(64)
    for block, h in zip(pool.allocate(len(stored)), stored, strict=True):
        assert pool.publish(block, h)
    assert len(pool.lookup(stored)) == len(stored)  # the same namespace hits

    new_layout, model_id = FM36_VARIANTS[which]
    new_ns = HashNamespace.from_layout(new_layout, model_id=model_id)
    assert new_ns != stored_ns
    again = hash_prompt(tokens, new_layout.block_size, new_ns)
    assert pool.lookup(again) == []
    assert not set(again) & set(stored)


def test_from_layout_mixes_in_every_geometry_field() -> None:
    ns = HashNamespace.from_layout(_layout(), model_id="m", salt="s")
    assert ns.model_id == "m"
    assert ns.salt == "s"
    assert ns.dtype == "bfloat16"
    for part in ("blocks_first", "L4", "H8", "D64", "B16"):
        assert part in ns.layout


# FM-34a: distinct token blocks under one parent give distinct keys; the key depends on the
# whole chain.


@settings(max_examples=300, deadline=None)
@given(parent=st.binary(min_size=32, max_size=32), a=BLOCK, b=BLOCK)
def test_distinct_blocks_under_one_parent_give_distinct_keys(
    parent: bytes, a: list[int], b: list[int]
) -> None:
    ka = hash_block_tokens(BlockHash(parent), a)
    kb = hash_block_tokens(BlockHash(parent), b)
    assert (ka == kb) == (a == b)


@settings(max_examples=300, deadline=None)
@given(
    p1=st.binary(min_size=32, max_size=32),
    p2=st.binary(min_size=32, max_size=32),
    block=BLOCK,
)
def test_key_depends_on_the_parent(p1: bytes, p2: bytes, block: list[int]) -> None:
    k1 = hash_block_tokens(BlockHash(p1), block)
    k2 = hash_block_tokens(BlockHash(p2), block)
    assert (k1 == k2) == (p1 == p2)


@settings(max_examples=200, deadline=None)
@given(
    common=st.lists(INT64, max_size=24),
    tail_a=st.lists(INT64, max_size=24),
    tail_b=st.lists(INT64, max_size=24),
    block_size=st.integers(min_value=1, max_value=6),
)
def test_prompts_share_keys_exactly_over_their_common_full_blocks(
    common: list[int], tail_a: list[int], tail_b: list[int], block_size: int
) -> None:
    a = common + tail_a
    b = common + tail_b
    ha = hash_prompt(a, block_size, BASE_NAMESPACE)
    hb = hash_prompt(b, block_size, BASE_NAMESPACE)
    # the number of leading full blocks whose tokens agree
    same = 0
    while (
        same < min(len(ha), len(hb))
        and a[same * block_size : (same + 1) * block_size]
        == b[same * block_size : (same + 1) * block_size]
    ):
        same += 1
    assert ha[:same] == hb[:same]
    # once a block differs, every later key differs too: it depends on the whole chain
    assert not set(ha[same:]) & set(hb[same:])
    assert not set(ha[same:]) & set(hb[:same])


# -- BlockHasher --------------------------------------------------------------------------


def _chain(root: BlockHash, tokens: list[int], bs: int, extra: bytes = b"") -> list[BlockHash]:
    """The reference: `hash_block_tokens` block by block."""
    out: list[BlockHash] = []
    parent = root
    for start in range(0, len(tokens) - bs + 1, bs):
        parent = hash_block_tokens(parent, tokens[start : start + bs], extra)
        out.append(parent)
    return out


@settings(max_examples=60)
@given(
    tokens=st.lists(INT64, max_size=80),
    bs=st.integers(min_value=1, max_value=9),
    cuts=st.lists(st.integers(min_value=0, max_value=20), max_size=20),
    extra=st.one_of(st.just(b""), st.binary(min_size=1, max_size=12)),
    as_tuples=st.booleans(),
)
def test_block_hasher_fed_in_any_chunks_gives_todays_hashes(
    tokens: list[int], bs: int, cuts: list[int], extra: bytes, as_tuples: bool
) -> None:
    ns = HashNamespace(model_id="m", salt="s")
    hasher = BlockHasher(ns.root, bs, extra)
    start = 0
    for size in [*cuts, len(tokens)]:  # the last chunk takes what is left
        chunk = tokens[start : start + size]
        hasher.extend(tuple(chunk) if as_tuples else chunk)
        start += len(chunk)
        assert list(hasher.block_hashes) == _chain(ns.root, tokens[:start], bs, extra)
        assert hasher.num_tokens == start
    if not extra:
        assert list(hasher.block_hashes) == hash_prompt(tokens, bs, ns)


@settings(max_examples=30)
@given(
    tokens=st.lists(INT64, max_size=60),
    bs=st.integers(min_value=1, max_value=8),
    steps=st.lists(st.integers(min_value=0, max_value=15), max_size=10),
)
def test_block_hasher_update_catches_up_with_a_growing_stream(
    tokens: list[int], bs: int, steps: list[int]
) -> None:
    """``update(all_tokens)``: what the engines' per-request hashers call each step."""
    root = HashNamespace().root
    hasher = BlockHasher(root, bs)
    old: list[BlockHash] = []
    seen = 0
    for step in [*steps, len(tokens)]:
        seen = min(len(tokens), seen + step)
        hasher.update(tokens[:seen])
        hash_new_blocks(old, tokens[:seen], bs, root)
        assert list(hasher.block_hashes) == old == _chain(root, tokens[:seen], bs)


def test_block_hasher_refuses_a_bad_token_and_changes_nothing() -> None:
    root = HashNamespace().root
    hasher = BlockHasher(root, 4)
    hasher.extend([1, 2, 3])
    for bad, where in (
        ([4, 5, 1 << 70, 6, 7], "token_ids[2]=1180591620717411303424"),  # fills a block
        ([2.5], "token_ids[0]=2.5"),  # the one-token path
        ([4, 5, 6, 7, 8, "x"], "token_ids[5]='x'"),  # in the new tail
    ):
        with pytest.raises(InputTypeError, match="is not a 64-bit int") as info:
            hasher.extend(bad)  # type: ignore[arg-type]
        assert where in str(info.value)
        assert hasher.num_tokens == 3
        assert list(hasher.block_hashes) == []
    hasher.extend([4])
    assert list(hasher.block_hashes) == _chain(root, [1, 2, 3, 4], 4)


def test_block_hasher_bad_block_size() -> None:
    with pytest.raises(ValueError, match="block_size must be >= 1, got 0"):
        BlockHasher(HashNamespace().root, 0)


def test_block_hasher_is_slotted_and_shares_its_list() -> None:
    hasher = BlockHasher(HashNamespace().root, 2, b"x")
    assert not hasattr(hasher, "__dict__")
    hashes = hasher.block_hashes
    hasher.extend([1, 2, 3, 4, 5])
    assert hashes is hasher.block_hashes  # one list that grows: a caller may bind it once
    assert len(hashes) == 2
    assert (hasher.root, hasher.block_size, hasher.extra) == (HashNamespace().root, 2, b"x")


def test_hash_new_blocks_appends_nothing_for_a_bad_token() -> None:
    root = HashNamespace().root
    hashes: list[BlockHash] = []
    with pytest.raises(InputTypeError, match="is not a 64-bit int"):
        hash_new_blocks(hashes, [1, 2, 3, 4, 5, 1 << 70], 2, root)
    assert hashes == []  # not the two blocks ahead of the bad one
    hash_new_blocks(hashes, [1, 2, 3, 4, 5, 1 << 70, 7], 4, root)  # the tail is not read
    assert hashes == _chain(root, [1, 2, 3, 4], 4)
