"""The ``kvoffload`` command line: replay traces through the pool, size a pool, benchmark.

Needs the ``cli`` extra (from a kvoffload clone, ``pip install '.[cli]'``); ``--plot``
also needs the ``plot`` extra. Every command takes ``--json PATH`` (``-`` for standard
output) to write its figures as JSON, and prints a table otherwise.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvoffload._extras import needs_extra

try:
    import click
    from rich.console import Console
except ImportError as exc:  # pragma: no cover - exercised without the extra
    raise ImportError(needs_extra("the kvoffload command line", "cli")) from exc

from kvoffload.bench._args import parse_int_list

# Start-up stays light: ``--version`` and ``--help`` import only what the option help
# needs (none of it imports torch); each command imports its machinery when it runs.
from kvoffload.bench.tracegen import HINT_SHAPES, PRIORITY_SHAPES, SHAPES
from kvoffload.pool.policies import POLICY_NAMES
from kvoffload.pool.policies.admission import ADMISSION_HELP, parse_admission

if TYPE_CHECKING:
    from rich.table import Table

    from kvoffload.replay import ReplayReport, Trace

__all__ = ["LAYOUT_PRESETS", "cli", "main"]

LAYOUT_PRESETS: dict[str, dict[str, Any]] = {
    "llama3-8b": {"num_layers": 32, "num_kv_heads": 8, "head_size": 128},
    "llama3-70b": {"num_layers": 80, "num_kv_heads": 8, "head_size": 128},
    "qwen2.5-7b": {"num_layers": 28, "num_kv_heads": 4, "head_size": 128},
    "mistral-7b": {"num_layers": 32, "num_kv_heads": 8, "head_size": 128},
}
"""Model geometries ``kvoffload size --layout`` accepts by name (KV heads before any TP split)."""

_GIB = 1 << 30


# -- parameter types --------------------------------------------------------------------


def _int_list(_ctx: click.Context | None, param: click.Parameter, value: str) -> list[int]:
    try:
        return parse_int_list(value)
    except ValueError as exc:  # click names the option: "Invalid value for '--capacity'"
        raise click.BadParameter(str(exc)) from None


def _policies(_ctx: click.Context | None, param: click.Parameter, value: str) -> list[str]:
    names = [v.strip().lower() for v in value.split(",") if v.strip()]
    if names == ["all"]:
        return list(POLICY_NAMES)
    unknown = [n for n in names if n not in POLICY_NAMES]
    if unknown or not names:
        raise click.BadParameter(
            f"unknown policy {', '.join(unknown) or repr(value)}; "
            f"known policies: {', '.join(POLICY_NAMES)} (or 'all')"
        )
    return list(dict.fromkeys(names))


def _policy(ctx: click.Context | None, param: click.Parameter, value: str) -> str:
    names = _policies(ctx, param, value)
    if len(names) != 1:
        raise click.BadParameter(f"give one policy, got {value!r}")
    return names[0]


def _admission(_ctx: click.Context | None, param: click.Parameter, value: str) -> str:
    try:
        parse_admission(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None
    return value.strip().lower()


def _layout(_ctx: click.Context | None, param: click.Parameter, value: str) -> dict[str, Any]:
    preset = LAYOUT_PRESETS.get(value.strip().lower())
    if preset is not None:
        return dict(preset)
    fields: dict[str, Any] = {}
    for part in value.split(","):
        key, sep, raw = part.partition("=")
        key = key.strip()
        if not sep or key not in {"num_layers", "num_kv_heads", "head_size"}:
            raise click.BadParameter(
                f"{value!r} is neither a preset ({', '.join(LAYOUT_PRESETS)}) nor "
                "num_layers=N,num_kv_heads=N,head_size=N"
            )
        try:
            fields[key] = int(raw)
        except ValueError:
            raise click.BadParameter(f"{key}={raw!r} is not an integer") from None
    missing = {"num_layers", "num_kv_heads", "head_size"} - set(fields)
    if missing:
        raise click.BadParameter(f"layout {value!r} lacks {', '.join(sorted(missing))}")
    return fields


def _target(_ctx: click.Context | None, param: click.Parameter, value: str) -> float:
    # click's FloatRange lets NaN through (every comparison with it is false).
    try:
        target = float(value)
    except ValueError:
        raise click.BadParameter(f"{value!r} is not a number") from None
    if not (math.isfinite(target) and 0.0 < target <= 1.0):
        raise click.BadParameter(f"must be a number in (0, 1], got {value!r}")
    return target


def _output(_ctx: click.Context | None, param: click.Parameter, value: str | None) -> str | None:
    """Check before any work that an output path can be written ('-' is standard output)."""
    if value is None or (value == "-" and param.name == "json_out"):
        return value
    path = Path(value)
    parent = path.parent
    if path.is_dir():
        raise click.BadParameter(f"{value!r} is a directory, not a file")
    if not parent.is_dir():
        raise click.BadParameter(f"cannot write {value!r}: {str(parent)!r} is not a directory")
    if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise click.BadParameter(f"cannot write {value!r}: permission denied")
    return value


def _load(path: Path) -> Trace:
    from kvoffload.replay import load_trace  # noqa: PLC0415 (keep start-up light)

    try:
        trace = load_trace(path)
    except FileNotFoundError as exc:
        raise click.FileError(str(path), hint=str(exc)) from None
    except OSError as exc:
        raise click.FileError(str(path), hint=exc.strerror or str(exc)) from None
    except ValueError as exc:  # TraceFormatError: names the file, line and field
        raise click.ClickException(str(exc)) from None
    if not trace.num_blocks:
        raise click.ClickException(f"{path}: the trace holds no request with a block")
    return trace


def _write_text(target: str, text: str) -> None:
    try:
        Path(target).write_text(text, encoding="utf-8")
    except OSError as exc:
        raise click.FileError(target, hint=exc.strerror or str(exc)) from None


def _write_json(target: str, payload: dict[str, Any]) -> None:
    text = json.dumps(payload, indent=2) + "\n"
    if target == "-":
        click.echo(text, nl=False)
    else:
        _write_text(target, text)


_UNCUT_WIDTH = 100_000
"""Columns of a console that is not a terminal: wide enough that no cell is ever cut."""


def _stdout() -> Console:
    """The console tables print to: standard output.

    On a terminal, rich fits a table to its width (a cell may end in ``…``). In a pipe or
    a log there is no width to fit, and rich's default of 80 columns would cut cells
    (``0.04…``), so every cell is printed whole and no line is padded.
    """
    console = Console()
    if console.is_terminal:
        return console
    return Console(width=_UNCUT_WIDTH)


def _save_figure(plt: Any, fig: Any, path: Path) -> None:
    """Lay out and write a figure to ``path``; a file that cannot be written is a click
    error naming it. The figure is closed either way."""
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
    except OSError as exc:
        raise click.FileError(str(path), hint=exc.strerror or str(exc)) from None
    finally:
        plt.close(fig)


@contextmanager
def _progress(enabled: bool, total: int, what: str) -> Iterator[Callable[[int], None]]:
    from rich.progress import (  # noqa: PLC0415 (keep start-up light)
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TimeElapsedColumn,
    )

    console = Console(stderr=True)
    if not enabled:
        yield lambda _n: None
        return
    columns = (
        "[progress.description]{task.description}",
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task(what, total=total)
        yield lambda n: bar.advance(task, n)


_json_option = click.option(
    "--json",
    "json_out",
    metavar="PATH",
    default=None,
    callback=_output,
    help="Also write the figures as JSON to PATH ('-': standard output, table suppressed).",
)
_progress_option = click.option(
    "--progress/--no-progress", default=True, help="Show a progress bar on stderr."
)


# -- the commands ----------------------------------------------------------------------------


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="kvoffload")
def cli() -> None:
    """kvoffload: replay request traces through the CPU block pool, size a pool, benchmark."""


@cli.command()
@click.argument("trace", type=click.Path(path_type=Path, dir_okay=False))
@click.option(
    "--capacity",
    default="1000,6000,20000",
    show_default=True,
    callback=_int_list,
    help="Comma-separated pool sizes in blocks.",
)
@click.option(
    "--policy",
    "policies",
    default="all",
    show_default=True,
    callback=_policies,
    help=f"Comma-separated eviction policies ({', '.join(POLICY_NAMES)}) or 'all'.",
)
@click.option(
    "--admission",
    default="always",
    show_default=True,
    callback=_admission,
    help=f"Admission filter for every policy: {ADMISSION_HELP}.",
)
@click.option(
    "--plot",
    metavar="PNG",
    default=None,
    callback=_output,
    help="Draw hit rate against capacity (the suffix picks the format: .png, .svg, .pdf).",
)
@click.option(
    "--explain",
    is_flag=True,
    help="Split each policy's misses into cold (first use), capacity (evicted, then "
    "needed again) and other; with --plot, also draws them to PLOT-misses.SUFFIX.",
)
@click.option(
    "--max-retained-fraction",
    "retained_fraction",
    default=0.1,
    show_default=True,
    type=click.FloatRange(0.0, 1.0, min_open=True),
    help="The share of the pool retention hints (a trace's retain_for_s) may hold.",
)
@_json_option
@_progress_option
def replay(
    *,
    trace: Path,
    capacity: list[int],
    policies: list[str],
    admission: str,
    plot: str | None,
    explain: bool,
    retained_fraction: float,
    json_out: str | None,
    progress: bool,
) -> None:
    """Replay TRACE (Mooncake JSON lines) through CpuBlockPool with each policy.

    Prints the prefix hit rate per capacity and policy next to the optimal bound
    (Belady: evict the block used farthest in the future) and the infinite-capacity
    ceiling. A capacity above what the trace can use (its distinct blocks plus its
    longest request) replays with that many blocks, and the table says so. A trace
    whose requests give retention hints (retain_for_s, e.g. synth-trace agent) is
    replayed without and with them, side by side.
    """
    from kvoffload.replay import run_replay  # noqa: PLC0415 (keep start-up light)

    if plot is not None:
        _plot_format(plot)
    data = _load(trace)
    total = len(data.requests) * len(capacity) * len(policies) * (2 if data.hints else 1)
    with _progress(progress, total, "replaying") as advance:
        report = run_replay(
            data,
            capacity,
            policies,
            admission,
            explain=explain,
            retained_fraction=retained_fraction,
            on_progress=advance,
        )
    if json_out is not None:
        _write_json(json_out, report.to_json())
    if json_out != "-":
        console = _stdout()
        console.print(_replay_table(report))
        if report.rows and any(
            len(r.by_priority) > 1 or r.by_priority[0].priority for r in report.rows[0].results
        ):
            console.print(_priority_table(report))
        if report.rows and report.rows[0].hinted:
            console.print(_hints_table(report))
        if explain:
            console.print(_misses_table(report))
        capped = [row.capacity for row in report.rows if row.pool_blocks < row.capacity]
        if capped:
            click.echo(
                f"capacity {', '.join(f'{c:,}' for c in capped)} replayed with "
                f"{report.useful_capacity:,} blocks, the most this trace can use "
                "(a pool that size never evicts)"
            )
    if plot is not None:
        _plot(report, Path(plot))
        if explain:
            _plot_misses(report, Path(plot))


def _hints_table(report: ReplayReport) -> Table:
    from rich.table import Table  # noqa: PLC0415 (keep start-up light)

    table = Table(title="prefix hit rate without and with retention hints", title_justify="left")
    for name in ("capacity", "policy", "no hints", "hints", "change"):
        table.add_column(name, justify="right")
    for row in report.rows:
        for plain, hinted in zip(row.results, row.hinted, strict=True):
            table.add_row(
                f"{row.capacity:,}",
                plain.policy,
                f"{plain.hit_rate:.4f}",
                f"{hinted.hit_rate:.4f}",
                f"{hinted.hit_rate - plain.hit_rate:+.4f}",
            )
    return table


def _misses_table(report: ReplayReport) -> Table:
    from rich.table import Table  # noqa: PLC0415 (keep start-up light)

    table = Table(
        title="missed blocks by cause: cold (first use), capacity (evicted, then needed "
        "again), other",
        title_justify="left",
    )
    for name in ("capacity", "policy", "cold", "capacity misses", "other", "miss rate"):
        table.add_column(name, justify="right")
    for row in report.rows:
        for r in (*row.results, *row.hinted):
            m = r.misses
            if m is None:
                continue
            table.add_row(
                f"{row.capacity:,}",
                r.policy + (" +hints" if r.hinted else ""),
                f"{m.cold:,}",
                f"{m.capacity:,}",
                f"{m.other:,}",
                f"{(m.cold + m.capacity + m.other) / report.blocks:.4f}",
            )
    return table


def _plot_misses(report: ReplayReport, path: Path) -> None:
    """Stacked bars per capacity and policy: cold, capacity and other misses."""
    plt = _matplotlib()
    path = path.with_name(f"{path.stem}-misses{path.suffix}")
    results = [(row.capacity, r) for row in report.rows for r in (*row.results, *row.hinted)]
    labels = [f"{r.policy}{'+h' if r.hinted else ''}\n{c:,}" for c, r in results]
    x = list(range(len(results)))
    fig, ax = plt.subplots(figsize=(max(7.0, 0.5 * len(x)), 4.5))
    bottom = [0.0] * len(x)
    for part in ("cold", "capacity", "other"):
        values = [getattr(r.misses, part) / report.blocks if r.misses else 0.0 for _, r in results]
        ax.bar(x, values, bottom=bottom, label=part)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set_xticks(x, labels, fontsize="x-small")
    ax.set_ylabel("missed blocks / block accesses")
    ax.set_title(f"{Path(report.trace).name}: misses by cause, per policy and capacity")
    ax.legend(fontsize="small")
    _save_figure(plt, fig, path)


def _replay_table(report: ReplayReport) -> Table:
    from rich.table import Table  # noqa: PLC0415 (keep start-up light)

    names = [r.policy for r in report.rows[0].results] if report.rows else []
    table = Table(
        title=f"prefix hit rate, {report.trace} ({report.requests:,} requests, "
        f"{report.blocks:,} blocks, admission {report.admission})",
        title_justify="left",
    )
    table.add_column("capacity", justify="right")
    for name in names:
        table.add_column(name, justify="right")
    table.add_column("best static", justify="right")
    table.add_column("optimal", justify="right", style="cyan")
    table.add_column("ceiling", justify="right", style="cyan")
    for row in report.rows:
        best = max(r.hit_rate for r in row.results)
        cells = [
            f"[bold]{r.hit_rate:.4f}[/bold]" if r.hit_rate == best else f"{r.hit_rate:.4f}"
            for r in row.results
        ]
        static = (
            f"{row.best_static_hit_rate:.4f} ({row.best_static_policy})"
            if row.best_static_hit_rate is not None
            else "-"
        )
        table.add_row(
            f"{row.capacity:,}",
            *cells,
            static,
            f"{row.optimal_hit_rate:.4f}",
            f"{report.ceiling_hit_rate:.4f}",
        )
    return table


def _priority_table(report: ReplayReport) -> Table:
    from rich.table import Table  # noqa: PLC0415 (keep start-up light)

    names = [r.policy for r in report.rows[0].results]
    table = Table(title="prefix hit rate per request priority", title_justify="left")
    table.add_column("capacity", justify="right")
    table.add_column("priority", justify="right")
    table.add_column("requests", justify="right")
    for name in names:
        table.add_column(name, justify="right")
    for row in report.rows:
        for i, level in enumerate(row.results[0].by_priority):
            table.add_row(
                f"{row.capacity:,}",
                str(level.priority),
                f"{level.requests:,}",
                *(f"{r.by_priority[i].hit_rate:.4f}" for r in row.results),
            )
    return table


def _matplotlib() -> Any:
    try:
        import matplotlib  # noqa: PLC0415 (optional extra)

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        raise click.ClickException(needs_extra("--plot (matplotlib)", "plot")) from None
    return plt


def _plot_format(path: str) -> None:
    """Refuse, before any work, a --plot path whose suffix matplotlib cannot write."""
    _matplotlib()
    from matplotlib.backend_bases import FigureCanvasBase  # noqa: PLC0415 (optional extra)

    suffix = Path(path).suffix.lstrip(".").lower()
    formats = FigureCanvasBase.get_supported_filetypes()
    if suffix not in formats:
        raise click.BadParameter(
            f"cannot write {path!r}: suffix {suffix!r} is not one of {', '.join(sorted(formats))}",
            param_hint="'--plot'",
        )


def _plot(report: ReplayReport, path: Path) -> None:
    plt = _matplotlib()
    capacities = [row.capacity for row in report.rows]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    names = [r.policy for r in report.rows[0].results] if report.rows else []
    for i, name in enumerate(names):
        rates = [row.results[i].hit_rate for row in report.rows]
        ax.plot(capacities, rates, marker="o", label=name)
    ax.plot(
        capacities,
        [row.optimal_hit_rate for row in report.rows],
        linestyle="--",
        color="black",
        label="optimal (Belady)",
    )
    ax.axhline(report.ceiling_hit_rate, linestyle=":", color="grey", label="ceiling (infinite)")
    ax.set_xscale("log")
    ax.set_xlabel("CPU pool capacity (blocks)")
    ax.set_ylabel("prefix hit rate")
    ax.set_ylim(0, min(1.0, report.ceiling_hit_rate * 1.15 + 0.02))
    ax.set_title(f"{Path(report.trace).name}: hit rate by policy (admission {report.admission})")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    _save_figure(plt, fig, path)


@cli.command()
@click.option(
    "--trace",
    "trace_path",
    required=True,
    type=click.Path(path_type=Path, dir_okay=False),
    help="Mooncake-format trace (JSON lines).",
)
@click.option(
    "--layout",
    required=True,
    callback=_layout,
    help=f"A preset ({', '.join(LAYOUT_PRESETS)}) or num_layers=N,num_kv_heads=N,head_size=N.",
)
@click.option(
    "--dtype",
    default="bfloat16",
    show_default=True,
    type=click.Choice(["float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"]),
    help="KV element type.",
)
@click.option(
    "--block-tokens",
    default=512,
    show_default=True,
    type=click.IntRange(1, 1 << 20),
    help="Tokens per trace block (Mooncake traces: 512).",
)
@click.option(
    "--target",
    default="0.9",
    show_default=True,
    callback=_target,
    help="Fraction of the infinite-capacity hit rate to reach, in (0, 1].",
)
@click.option("--policy", default="lru", show_default=True, callback=_policy, help="Policy.")
@click.option(
    "--admission", default="always", show_default=True, callback=_admission, help=ADMISSION_HELP
)
@_json_option
@_progress_option
def size(
    *,
    trace_path: Path,
    layout: dict[str, Any],
    dtype: str,
    block_tokens: int,
    target: float,
    policy: str,
    admission: str,
    json_out: str | None,
    progress: bool,
) -> None:
    """The smallest pool that reaches TARGET x the ceiling hit rate with a policy.

    Bisects the capacity, replaying the trace each time, and converts the answer to GiB
    for the layout (one trace block holds --block-tokens tokens of KV).
    """
    from kvoffload.config import KVLayout  # noqa: PLC0415 (imports torch)
    from kvoffload.errors import ConfigError  # noqa: PLC0415
    from kvoffload.replay import smallest_capacity  # noqa: PLC0415

    try:
        kv = KVLayout(dtype=dtype, block_size=block_tokens, **layout)
    except ConfigError as exc:
        raise click.BadParameter(str(exc), param_hint="--layout") from None
    data = _load(trace_path)
    steps = max(1, data.num_unique).bit_length() + 1
    with _progress(progress, steps * len(data.requests), "sizing") as advance:
        capacity, rate, ceiling = smallest_capacity(
            data, target, policy, admission, on_progress=advance
        )
    gib = capacity * kv.bytes_per_block / _GIB
    payload = {
        "trace": str(trace_path),
        "policy": policy,
        "admission": admission,
        "target": target,
        "ceiling_hit_rate": ceiling,
        "capacity_blocks": capacity,
        "hit_rate": rate,
        "bytes_per_block": kv.bytes_per_block,
        "gib": gib,
        "layout": kv.model_dump(),
    }
    if json_out is not None:
        _write_json(json_out, payload)
    if json_out != "-":
        from rich.table import Table  # noqa: PLC0415 (keep start-up light)

        table = Table(
            title=f"pool size for {target:.0%} of the ceiling, {policy}", title_justify="left"
        )
        for col in ("blocks", "GiB", "hit rate", "ceiling", "bytes/block"):
            table.add_column(col, justify="right")
        table.add_row(
            f"{capacity:,}",
            f"{gib:,.2f}",
            f"{rate:.4f}",
            f"{ceiling:.4f}",
            f"{kv.bytes_per_block:,}",
        )
        _stdout().print(table)


@cli.command("synth-trace")
@click.argument("shape", type=click.Choice(SHAPES + PRIORITY_SHAPES + HINT_SHAPES))
@click.argument("out", callback=_output, metavar="OUT")
@click.option("--requests", default=4000, show_default=True, type=click.IntRange(1, 10_000_000))
@click.option("--seed", default=0, show_default=True, type=int, help="Same seed, same trace.")
@_json_option
def synth_trace(*, shape: str, out: str, requests: int, seed: int, json_out: str | None) -> None:
    """Write a seeded synthetic trace of a SHAPE (chat, rag, scan, loop, system, agent) to OUT.

    The traces have the Mooncake format, so ``kvoffload replay`` compares policies on
    reuse shapes other than one recorded trace's. ``system`` carries a priority per
    request: shared system prompts at 1, one-off tails at 0. ``agent`` carries sessions
    whose context grows each turn, tool pauses of varying length, timestamps and a
    retention hint (retain_for_s) on each turn but a session's last.
    """
    from kvoffload.bench import tracegen  # noqa: PLC0415

    priorities: list[int] | None = None
    agent = None
    if shape == "system":
        blocks, priorities = tracegen.generate_system(requests, seed)
    elif shape == "agent":
        agent = tracegen.generate_agent(requests, seed)
        blocks = agent.requests
    else:
        blocks = tracegen.generate(shape, requests, seed)
    try:
        tracegen.write_trace(out, blocks, priorities=priorities, agent=agent)
    except OSError as exc:
        raise click.FileError(out, hint=exc.strerror or str(exc)) from None
    summary = {
        "path": str(out),
        "shape": shape,
        "seed": seed,
        "requests": len(blocks),
        "blocks": sum(len(b) for b in blocks),
        "unique_blocks": len({x for b in blocks for x in b}),
    }
    if json_out is not None:
        _write_json(json_out, summary)
    if json_out != "-":
        click.echo(
            f"wrote {out}: {summary['requests']:,} requests, {summary['blocks']:,} blocks "
            f"({summary['unique_blocks']:,} distinct), shape {shape}, seed {seed}"
        )


_PASSTHROUGH = {"ignore_unknown_options": True, "help_option_names": []}


@cli.group()
def bench() -> None:
    """Benchmarks (as ``python -m kvoffload.bench``): pool, copy, scheduler, handle, tier."""


def _bench_command(name: str, summary: str) -> None:
    @bench.command(name, context_settings=_PASSTHROUGH, add_help_option=False, help=summary)
    @click.argument("args", nargs=-1, type=click.UNPROCESSED)
    def command(args: tuple[str, ...]) -> None:
        from kvoffload.bench.__main__ import main as bench_main  # noqa: PLC0415

        try:
            code = bench_main([name, *args])
        except SystemExit as exc:  # argparse's --help and usage errors
            code = exc.code if isinstance(exc.code, int) else 2
        if code:
            click.get_current_context().exit(code)


_bench_command("pool", "Replay a trace through CpuBlockPool against a textbook pool (--help).")
_bench_command("copy", "Store/load bandwidth against a contiguous copy (--help).")
_bench_command("scheduler", "Store planning against a plain per-block planner (--help).")
_bench_command("handle", "OffloadRequest per-step cost against hand-written update calls (--help).")
_bench_command("tier", "Disk or Redis tier bandwidth against raw I/O or a bare client (--help).")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit code (the ``kvoffload`` console script)."""
    try:
        # Without standalone mode, click returns an exit requested by ctx.exit() as an int.
        result = cli.main(args=list(argv) if argv is not None else None, standalone_mode=False)
    except click.exceptions.Exit as exc:
        return exc.exit_code
    except click.ClickException as exc:
        exc.show()
        return exc.exit_code
    except click.Abort:
        click.echo("Aborted!", err=True)
        return 1
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())
