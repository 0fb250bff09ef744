"""Seeded synthetic traces in the Mooncake format, with different reuse shapes.

Policies are compared on more than one trace so that none is judged on the shape of a
single one. Each shape stresses something else:

* ``chat``: multi-turn conversations (most have one turn, a few run long; a turn extends
  the previous prompt), sharing a few system prompts, with interleaved arrivals.
* ``rag``: prompts that start with one of many documents, chosen with a Zipf skew, and end
  with a unique question: reuse is frequency-driven.
* ``scan``: a small hot set of prompts asked again and again, drowned in a stream of long
  one-off prompts: rewards scan resistance.
* ``loop``: a fixed set of prompts asked in a cycle: the case where LRU keeps nothing when
  the cycle does not fit.
* ``agent`` (`generate_agent`): many agent sessions whose context grows each turn, with a
  tool call of varying length between turns, among one-off requests; each turn but the
  last carries its session and a retention hint (``retain_for_s``: the longest its tool
  may take), with timestamps, so ``kvoffload replay`` compares hits with and without hints.

Block ids are assigned the way Mooncake's ``hash_ids`` are: two requests share ids exactly
as long as their prefixes agree.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "HINT_SHAPES",
    "PRIORITY_SHAPES",
    "SHAPES",
    "AgentTrace",
    "generate",
    "generate_agent",
    "generate_system",
    "write_trace",
]

SHAPES = ("chat", "rag", "scan", "loop")
PRIORITY_SHAPES = ("system",)
"""Shapes whose requests carry priorities (`generate_system`); not among `SHAPES`."""
HINT_SHAPES = ("agent",)
"""Shapes whose requests carry sessions and retention hints (`generate_agent`)."""

_TOOLS = ((1.0, 5.0, 0.5), (10.0, 40.0, 0.35), (60.0, 240.0, 0.15))
"""Agent tools: (shortest, longest call in seconds, share of calls)."""


@dataclass(frozen=True, slots=True)
class AgentTrace:
    """An ``agent`` trace: per request its block ids, arrival (ms), session (``None``: a
    one-off request) and retention hint in seconds (``None``: none given)."""

    requests: list[list[int]]
    timestamps_ms: list[float]
    sessions: list[str | None]
    retain_for_s: list[float | None]


def generate_agent(num_requests: int, seed: int = 0) -> AgentTrace:
    """An ``agent`` trace of ``num_requests`` requests.

    Sessions start about every 2 s; each runs 2 to 12 turns on a shared tool preamble (one
    of 4, 8 to 16 blocks), adding 2 to 12 blocks (the tool's output and the model's
    answer) each turn. Between turns a tool call lasts 1-5 s (half of the calls), 10-40 s
    or 60-240 s; each turn but the last hints ``retain_for_s`` = the longest its tool may
    take. One-off requests of 20 to 80 blocks arrive about 3 times a second among them
    (they carry no session and no hint).

    Raises:
        ValueError: ``num_requests`` below 1.
    """
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    rng = random.Random(f"agent:{seed}")
    ids = _Ids()
    preambles = [
        ids.chain(-1, [10**9 + i * 1000 + j for j in range(rng.randint(8, 16))]) for i in range(4)
    ]
    events: list[tuple[float, list[int], str | None, float | None]] = []
    t = 0.0
    s = q = 0
    while len(events) < num_requests * 2:
        t += rng.expovariate(0.5)
        s += 1
        context = rng.choice(preambles)
        at = t
        turns = rng.randint(2, 12)
        for turn in range(turns):
            q += 1
            context = context + ids.chain(
                context[-1], [q * 1000 + j for j in range(rng.randint(2, 12))]
            )
            low, high, _ = rng.choices(_TOOLS, [w for _, _, w in _TOOLS])[0]
            hint = high if turn < turns - 1 else None
            events.append((at, context, f"s{s}", hint))
            at += rng.uniform(1.0, 4.0) + rng.uniform(low, high)
    horizon = t
    u = 0.0
    while u < horizon:
        u += rng.expovariate(3.0)
        q += 1
        events.append(
            (
                u,
                ids.chain(-1, [-(q * 1000 + j) - 1 for j in range(rng.randint(20, 80))]),
                None,
                None,
            )
        )
    events.sort(key=lambda e: e[0])
    events = events[:num_requests]
    return AgentTrace(
        [e[1] for e in events],
        [round(e[0] * 1000, 3) for e in events],
        [e[2] for e in events],
        [e[3] for e in events],
    )


class _Ids:
    """Prefix-consistent block ids: the id of a block is determined by its whole prefix."""

    def __init__(self) -> None:
        self._ids: dict[tuple[int, int], int] = {}

    def chain(self, parent: int, tokens: list[int]) -> list[int]:
        out = []
        for token in tokens:
            key = (parent, token)
            block = self._ids.get(key)
            if block is None:
                block = self._ids[key] = len(self._ids)
            out.append(block)
            parent = block
        return out


def _chat(rng: random.Random, n: int) -> Iterator[list[int]]:
    ids = _Ids()
    systems = [
        ids.chain(-1, [10**9 + i * 1000 + j for j in range(rng.randint(2, 8))]) for i in range(8)
    ]
    open_: list[list[int]] = []
    fresh = 0
    for _ in range(n):
        if open_ and rng.random() < 0.45:
            conv = open_.pop(rng.randrange(len(open_)))
            fresh += 1
            conv = conv + ids.chain(conv[-1], [fresh * 1000 + j for j in range(rng.randint(1, 6))])
            if rng.random() < 0.8 and len(conv) < 300:
                open_.append(conv)
            yield conv
            continue
        fresh += 1
        system = systems[min(int(rng.paretovariate(1.2)) - 1, len(systems) - 1)]
        conv = system + ids.chain(system[-1], [fresh * 1000 + j for j in range(rng.randint(4, 60))])
        if rng.random() < 0.25:
            open_.append(conv)
        yield conv


def _rag(rng: random.Random, n: int) -> Iterator[list[int]]:
    ids = _Ids()
    docs = [ids.chain(-1, [i * 1000 + j for j in range(rng.randint(8, 40))]) for i in range(2000)]
    weights = [1.0 / (rank + 1) ** 0.9 for rank in range(len(docs))]
    for q in range(n):
        doc = rng.choices(docs, weights)[0]
        yield doc + ids.chain(doc[-1], [-(q * 10 + j) - 1 for j in range(rng.randint(1, 3))])


def _scan(rng: random.Random, n: int) -> Iterator[list[int]]:
    ids = _Ids()
    hot = [ids.chain(-1, [i * 1000 + j for j in range(rng.randint(10, 30))]) for i in range(40)]
    for q in range(n):
        if rng.random() < 0.3:
            yield rng.choice(hot)
        else:
            yield ids.chain(-1, [-(q * 1000 + j) - 1 for j in range(rng.randint(40, 120))])


def _loop(rng: random.Random, n: int) -> Iterator[list[int]]:
    ids = _Ids()
    prompts = [
        ids.chain(-1, [i * 1000 + j for j in range(rng.randint(10, 50))]) for i in range(300)
    ]
    for q in range(n):
        yield prompts[q % len(prompts)]


def generate(shape: str, num_requests: int, seed: int = 0) -> list[list[int]]:
    """The block ids of ``num_requests`` requests of a ``shape`` trace.

    Raises:
        ValueError: unknown shape, or ``num_requests`` below 1.
    """
    makers = {"chat": _chat, "rag": _rag, "scan": _scan, "loop": _loop}
    if shape not in makers:
        raise ValueError(f"unknown trace shape {shape!r}; known: {', '.join(SHAPES)}")
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    rng = random.Random(f"{shape}:{seed}")
    return list(makers[shape](rng, num_requests))


def generate_system(num_requests: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """A ``system`` trace: shared system prompts drowned in one-off tails, with priorities.

    Twenty system prompts (10 to 30 blocks), chosen with a Zipf skew, each followed by a
    one-off tail of 20 to 80 blocks (priority 0). The first time a system prompt is used,
    a request holding just that prompt comes first with priority 1 (an application
    declaring its system prompt), so the prompt's blocks carry priority 1 and the tails 0.

    Returns:
        ``(requests, priorities)``: block ids per request, and one priority per request.

    Raises:
        ValueError: ``num_requests`` below 1.
    """
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    rng = random.Random(f"system:{seed}")
    ids = _Ids()
    systems = [
        ids.chain(-1, [10**9 + i * 1000 + j for j in range(rng.randint(10, 30))]) for i in range(20)
    ]
    weights = [1.0 / (rank + 1) ** 1.1 for rank in range(len(systems))]
    declared: set[int] = set()
    requests: list[list[int]] = []
    priorities: list[int] = []
    q = 0
    while len(requests) < num_requests:
        s = rng.choices(range(len(systems)), weights)[0]
        if s not in declared:
            declared.add(s)
            requests.append(systems[s])
            priorities.append(1)
            continue
        q += 1
        tail = ids.chain(systems[s][-1], [-(q * 1000 + j) - 1 for j in range(rng.randint(20, 80))])
        requests.append(systems[s] + tail)
        priorities.append(0)
    return requests, priorities


def write_trace(
    path: str | Path,
    requests: list[list[int]],
    block_tokens: int = 512,
    priorities: list[int] | None = None,
    *,
    agent: AgentTrace | None = None,
) -> None:
    """Write ``requests`` as a Mooncake-format trace (one arrival every 100 ms).

    With ``priorities``, each line also carries its request's ``priority``. With
    ``agent`` (whose ``requests`` these are), the arrivals are its timestamps and each
    line of a session carries ``session`` and, when hinted, ``retain_for_s``.
    """
    stamps: Sequence[float] = (
        agent.timestamps_ms if agent is not None else [i * 100 for i in range(len(requests))]
    )
    with Path(path).open("w", encoding="utf-8") as fh:
        for i, blocks in enumerate(requests):
            record: dict[str, object] = {
                "timestamp": stamps[i],
                "input_length": len(blocks) * block_tokens,
                "output_length": 64,
                "hash_ids": blocks,
            }
            if priorities is not None:
                record["priority"] = priorities[i]
            if agent is not None and agent.sessions[i] is not None:
                record["session"] = agent.sessions[i]
                if agent.retain_for_s[i] is not None:
                    record["retain_for_s"] = agent.retain_for_s[i]
            fh.write(json.dumps(record) + "\n")
