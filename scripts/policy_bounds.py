"""Reference bounds for eviction policies on a trace: LRU, two oracles, Belady, the ceiling.

For each capacity, prints the prefix hit rate of

* ``lru``: a replay through `CpuBlockPool` with LRU (`kvoffload.replay.replay_pool`);
* ``reuse-lru``: an LRU that knows, for every access, whether the block will ever be used
  again: it does not store a block that will not be, and puts a block at its last use
  first in line for eviction (`reuse_oracle_lru_hits` below; with the oracle off the same
  model must give the pool replay's LRU figure exactly, which the script checks);
* ``first-lru`` and ``reread-lru``: the same oracle, told only about the accesses of a
  first turn (a request none of whose blocks was seen before), or only about the blocks a
  request re-reads (its leading blocks seen before); every other access counts as used
  again;
* ``static``: the ``capacity`` blocks most used over the whole trace, stored when first
  seen and kept forever (`kvoffload.replay.static_frequency_hits`);
* ``optimal``: Belady's bound (`kvoffload.replay.optimal_hits`);
* ``ceiling``: an infinite pool;

and ``needed``, what a policy must reach to close ``--gap`` of the gap between LRU and the
optimal bound.

Usage:
    .venv/bin/python scripts/policy_bounds.py TRACE [--capacity 1000,6000] [--gap 0.25]
"""

from __future__ import annotations

import argparse
from collections import OrderedDict
from collections.abc import Sequence
from typing import Literal

from kvoffload.replay import (
    ceiling_hits,
    load_trace,
    optimal_hits,
    replay_pool,
    static_frequency_hits,
)


def reuse_oracle_lru_hits(
    requests: Sequence[Sequence[int]],
    capacity: int,
    *,
    oracle: bool = True,
    only: Literal["first", "reread"] | None = None,
) -> int:
    """Prefix hits of the replay's LRU pool model, told which accesses are a block's last.

    Follows `replay_pool` step by step: pin the leading hits, allocate a block for each
    missing one (as many as the pool has free, evicting the least recently freed), publish
    them (a block whose hash is still cached further along the pool is a duplicate that
    holds nothing), free the request tail first. With ``oracle``, a missing block that is
    never used again is not stored, and a block whose access is its last goes to the
    eviction end of the queue instead of the recent end. ``only`` limits what the oracle
    is told to the accesses of first turns or to re-read blocks (see the module docstring).
    """
    used_later: list[list[bool]] = []
    seen: set[int] = set()
    for request in reversed(requests):
        used_later.append([b in seen for b in request])
        seen.update(request)
    used_later.reverse()
    if only is not None:
        seen.clear()
        for later, request in zip(used_later, requests, strict=True):
            reread = 0
            for b in request:
                if b not in seen:
                    break
                reread += 1
            for i in range(len(request)):
                told = reread == 0 if only == "first" else i < reread
                later[i] = later[i] or not told
            seen.update(request)
    queue: OrderedDict[object, None] = OrderedDict()  # slots, next to be evicted first
    hits = duplicates = 0
    for request, later in zip(requests, used_later, strict=True):
        h = 0
        for b in request:
            if b not in queue:
                break
            h += 1
        hits += h
        for b in request[:h]:
            del queue[b]
        missing = [(b, f) for b, f in zip(request[h:], later[h:], strict=True) if f or not oracle]
        k = min(len(missing), capacity - h)
        while queue and len(queue) + h + k > capacity:
            queue.popitem(last=False)
        held: list[tuple[object, bool]] = list(zip(request[:h], later[:h], strict=True))
        for b, f in missing[:k]:
            if b in queue:
                duplicates += 1
                held.append((("duplicate", duplicates), False))
            else:
                held.append((b, f))
        for slot, f in reversed(held):
            queue[slot] = None
            if oracle and not f:
                queue.move_to_end(slot, last=False)
    return hits


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("trace", help="a trace in the Mooncake format")
    parser.add_argument("--capacity", default="1000,6000", help="comma-separated block counts")
    parser.add_argument("--gap", type=float, default=0.25, help="share of the LRU-optimal gap")
    args = parser.parse_args()
    capacities = [int(c) for c in args.capacity.split(",")]
    trace = load_trace(args.trace)
    requests = trace.requests
    total = trace.num_blocks
    ceiling = ceiling_hits(requests) / total
    print(f"{args.trace}: {len(requests)} requests, {total} blocks")
    header = ("capacity", "lru", "reuse-lru", "first-lru", "reread-lru", "static", "optimal")
    print(" ".join(f"{h:>10}" for h in (*header, "ceiling", "needed")))
    for capacity in capacities:
        lru_hits = replay_pool(trace, capacity, "lru").hit_blocks
        model_hits = reuse_oracle_lru_hits(requests, capacity, oracle=False)
        if model_hits != lru_hits:
            raise SystemExit(
                f"the oracle's LRU model gives {model_hits} hits at {capacity} blocks, "
                f"the pool replay {lru_hits}: the model no longer follows the replay"
            )
        lru = lru_hits / total
        optimal = optimal_hits(requests, capacity) / total
        row = (
            lru,
            reuse_oracle_lru_hits(requests, capacity) / total,
            reuse_oracle_lru_hits(requests, capacity, only="first") / total,
            reuse_oracle_lru_hits(requests, capacity, only="reread") / total,
            static_frequency_hits(requests, capacity) / total,
            optimal,
            ceiling,
            lru + args.gap * (optimal - lru),
        )
        print(f"{capacity:>10} " + " ".join(f"{x:10.4f}" for x in row))


if __name__ == "__main__":
    main()
