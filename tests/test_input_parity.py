"""One rule, one message: bad input to one group's `OffloadScheduler` and to a
`GroupedScheduler` over one full group of the same geometry is refused by the same
check, with the same error and the same message (a grouped scheduler with one cacheable
group names its input as one group does: `InputNames`). With two such groups it is
refused the same way, the message naming the group at fault (``tables['f']``,
``block_hashes['f']``, "the block table of group 'f'") and the unit of a hit
(``hit_alignment``). A seeded random engine, good input and
bad (tables changed, shrunk, naming a block twice or out of range; hashes shrunk or
changed; computed counts going back; loads into wrong tables; finishes, preemptions,
resets, failed stores), gets the same answer from both at every step: a fix made on one path
only fails it (each shared check disabled on either side fails most seeds)."""

from __future__ import annotations

import hashlib
import inspect
import itertools
import random
import re
import warnings
from collections.abc import Callable
from typing import Any

import pytest
from groups_helpers import Rig, group

from kvoffload.config import OffloadConfig
from kvoffload.errors import (
    BlockTableError,
    InputTypeError,
    InvalidInputError,
    KvOffloadError,
    RequestStateError,
    UnhashedBlocksWarning,
)
from kvoffload.hashing import BlockHasher, HashNamespace
from kvoffload.pool.block_pool import CpuBlockPool
from kvoffload.scheduler import OffloadScheduler
from kvoffload.scheduler.groups import GroupedScheduler

TOKENS = list(range(16))
TABLE = [0, 1, 2, 3]


def one_group() -> tuple[Any, list[bytes]]:
    config = OffloadConfig(num_cpu_blocks=16, block_size=4)
    sched = OffloadScheduler(config, CpuBlockPool(16), num_gpu_blocks=32)
    hasher = BlockHasher(HashNamespace(model_id="t").root, 4)
    hasher.extend(TOKENS)
    return sched, list(hasher.block_hashes)


def grouped() -> tuple[Any, list[bytes]]:
    rig = Rig([group("g", "full", 4)], cpu_blocks=16, gpu_blocks=32)
    return rig.sched, rig.hashes(TOKENS)["g"]


Call = Callable[[Any, Callable[[object], object], list[bytes]], object]

CASES: dict[str, tuple[type[Exception], Call]] = {
    "computed past the prompt": (
        InvalidInputError,
        lambda s, w, h: s.lookup("a", w(h), 8, 12),
    ),
    "a negative prompt": (InvalidInputError, lambda s, w, h: s.lookup("a", w(h), -4, 0)),
    "computed not a whole block": (
        InvalidInputError,
        lambda s, w, h: s.lookup("a", w(h), 16, 3),
    ),
    "a count that is not an int": (
        InputTypeError,
        lambda s, w, h: s.lookup("a", w(h), 16.0, 0),
    ),
    "a negative GPU block": (
        BlockTableError,
        lambda s, w, h: s.update("a", w([0, -1, 2, 3]), w(h), 16),
    ),
    "a GPU block past the cache": (
        BlockTableError,
        lambda s, w, h: s.update("a", w([0, 1, 2, 32]), w(h), 16),
    ),
    "an entry that is not an int": (
        InputTypeError,
        lambda s, w, h: s.update("a", w([0, 1, "2", 3]), w(h), 16),
    ),
    "a GPU block named twice": (
        BlockTableError,
        lambda s, w, h: s.update("a", w([0, 1, 1, 3]), w(h), 16),
    ),
    "a new entry past the cache": (
        BlockTableError,
        lambda s, w, h: (
            s.update("a", w(TABLE[:2]), w(h), 8),
            s.update("a", w([*TABLE[:2], 7, 40]), w(h), 16),
        ),
    ),
    "a computed count that is negative": (
        InvalidInputError,
        lambda s, w, h: s.update("a", w(TABLE), w(h), -4),
    ),
}


