"""``python -m kvoffload.bench {pool,copy,scheduler,handle,tier}``: the benchmarks of the docs.

The same commands run as ``kvoffload bench ...`` (the console script, `kvoffload.cli`).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

_SUBCOMMANDS = {
    "pool": "kvoffload.bench.pool",
    "copy": "kvoffload.bench.copy",
    "scheduler": "kvoffload.bench.scheduler",
    "handle": "kvoffload.bench.handle",
    "tier": "kvoffload.bench.tier",
}


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the subcommand and run its benchmark; return the exit code."""
    parser = argparse.ArgumentParser(prog="python -m kvoffload.bench", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for module_name in _SUBCOMMANDS.values():
        module = importlib.import_module(module_name)
        module.add_parser(sub)
    args = parser.parse_args(argv)
    code: int = args.run(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
