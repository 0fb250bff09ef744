"""``python -m kvoffload.bench handle``: what the `OffloadRequest` handle costs per step.

Many requests decode one token per engine step. After each step the engine appends the
token, hashes a block when it fills up and reports the step to the offloader. Two ways are
timed side by side in the same run, on one open `KVOffloader`, alternating per repetition:

- low-level: the engine's own incremental hashing (``hash_block_tokens``) and
  ``off.update(request_id, table, hashes_of_computed_blocks, num_computed_tokens)``;
- handle: ``req.extend([token])`` and ``req.advance(table, num_computed_tokens)``.

Both make the same scheduler calls with the same values; the difference is the handle's
own cost. The figures are microseconds per request per step, medians over repetitions.
Stores are not planned (their cost is the same either way and is measured by
``python -m kvoffload.bench scheduler``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import anyio
import torch

from kvoffload.bench._args import output_path, positive_int, write_output
from kvoffload.config import KVLayout, OffloadConfig
from kvoffload.hashing import BlockHash, hash_block_tokens
from kvoffload.offloader import KVOffloader

__all__ = ["HandleBenchResult", "add_parser", "run_handle_bench"]


@dataclass(frozen=True, slots=True)
class HandleBenchResult:
    """Figures of one configuration (medians over repetitions).

    Attributes:
        requests: requests decoding at once.
        prompt_tokens: tokens of each prompt.
        steps: decode steps per repetition.
        low_level_us: hand-written hashing + ``update`` per request per step.
        handle_us: ``extend`` + ``advance`` per request per step.
        overhead_us: ``handle_us - low_level_us``.
    """

    requests: int
    prompt_tokens: int
    steps: int
    low_level_us: float
    handle_us: float
    overhead_us: float


def _low_level(off: KVOffloader, tag: str, requests: int, prompt: int, steps: int) -> float:
    bs = off.config.block_size
    root = off.namespace.root
    tokens = [list(range(r, r + prompt)) for r in range(requests)]
    hashes: list[list[BlockHash]] = []
    for toks in tokens:
        chain: list[BlockHash] = []
        parent = root
        for start in range(0, len(toks) - bs + 1, bs):
            parent = hash_block_tokens(parent, toks[start : start + bs])
            chain.append(parent)
        hashes.append(chain)
    tables = [list(range(-(-(prompt + steps) // bs))) for _ in range(requests)]
    ids = [f"{tag}-{r}" for r in range(requests)]
    for r in range(requests):
        off.update(ids[r], tables[r], hashes[r], prompt)
    t0 = time.perf_counter()
    for step in range(steps):
        for r in range(requests):
            toks, chain = tokens[r], hashes[r]
            toks.append(step)
            if len(toks) % bs == 0:
                chain.append(hash_block_tokens(chain[-1] if chain else root, toks[-bs:]))
            computed = len(toks) - 1
            n = computed // bs
            off.update(ids[r], tables[r], chain if n >= len(chain) else chain[:n], computed)
    elapsed = time.perf_counter() - t0
    for rid in ids:
        off.finish(rid)
    return elapsed


def _handle(off: KVOffloader, tag: str, requests: int, prompt: int, steps: int) -> float:
    bs = off.config.block_size
    reqs = [off.request(f"{tag}-{r}", list(range(r, r + prompt))) for r in range(requests)]
    tables = [list(range(-(-(prompt + steps) // bs))) for _ in range(requests)]
    for req, table in zip(reqs, tables, strict=True):
        req.advance(table, prompt)
    t0 = time.perf_counter()
    for step in range(steps):
        for req, table in zip(reqs, tables, strict=True):
            req.extend((step,))
            req.advance(table, req.num_tokens - 1)
    elapsed = time.perf_counter() - t0
    for req in reqs:
        req.finish()
    return elapsed


async def _measure(
    requests: int, prompt: int, steps: int, reps: int
) -> tuple[list[float], list[float]]:
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_size=8, dtype="float16", block_size=16)
    # Every request's table names GPU blocks 0 .. its length - 1: the GPU cache holds that many.
    num_gpu_blocks = -(-(prompt + steps) // layout.block_size)
    kv = [torch.zeros(layout.tensor_shape(num_gpu_blocks), dtype=torch.float16)]
    config = OffloadConfig(block_size=16, num_cpu_blocks=16, pin_memory="never")
    low: list[float] = []
    high: list[float] = []
    per = requests * steps
    async with KVOffloader(config, kv, layout=layout) as off:
        for rep in range(reps):
            order = (_low_level, _handle) if rep % 2 == 0 else (_handle, _low_level)
            for fn in order:
                seconds = fn(off, f"{fn.__name__}{rep}", requests, prompt, steps)
                (low if fn is _low_level else high).append(seconds / per * 1e6)
    return low, high


def run_handle_bench(
    requests: int = 64, prompt_tokens: int = 2000, steps: int = 200, reps: int = 7
) -> HandleBenchResult:
    """Measure the low-level calls and the handle side by side, ``reps`` times each."""
    low, high = anyio.run(_measure, requests, prompt_tokens, steps, reps)
    lo, hi = statistics.median(low), statistics.median(high)
    return HandleBenchResult(
        requests=requests,
        prompt_tokens=prompt_tokens,
        steps=steps,
        low_level_us=lo,
        handle_us=hi,
        overhead_us=hi - lo,
    )


def _run(args: argparse.Namespace) -> int:
    res = run_handle_bench(args.requests, args.prompt_tokens, args.steps, args.reps)
    print(
        f"{'requests':>8} {'prompt':>6} {'steps':>5} {'low-level us':>12} "
        f"{'handle us':>9} {'overhead us':>11}   (per request per step)"
    )
    print(
        f"{res.requests:>8} {res.prompt_tokens:>6} {res.steps:>5} {res.low_level_us:>12.2f} "
        f"{res.handle_us:>9.2f} {res.overhead_us:>11.2f}"
    )
    print(f"medians of {args.reps} repetitions, alternating which way runs first")
    if args.json:
        write_output(args.json, json.dumps(asdict(res), indent=2) + "\n")
    return 0


def add_parser(subparsers: Any) -> None:
    """Register the ``handle`` subcommand."""
    p = subparsers.add_parser(
        "handle",
        help="OffloadRequest extend + advance cost per step, against the low-level calls",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--requests", type=positive_int, default=64, help="decoding requests (default 64)"
    )
    p.add_argument("--prompt-tokens", type=positive_int, default=2000, help="tokens per prompt")
    p.add_argument("--steps", type=positive_int, default=200, help="decode steps per repetition")
    p.add_argument("--reps", type=positive_int, default=7, help="repetitions; medians are shown")
    p.add_argument("--json", type=output_path, default=None, help="also write the figures here")
    p.set_defaults(run=_run)