def hit(s: Any, w: Callable[[object], object], h: list[bytes]) -> None:
    """Request "a" stores its 4 blocks and finishes; "b" looks the prompt up (a hit of
    3 blocks: the last token is always computed)."""
    s.update("a", w(TABLE), w(h), 16)
    plan = s.plan_stores()
    if hasattr(s, "complete_all"):  # a GroupedScheduler's plan has a part per group
        s.complete_all(plan, True)
    else:
        s.complete(plan, True)
    s.finish("a")
    assert s.lookup("b", w(h), 16, 0) == 12


CASES.update(
    {
        "a load table too short": (
            BlockTableError,
            lambda s, w, h: (hit(s, w, h), s.plan_load("b", w([5]), 12)),
        ),
        "a load table naming a block twice": (
            BlockTableError,
            lambda s, w, h: (hit(s, w, h), s.plan_load("b", w([5, 5, 7, 8]), 12)),
        ),
        "a table that is not a sequence": (
            InputTypeError,
            lambda s, w, h: s.update("a", w(5), w(h), 16),
        ),
        "hashes that are not a sequence": (
            InputTypeError,
            lambda s, w, h: s.update("a", w(TABLE), w(5), 16),
        ),
        "hashes that shrank": (
            InvalidInputError,
            lambda s, w, h: (
                s.update("a", w(TABLE), w(h), 16),
                s.update("a", w(TABLE), w(h[:2]), 16),
            ),
        ),
    }
)

SEVERAL_GROUP_NAMES = (  # one group's words, and how two groups name group 'f' instead
    ("block table has", "the block table of group 'f' has"),
    ("appears twice in gpu_block_ids", "appears twice in the block table of group 'f'"),
    ("gpu_block_ids", "tables['f']"),
    ("block_hashes", "block_hashes['f']"),
    ("block_size=", "hit_alignment="),
)


def two_groups() -> tuple[Any, list[bytes]]:
    rig = Rig([group("f", "full", 4), group("g", "full", 4)], cpu_blocks=16, gpu_blocks=32)
    return rig.sched, rig.hashes(TOKENS)["f"]


def refusal(
    make: Callable[[], tuple[Any, list[bytes]]], wrap: Callable[[object], object], call: Call
) -> tuple[type[Exception], str]:
    sched, hashes = make()
    with pytest.raises(Exception) as info:
        call(sched, wrap, hashes)
    sched.check_invariants()  # refused: nothing half-done
    return type(info.value), str(info.value)


@pytest.mark.parametrize("case", CASES)
def test_one_group_and_a_grouped_scheduler_refuse_alike(case: str) -> None:
    kind, call = CASES[case]
    one_kind, one_text = refusal(one_group, lambda x: x, call)
    g_kind, g_text = refusal(grouped, lambda x: {"g": x}, call)
    assert one_kind is kind
    assert g_kind is kind
    assert re.match(r"request '[ab]': ", one_text), one_text  # names the request
    assert g_text == one_text


@pytest.mark.parametrize("in_flight", [True, False], ids=["stores in flight", "forgotten"])
def test_a_second_finish_is_refused_alike(in_flight: bool) -> None:
    """A request finished twice: the same refusal from both schedulers, whether its state
    is kept (a store in flight) or already forgotten."""

    def call(s: Any, w: Callable[[object], object], h: list[bytes]) -> None:
        s.update("a", w(TABLE), w(h), 16)
        if in_flight:
            assert s.plan_stores() is not None
        s.finish("a")
        s.finish("a")

    one_kind, one_text = refusal(one_group, lambda x: x, call)
    g_kind, g_text = refusal(grouped, lambda x: {"g": x}, call)
    assert one_kind is g_kind is RequestStateError
    assert g_text == one_text
    assert ("already finished" in one_text) is in_flight, one_text


