"""Benchmarks and workloads: ``kvoffload bench --help`` or ``python -m kvoffload.bench --help``.

Each subcommand module exposes ``add_parser(subparsers)``, which registers the command and
sets ``run(args) -> int`` as its default.
"""
