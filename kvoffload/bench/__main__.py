"""``python -m kvoffload.bench {pool,copy,scheduler,handle,tier}``: the benchmarks of the docs.

The same commands run as ``kvoffload bench ...`` (the console script, `kvoffload.cli`).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from kvoffload.bench._args import CommandError

_SUBCOMMANDS = {
    "pool": ("kvoffload.bench.pool", "replay a Mooncake-format trace through CpuBlockPool"),
    "copy": ("kvoffload.bench.copy", "store/load bandwidth vs a contiguous copy"),
    "scheduler": (
        "kvoffload.bench.scheduler",
        "plan_stores + complete cost per block for many running requests",
    ),
    "handle": (
        "kvoffload.bench.handle",
        "OffloadRequest extend + advance cost per step, against the low-level calls",
    ),
    "tier": ("kvoffload.bench.tier", "disk / redis tier GB/s vs the raw path"),
}


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the subcommand and run its benchmark; return the exit code.

    Only the chosen benchmark's module is imported (``--help`` imports none of them, so it
    does not import torch). Bad arguments exit 2 with argparse's usage message; a benchmark
    that cannot run on what it was given prints one line and returns 1.
    """
    args_list = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m kvoffload.bench", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    chosen = args_list[0] if args_list else None
    for name, (module_name, summary) in _SUBCOMMANDS.items():
        if name == chosen:
            importlib.import_module(module_name).add_parser(sub)
        else:
            sub.add_parser(name, help=summary)
    args = parser.parse_args(args_list)
    args.argv = args_list  # what a benchmark echoes as its command, however it was started
    try:
        code: int = args.run(args)
    except CommandError as exc:
        print(f"{parser.prog} {args.command}: error: {exc}", file=sys.stderr)
        return 1
    return code


if __name__ == "__main__":
    sys.exit(main())