@pytest.mark.parametrize("case", CASES)
def test_two_groups_refuse_alike_naming_the_group(case: str) -> None:
    """The same bad input given to both of two full groups: the same error, its message
    naming the first group (``'f'``) where one group's names its input."""
    kind, call = CASES[case]
    _, one_text = refusal(one_group, lambda x: x, call)
    two_kind, two_text = refusal(two_groups, lambda x: {"f": x, "g": x}, call)
    assert two_kind is kind
    for one_name, several_name in SEVERAL_GROUP_NAMES:
        one_text = one_text.replace(one_name, several_name)
    assert two_text == one_text


def test_two_groups_name_the_group_whose_table_is_wrong() -> None:
    rig = Rig([group("f", "full", 4), group("w", "sliding_window", 4, window=8)], gpu_blocks=32)
    hashes = rig.hashes(TOKENS)
    with pytest.raises(
        BlockTableError, match=r"request 'a': tables\['w'\]\[2\]=32 is out of range \[0, 32\)"
    ):
        rig.sched.update("a", {"f": TABLE, "w": [4, 5, 32, 7]}, hashes, 16)
    with pytest.raises(
        InputTypeError, match=r"request 'a': tables\['f'\]\[0\]=0.0 is not an int \(got float\)"
    ):
        rig.sched.update("a", {"f": [0.0, 1, 2, 3], "w": [4, 5, 6, 7]}, hashes, 16)
    # ``None`` names no block, in any group's table
    rig.sched.update("a", {"f": TABLE, "w": [None, 5, 6, 7]}, hashes, 16)
    rig.sched.check_invariants()


def test_a_load_into_no_gpu_block_names_the_group_only_with_several() -> None:
    """A ``None`` destination (a grouped table's entry naming no block) is refused naming
    the position, and the group only where there are several."""
    for make, wrap, where in (
        (grouped, lambda x: {"g": x}, ""),
        (two_groups, lambda x: {"f": x, "g": x}, "group 'f': "),
    ):
        sched, hashes = make()
        hit(sched, wrap, hashes)
        with pytest.raises(
            BlockTableError, match=rf"^request 'b': {where}no GPU block at position 1 to load"
        ):
            sched.plan_load("b", wrap([5, None, 7, 8]), 12)
        sched.check_invariants()


# -- computed tokens far past the hashes: one warning, by one rule ------------------------


def unhashed(
    sched: Any, w: Callable[[object], object], h: list[bytes], first: bool
) -> list[warnings.WarningMessage]:
    """The `UnhashedBlocksWarning`s of an update whose computed tokens run two blocks past
    its hashes (on the request's first call, or after one that ran one block ahead: no
    warning), then of two more such updates, of that request and of another."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if not first:
            sched.update("a", w(TABLE[:3]), w(h[:2]), 12)  # one block ahead: normal
        sched.update("a", w(TABLE), w(h[:2]), 16)  # warns here
        sched.update("a", w([*TABLE, 4]), w(h[:2]), 20)  # once per scheduler
        sched.update("b", w([5, 6, 7, 8]), w(h[:1]), 16)
    sched.check_invariants()
    return [c for c in caught if c.category is UnhashedBlocksWarning]


@pytest.mark.parametrize("first", [True, False], ids=["first call", "later call"])
def test_one_group_and_a_grouped_scheduler_warn_alike_of_unhashed_blocks(first: bool) -> None:
    """A `GroupedScheduler` with one group warns by one group's rule (`warn_unhashed()`),
    once per scheduler, in the same words and naming the same caller's frame."""
    seen = []
    for make, wrap in ((one_group, lambda x: x), (grouped, lambda x: {"g": x})):
        sched, hashes = make()
        seen.append(unhashed(sched, wrap, hashes, first))
    one, g = seen
    assert len(one) == len(g) == 1
    assert str(one[0].message) == str(g[0].message)
    assert str(one[0].message).startswith(
        "request 'a': num_computed_tokens=16 covers 4 full blocks but only 2 block hashes "
        "were given: blocks without a hash are never stored"
    )
    assert (one[0].filename, one[0].lineno) == (g[0].filename, g[0].lineno)
    # the frame is the caller's own line: the update() that ran ahead of its hashes
    assert one[0].filename == __file__
    source = inspect.getsource(unhashed).splitlines()
    line = next(i for i, text in enumerate(source) if text.endswith("# warns here"))
    assert one[0].lineno == unhashed.__code__.co_firstlineno + line


