"""Instructions the request handle's step path executes, in another checkout and in this one.

Timings on a shared VM move by ±10 % between identical runs; the number of machine
instructions a workload executes does not. Each figure comes from one process under
``valgrind --tool=callgrind --instr-atstart=no``: it imports kvoffload from a checkout,
opens a `KVOffloader` on CPU tensors with a `ControllableCopyEngine` and prepares the
workload uninstrumented; then the parent switches instrumentation on
(``callgrind_control -i on``) and the process runs one stage without yielding to the event
loop (a copy is ended by ``complete_all()`` and delivered by one ``poller.poll()``, so no
timer or thread decides what runs) and exits at once. The stages:

* ``decode``: the handle side of ``python -m kvoffload.bench handle``: ``--requests``
  handles with ``--prompt`` tokens each decode ``--steps`` tokens, ``req.extend([token])``
  and ``req.advance(table, num_tokens - 1)`` per request per step, no stores;
* ``trace``: the first ``--trace-requests`` requests of a Mooncake trace (each ``hash_ids``
  entry becomes one block of 16 tokens, so requests share exactly the prefixes the trace
  gives), in waves of ``--wave``: per wave ``off.request()``, ``req.lookup()``,
  ``req.load()`` of the hit, the prefill's ``req.advance()``, ``off.store()``, then
  ``--decode`` steps of ``extend`` + ``advance`` + ``store()``, then ``req.finish()``;
  every copy completes before the next call. The CPU pool holds ``--cpu-blocks`` blocks,
  so the later waves evict.

With ``--groups`` both checkouts run the stages on a hybrid model (a full-attention group
and a sliding window of 4 blocks, one table per group), through the same handle calls.

The ratio is this checkout over the other (1.00 = the same work).

Usage:
    git worktree add /tmp/base 5653c50
    .venv/bin/python scripts/handle_instructions.py /tmp/base \\
        [--trace ../shared/traces/synthetic_trace.jsonl] [--stages decode,trace] [--groups]

Needs valgrind (``apt-get install valgrind``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from _callgrind import count_after_ready, have_callgrind

STAGES = ("decode", "trace")

_CHILD = r"""
import json, os, sys
checkout, stage, trace = sys.argv[1:4]
requests, prompt, steps, trace_requests, wave, decode, cpu_blocks, grouped = map(
    int, sys.argv[4:12]
)
sys.path.insert(0, checkout)
import anyio
import torch
import kvoffload
from kvoffload.config import OffloadConfig
from kvoffload.layout import KVLayout
from kvoffload.offloader import KVOffloader
from kvoffload.testing import ControllableCopyEngine
if not kvoffload.__file__.startswith(checkout):
    raise SystemExit(f"imported {kvoffload.__file__}, not from {checkout}")