@pytest.mark.parametrize("first", [True, False], ids=["first call", "later call"])
@pytest.mark.parametrize("lagging", ["f", "w"])
def test_full_and_sliding_window_warn_once_naming_the_group_whose_hashes_lag(
    first: bool, lagging: str
) -> None:
    rig = Rig([group("f", "full", 4), group("w", "sliding_window", 4, window=8)], gpu_blocks=32)
    all_hashes = rig.hashes(TOKENS)
    other = "w" if lagging == "f" else "f"

    def w(x: object) -> object:  # the lagging group gets ``x``; the other its whole hashes
        if x and isinstance(x, list) and isinstance(x[0], bytes):
            return {lagging: x, other: all_hashes[other]}
        return {lagging: x, other: x}

    caught = unhashed(rig.sched, w, all_hashes[lagging], first)
    assert len(caught) == 1
    assert str(caught[0].message).startswith(
        f"request 'a': num_computed_tokens=16 covers 4 full blocks of group {lagging!r} but "
        "only 2 block hashes were given"
    )
    assert caught[0].filename == __file__


def test_hashes_in_step_with_each_group_block_size_do_not_warn() -> None:
    """Each group is held to its own block size: 8-token blocks need half the hashes."""
    rig = Rig([group("f", "full", 4), group("w", "sliding_window", 8, window=16)], gpu_blocks=32)
    hashes = rig.hashes(TOKENS)
    assert [len(hashes["f"]), len(hashes["w"])] == [4, 2]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rig.sched.update("a", {"f": TABLE, "w": [4, 5]}, hashes, 16)
        rig.sched.update("b", {"f": TABLE[:3], "w": [6, 7]}, {"f": hashes["f"][:2], "w": []}, 12)
    rig.sched.check_invariants()


# -- a seeded random workload, good input and bad, through both schedulers ----------------

GPU = 32
BAD_KINDS = (
    "change",
    "shrink",
    "twice",
    "range",
    "hashes_shrink",
    "last_hash",
    "first_hash",
    "computed_back",
)


def chain(tag: str, n: int) -> list[bytes]:
    out, prev = [], tag.encode()
    for k in range(n):
        prev = hashlib.sha256(prev + bytes([k])).digest()
        out.append(prev)
    return out


class Engine:
    """What a random engine asks of a scheduler, good and bad, step by step; each call
    is made on both schedulers and what they answer is compared."""

    def __init__(self, seed: int, settings: dict[str, object]) -> None:
        self.rnd = random.Random(seed)
        config = OffloadConfig(num_cpu_blocks=10, block_size=4, **settings)  # type: ignore[arg-type]
        self.one = OffloadScheduler(config, CpuBlockPool(10), num_gpu_blocks=GPU)
        self.grouped = GroupedScheduler(
            [group("g", "full", 4)],
            {"g": CpuBlockPool(10)},
            config=config,
            num_gpu_blocks={"g": GPU},
        )
        self.free = list(range(GPU))
        self.rnd.shuffle(self.free)
        self.live: dict[str, tuple[list[int], list[bytes], int]] = {}
        self.ids = itertools.count()
        self.hits: dict[str, int] = {}

    def both(self, call: Callable[[Any, Callable[[object], object]], object]) -> list[object]:
        """``call`` on each scheduler (one group's lists, or a mapping with one group):
        the error's type, or what came back."""
        out: list[object] = []
        for sched, wrap in ((self.one, lambda x: x), (self.grouped, lambda x: {"g": x})):
            try:
                out.append(call(sched, wrap))
            except KvOffloadError as e:
                out.append(type(e))
        return out

    def step(self) -> tuple[str, list[object]]:
        rnd = self.rnd
        if len(self.live) < 4:
            self.live[f"r{next(self.ids)}"] = ([], chain(f"p{rnd.randrange(3)}", 8), 0)
        rid = rnd.choice(sorted(self.live))
        table, hashes, computed = self.live[rid]
        op = rnd.choice(
            (
                "grow",
                "grow",
                "grow",
                "bad",
                "plan",
                "plan",
                "finish",
                "preempt",
                "lookup",
                "release",
                "reset" if rnd.random() < 0.3 else "plan",
            )
        )
        if op == "grow":
            if len(table) < len(hashes) and self.free:
                table.append(self.free.pop())
            computed = min(len(table) * 4, computed + 4 * rnd.randint(0, 2))
            self.live[rid] = (table, hashes, computed)
            n = len(table)
            return op, self.both(lambda s, w: s.update(rid, w(table[:]), w(hashes[:n]), computed))
        if op == "bad":
            kind = rnd.choice(BAD_KINDS)
            t, h, c = bad_input(kind, table, hashes[: len(table)], computed, self.free)
            return f"bad {kind}", self.both(lambda s, w: s.update(rid, w(t), w(h), c))
        if op == "plan":
            ok = rnd.random() < 0.8
            return op, self.both(lambda s, w: plan_and_complete(s, ok))
        if op == "reset":  # every cursor back to 0: stores wait for the next update
            return op, self.both(lambda s, w: s.reset())
        if op == "lookup":
            r = rnd.random()  # one draw: both schedulers are asked the same
            return op, self.both(lambda s, w: lookup_and_load(s, w, rid, table, hashes, r))
        answers = self.both(lambda s, w: ended(s, op, rid))
        if answers[0] is None and op == "finish":
            for s in (self.one, self.grouped):  # a grouped finish may plan the last point
                s.check_invariants()
            self.free.extend(table)
            del self.live[rid]
        elif answers[0] is None and op == "preempt":
            self.free.extend(table)
            self.live[rid] = ([], hashes, 0)
        return op, answers