bs = 16
if stage == "decode":
    prompts = [list(range(r, r + prompt)) for r in range(requests)]
    width = -(-(prompt + steps) // bs)
    gpu_blocks = width
else:
    with open(trace, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()][:trace_requests]
    prompts = [
        [h * bs + i for h in row["hash_ids"] for i in range(bs)] + [1 << 40 | n]
        for n, row in enumerate(rows)
    ]
    width = max(-(-(len(p) + decode) // bs) for p in prompts)
    gpu_blocks = width * wave
layout = KVLayout(num_layers=1, num_kv_heads=1, head_size=8, dtype="float16", block_size=bs)
config = OffloadConfig(block_size=bs, num_cpu_blocks=cpu_blocks, pin_memory="never")
if grouped:  # a hybrid model: a full-attention group and a sliding window of 4 blocks
    from kvoffload.groups import KVCacheGroup

    names = ("full", "win")
    groups = [
        KVCacheGroup.from_layout(layout, name="full"),
        KVCacheGroup.from_layout(layout, name="win", kind="sliding_window", window=4 * bs),
    ]
    kv = {n: [torch.zeros(layout.tensor_shape(gpu_blocks), dtype=torch.float16)] for n in names}
    engines = {
        n: ControllableCopyEngine(num_gpu_blocks=gpu_blocks, num_cpu_blocks=cpu_blocks)
        for n in names
    }
    options = {"groups": groups, "copy_engine": dict(engines)}
    table_of = lambda t: {"full": t, "win": t}
else:
    kv = [torch.zeros(layout.tensor_shape(gpu_blocks), dtype=torch.float16)]
    engines = {"": ControllableCopyEngine(num_gpu_blocks=gpu_blocks, num_cpu_blocks=cpu_blocks)}
    options = {"layout": layout, "copy_engine": engines[""]}
    table_of = lambda t: t


def settle(off):
    for engine in engines.values():
        engine.complete_all()
    off._life.launcher.poller.poll()


def run_decode(off):
    reqs = [off.request(f"d{r}", p) for r, p in enumerate(prompts)]
    tables = [table_of(list(range(width))) for _ in reqs]
    for req, table in zip(reqs, tables):
        req.advance(table, prompt)
    ready()
    for step in range(steps):
        for req, table in zip(reqs, tables):
            req.extend((step,))
            req.advance(table, req.num_tokens - 1)


def run_trace(off):
    ready()
    for start in range(0, len(prompts), wave):
        batch = prompts[start : start + wave]
        reqs = [off.request(f"t{start + k}", p) for k, p in enumerate(batch)]
        tables = [table_of(list(range(k * width, (k + 1) * width))) for k in range(len(batch))]
        for req, table in zip(reqs, tables):
            if req.lookup():
                req.load(table)
        settle(off)
        for req, table in zip(reqs, tables):
            req.advance(table, req.num_tokens - 1)
        off.store()
        settle(off)
        for step in range(decode):
            for req, table in zip(reqs, tables):
                req.extend((step,))
                req.advance(table, req.num_tokens - 1)
            off.store()
            settle(off)
        for req in reqs:
            req.finish()
        settle(off)


def ready():
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    sys.stdin.readline()


async def main():
    async with KVOffloader(config, kv, **options) as off:
        (run_decode if stage == "decode" else run_trace)(off)
        sys.stdout.flush()
        os._exit(0)


anyio.run(main)
"""


def count(checkout: Path, stage: str, args: argparse.Namespace) -> int:
    """Instructions of one stage, run from ``checkout``."""
    return count_after_ready(
        _CHILD,
        [
            str(checkout),
            stage,
            str(args.trace.resolve()),
            *(
                str(v)
                for v in (
                    args.requests,
                    args.prompt,
                    args.steps,
                    args.trace_requests,
                    args.wave,
                    args.decode,
                    args.cpu_blocks,
                    int(args.groups),
                )
            ),
        ],
    )


def main() -> int:
    here = Path(__file__).resolve().parent.parent
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("base", type=Path, help="a checkout to compare with (git worktree)")
    parser.add_argument(
        "--trace", type=Path, default=here.parent / "shared/traces/synthetic_trace.jsonl"
    )
    parser.add_argument("--requests", type=int, default=64, help="decode: requests")
    parser.add_argument("--prompt", type=int, default=2000, help="decode: prompt tokens")
    parser.add_argument("--steps", type=int, default=200, help="decode: steps")
    parser.add_argument("--trace-requests", type=int, default=400, help="trace: requests")
    parser.add_argument("--wave", type=int, default=16, help="trace: requests at once")
    parser.add_argument("--decode", type=int, default=8, help="trace: decode steps each")
    parser.add_argument("--cpu-blocks", type=int, default=4096, help="trace: CPU pool blocks")
    parser.add_argument(
        "--groups",
        action="store_true",
        help="both checkouts run a hybrid model (full attention + a sliding window of 4 "
        "blocks) through the handle, per-group tables",
    )
    parser.add_argument("--stages", default=",".join(STAGES))
    args = parser.parse_args()
    if not have_callgrind():
        print("valgrind is not installed (apt-get install valgrind)", file=sys.stderr)
        return 2
    stages = args.stages.split(",")
    if "trace" in stages and not args.trace.is_file():
        print(f"no trace at {args.trace} (--trace)", file=sys.stderr)
        return 2
    base = args.base.resolve()
    print(
        f"handle instructions: decode {args.requests} requests x {args.steps} steps, "
        f"trace {args.trace_requests} requests in waves of {args.wave}; "
        f"ratio = {here.name} / {base.name}"
    )
    print(f"{'stage':>8} {'base (M)':>10} {'new (M)':>10} {'ratio':>6}")
    for stage in stages:
        old, new = count(base, stage, args), count(here, stage, args)
        print(f"{stage:>8} {old / 1e6:>10.1f} {new / 1e6:>10.1f} {new / old:>6.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