def bad_input(
    kind: str, table: list[int], hashes: list[bytes], computed: int, free: list[int]
) -> tuple[list[int], list[bytes], int]:
    t, h, c = table[:], hashes[:], computed
    if kind == "change" and t:
        t[len(t) // 2] = free[0] if free else GPU - 1
    elif kind == "shrink" and t:
        t, h = t[:-1], h[:-1]
    elif kind == "twice" and t:
        t.append(t[0])
        h = [*h, b"n" * 32]
    elif kind == "range":
        t.append(GPU + 3)
        h = [*h, b"n" * 32]
    elif kind == "hashes_shrink" and h:
        h = h[:-1]
    elif kind == "last_hash" and h:
        h[-1] = b"z" * 32
    elif kind == "first_hash" and h:
        h[0] = b"y" * 32
    elif kind == "computed_back":
        c = max(0, c - 4)
    return t, h, c


def ended(sched: Any, op: str, rid: str) -> object:
    """``finish``, ``preempt`` or ``release``: what one group's ``finish()`` holds (a
    grouped finish's store of the request's last point, if any, is completed and
    compared: a full group has none to plan)."""
    out = getattr(sched, op)(rid)
    if op != "finish":
        return None
    if hasattr(sched, "complete_all"):
        if out is not None:
            sched.complete_all(out, True)
            return ("planned at finish", out.plans["g"].gpu_block_ids)
        return sched.held_blocks(rid).get("g", [])
    return list(out)


def plan_and_complete(sched: Any, ok: bool) -> object:
    """This step's stores (the one group's part): its GPU blocks and hashes; completed."""
    plan = sched.plan_stores()
    if plan is None:
        return None
    grouped = hasattr(sched, "complete_all")
    part = plan.plans.get("g") if grouped else plan
    (sched.complete_all if grouped else sched.complete)(plan, ok)
    return None if part is None else (part.gpu_block_ids, part.block_hashes)


def lookup_and_load(
    sched: Any,
    w: Callable[[object], object],
    rid: str,
    table: list[int],
    hashes: list[bytes],
    r: float,
) -> object:
    """A lookup, then (when it hit) a load into the table as it is, or one naming a block
    twice, or an empty one, or the pins released."""
    hit = sched.lookup(rid, w(hashes), len(hashes) * 4 + 1, 0)
    if not hit:
        return hit
    dest = table + list(range(GPU - 8, GPU - 8 + 8 - len(table)))
    if r < 0.2:
        dest = [dest[0], *dest[:-1]]
    elif r < 0.3:
        dest = []
    plan = sched.plan_load(rid, w(dest), 0 if r > 0.9 else hit)
    if plan is not None:
        (sched.complete_all if hasattr(sched, "complete_all") else sched.complete)(plan, True)
    return hit


@pytest.mark.parametrize(
    "settings",
    [{}, {"hold_blocks_on_finish": True}, {"max_store_blocks_per_step": 2}],
    ids=["defaults", "hold_blocks_on_finish", "step_limit"],
)
@pytest.mark.parametrize("seed", range(25))
def test_random_input_good_and_bad_gets_the_same_answers(
    seed: int, settings: dict[str, object]
) -> None:
    """Each step: the same error, or the same hit and the same store plan; both
    schedulers' invariants hold after every step."""
    engine = Engine(seed, settings)
    for _ in range(120):
        op, answers = engine.step()
        assert answers[0] == answers[1], (op, answers)
        engine.one.check_invariants()
        engine.grouped.check_invariants()


def test_lazy_stores_without_a_view_are_refused_by_one_check() -> None:
    """``store_mode="lazy"`` without the engine's cache view: one check, the grouped
    planner's, in one group's words with one cacheable group (the face and a grouped
    scheduler over one group alike) and naming the groups with several."""
    config = OffloadConfig(num_cpu_blocks=16, block_size=4, store_mode="lazy")
    face = OffloadScheduler(config, CpuBlockPool(16))
    one = GroupedScheduler([group("g", "full", 4)], {"g": CpuBlockPool(16)}, config=config)
    two = GroupedScheduler(
        [group("f", "full", 4), group("h", "full", 4)],
        {"f": CpuBlockPool(16), "h": CpuBlockPool(16)},
        config=config,
    )
    messages = []
    for sched in (face, one, two):
        with pytest.raises(InvalidInputError) as caught:
            sched.plan_stores()
        messages.append(str(caught.value))
    assert messages[0] == messages[1] == "store_mode='lazy' needs plan_stores(gpu_cache)"
    assert (
        messages[2]
        == "store_mode='lazy' needs the engine's gpu_cache view of every group ['f', 'h']"
    )


def test_one_groups_face_refuses_a_mapping_of_group_names() -> None:
    """`OffloadScheduler` takes one list per call: a mapping of group names (the other
    shape's call) is refused naming the request, whether the call came through a
    `KVOffloader` or straight to the scheduler, and changes nothing."""
    sched, hashes = one_group()
    sched.update("r", TABLE, hashes, 16)
    with pytest.raises(InvalidInputError, match=r"'r'.*one KV cache group.*\['g'\]"):
        sched.lookup("r", {"g": hashes}, 17)
    hit = sched.lookup("r", hashes, 17)
    with pytest.raises(InvalidInputError, match=r"'r'.*one KV cache group.*\['g'\]"):
        sched.plan_load("r", {"g": TABLE}, hit)
    with pytest.raises(InputTypeError, match=r"gpu_cache=dict: one KV cache group"):
        sched.plan_stores({"g": object()})
    assert sched.statistics().lookups == 1
    sched.check_invariants()
