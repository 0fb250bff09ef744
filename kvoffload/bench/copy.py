"""``python -m kvoffload.bench copy``: store/load bandwidth against a contiguous copy.

For each batch size it stores ``n`` scattered GPU blocks to scattered CPU blocks and loads
them back through a copy engine and a `CompletionPoller`, and
measures, in the same run, one contiguous copy of the same number of bytes (device to
host for stores, host to device for loads; pinned host memory on CUDA). It prints the
median GB/s over ``--reps`` repetitions, the ratio to the contiguous copy, and the
poller's wake-up latency (copy finished → awaiting coroutine resumed). ``--loop-lag``
measures instead how late a 1 ms heartbeat on the event loop runs while the engine copies
(5,000 small submits, then one 8 MiB copy held 200 ms in its worker), and the cost of one
``submit()``: the timing side of what the tests prove by counting loop iterations.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import random
import statistics
import threading
import time
import typing
from collections.abc import Callable, Sequence
from typing import Any

import anyio
import anyio.lowlevel
import torch

from kvoffload.bench._args import int_list, output_path, positive_int, write_output
from kvoffload.config import DTypeName, KVLayout
from kvoffload.storage.host_buffer import HostKVBuffer
from kvoffload.transfer import (
    CompletionPoller,
    CudaCopyEngine,
    LoadPlan,
    StorePlan,
    ThreadCopyEngine,
    TransferPlan,
    TransferTask,
)
from kvoffload.transfer.gather import STREAMING, BlockMover, copy_segments

__all__ = ["add_parser", "run"]

_LAYOUTS: dict[str, dict[str, Any]] = {
    # Llama-3-8B: 64 KiB per layer and block, 2 MiB per block.
    "llama3-8b": {"num_layers": 32, "num_kv_heads": 8, "head_size": 128, "block_size": 16},
    # Same model with 8-token blocks: 32 KiB per-layer pieces, 1 MiB per block.
    "small-pieces": {"num_layers": 32, "num_kv_heads": 8, "head_size": 128, "block_size": 8},
}


def add_parser(subparsers: Any) -> None:
    """Register the ``copy`` subcommand."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "copy", help="store/load bandwidth vs a contiguous copy", description=__doc__
    )
    p.add_argument(
        "--blocks",
        type=int_list,
        default=[1, 16, 64, 128, 256],
        help="comma-separated batch sizes (all timed in every repetition)",
    )
    p.add_argument(
        "--reps", type=positive_int, default=5, help="repetitions per measurement (median)"
    )
    p.add_argument("--engine", choices=["auto", "thread", "cuda"], default="auto")
    p.add_argument("--layout", choices=sorted(_LAYOUTS), default="llama3-8b")
    p.add_argument("--kind", choices=["blocks_first", "kv_first"], default="blocks_first")
    p.add_argument("--dtype", choices=typing.get_args(DTypeName), default="bfloat16")
    p.add_argument(
        "--strategy",
        choices=["segments", "staged"],
        default="segments",
        help="thread engine data path",
    )
    p.add_argument(
        "--pieces",
        action="store_true",
        help="also time each plan as one memmove per piece on one thread (the copy without "
        "streaming stores), side by side (thread engine, segments)",
    )
    p.add_argument("--latency-samples", type=positive_int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=output_path, default=None, help="also write the figures here")
    p.add_argument(
        "--loop-lag",
        action="store_true",
        help="measure the event loop's lag and submit() latency while copies run, instead",
    )
    p.set_defaults(run=run)


_minor_faults: Callable[[], int] | None  # the process's minor page faults so far
try:
    import resource

    def _minor_faults() -> int:
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

except ImportError:  # not on Unix: the page-fault count is left out
    _minor_faults = None


class _Faults:
    """Adds the process's minor page faults during a ``with`` block to ``totals[side]``."""

    __slots__ = ("_side", "_start", "_totals")

    def __init__(self, totals: dict[str, int], side: str | None) -> None:
        self._totals = totals
        self._side = side
        self._start = 0

    def __enter__(self) -> None:
        if _minor_faults is not None:
            self._start = _minor_faults()

    def __exit__(self, *exc: object) -> None:
        if _minor_faults is not None and self._side is not None:
            self._totals[self._side] += _minor_faults() - self._start


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def run(args: argparse.Namespace) -> int:
    """Run the benchmark; return 0."""
    use_cuda = args.engine == "cuda" or (args.engine == "auto" and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        print("--engine cuda: CUDA is not available")
        return 2
    if args.loop_lag:
        return anyio.run(_loop_lag, args)
    sizes = sorted(set(args.blocks))
    layout = KVLayout(dtype=args.dtype, kind=args.kind, **_LAYOUTS[args.layout])
    return anyio.run(_main, args, layout, sizes, use_cuda)


async def _main(
    args: argparse.Namespace, layout: KVLayout, sizes: Sequence[int], use_cuda: bool
) -> int:
    device = torch.device("cuda" if use_cuda else "cpu")
    max_n = max(sizes)
    num_gpu = num_cpu = max(2 * max_n, 8)
    kv = [
        torch.empty(layout.tensor_shape(num_gpu), dtype=layout.torch_dtype, device=device)
        for _ in range(layout.num_layers)
    ]
    for t in kv:
        t.view(torch.uint8).random_(0, 255)
    host = HostKVBuffer(layout, num_cpu, pin_memory="always" if use_cuda else "never")
    engine: ThreadCopyEngine | CudaCopyEngine
    if use_cuda:
        engine = CudaCopyEngine(layout, kv, host)
    else:
        engine = ThreadCopyEngine(layout, kv, host, strategy=args.strategy)
    pieces = args.pieces and not use_cuda and args.strategy == "segments"
    mover = BlockMover(layout, kv, host)
    rng = random.Random(args.seed)
    poller = CompletionPoller(lambda task: None, poll_interval_s=0.0002)
    name = "cuda" if use_cuda else f"thread/{args.strategy}"
    print(
        f"engine={name} layout={args.layout} kind={layout.kind} dtype={layout.dtype} "
        f"block={layout.bytes_per_block / 2**20:.2f} MiB "
        f"per-layer piece={layout.bytes_per_layer_block // 1024} KiB reps={args.reps} "
        f"streaming={'n/a' if use_cuda else STREAMING}"
    )
    print(
        "ratio: against the faster contiguous copy; 1-thread: against one plain memmove "
        "(the same on CUDA); sizes interleaved in every repetition"
        + ("; pieces: one memmove per piece on one thread (no streaming)" if pieces else "")
    )
    print(
        f"{'blocks':>6} {'MiB':>7} {'store':>8} {'d2h':>8} {'ratio':>6} {'1-thread':>7} "
        f"{'load':>8} {'h2d':>8} {'ratio':>6} {'1-thread':>7}"
        + (f" {'pieces':>6} {'pieces':>6}" if pieces else "")
        + "   (GB/s)"
    )
    latencies: list[float] = []
    results: list[dict[str, float]] = []
    contiguous_d2h, contiguous_h2d = _contiguous(max_n * layout.bytes_per_block, device)
    plans: dict[int, tuple[StorePlan, LoadPlan]] = {}
    for i, n in enumerate(sizes):
        g = tuple(rng.sample(range(num_gpu), n))
        c = tuple(rng.sample(range(num_cpu), n))
        store = StorePlan(
            plan_id=2 * i,
            kind="store",
            gpu_block_ids=g,
            cpu_block_ids=c,
            request_ids=("bench",),
            block_hashes=(),
        )
        load = LoadPlan(
            plan_id=2 * i + 1,
            kind="load",
            gpu_block_ids=g,
            cpu_block_ids=c,
            request_ids=("bench",),
            request_id="bench",
            num_tokens=0,
        )
        plans[n] = (store, load)

    faults = {"engine": 0, "contiguous": 0}  # minor page faults in the timed repetitions

    def counted(side: str, timed_rep: bool) -> _Faults:
        return _Faults(faults, side if timed_rep else None)

    def pieces_s(plan: TransferPlan) -> float:
        segments = mover.segments(plan)
        t0 = time.perf_counter()
        copy_segments(segments)
        return time.perf_counter() - t0

    async with anyio.create_task_group() as tg:
        await tg.start(poller.run)

        async def timed(plan: TransferPlan) -> float:
            t0 = time.perf_counter()
            task = engine.submit(plan)
            poller.track(task)
            await task
            return time.perf_counter() - t0

        # Side by side: every repetition times every size, and for each the contiguous
        # copy and the engine's copy back to back; a ratio is taken per repetition (then
        # the median), so a burst of load elsewhere on the machine hits all alike.
        rows: dict[int, list[tuple[float, ...]]] = {n: [] for n in sizes}
        for rep in range(args.reps + 1):
            for n in sizes:
                store, load = plans[n]
                nbytes = n * layout.bytes_per_block
                with counted("contiguous", rep > 0):
                    d2h_s = contiguous_d2h(nbytes)
                with counted("engine", rep > 0):
                    store_s = await timed(store)
                with counted("contiguous", rep > 0):
                    h2d_s = contiguous_h2d(nbytes)
                with counted("engine", rep > 0):
                    load_s = await timed(load)
                extra = (pieces_s(store), pieces_s(load)) if pieces else ()
                if rep:  # the first repetition warms caches and pages up
                    rows[n].append((store_s, *d2h_s, load_s, *h2d_s, *extra))
        for n in sizes:
            nbytes = n * layout.bytes_per_block
            med = [statistics.median(col) for col in zip(*rows[n], strict=True)]

            def ratio(ours: int, limit: int, rows: list[tuple[float, ...]] = rows[n]) -> float:
                return statistics.median(row[limit] / row[ours] for row in rows)

            result = {
                "blocks": n,
                "bytes": nbytes,
                "store_gbps": _gbps(nbytes, med[0]),
                "d2h_gbps": _gbps(nbytes, med[1]),
                "store_ratio": ratio(0, 1),
                "store_ratio_one_thread": ratio(0, 2),
                "load_gbps": _gbps(nbytes, med[3]),
                "h2d_gbps": _gbps(nbytes, med[4]),
                "load_ratio": ratio(3, 4),
                "load_ratio_one_thread": ratio(3, 5),
            }
            line = (
                f"{n:>6} {nbytes / 2**20:>7.0f} {_gbps(nbytes, med[0]):>8.2f} "
                f"{_gbps(nbytes, med[1]):>8.2f} {ratio(0, 1):>6.2f} {ratio(0, 2):>7.2f} "
                f"{_gbps(nbytes, med[3]):>8.2f} {_gbps(nbytes, med[4]):>8.2f} "
                f"{ratio(3, 4):>6.2f} {ratio(3, 5):>7.2f}"
            )
            if pieces:
                result["store_ratio_pieces"] = ratio(6, 1)
                result["load_ratio_pieces"] = ratio(7, 4)
                line += f" {ratio(6, 1):>6.2f} {ratio(7, 4):>6.2f}"
            results.append(result)
            print(line)
        print(
            "side by side, ratio to the contiguous copy: "
            + "; ".join(
                f"{r['blocks']} blocks store {r['store_ratio']:.2f} load {r['load_ratio']:.2f}"
                for r in results
                if r["blocks"] >= 64
            )
        )
        if _minor_faults is not None:
            print(
                "minor page faults in the timed repetitions (the first one warms pages up): "
                f"engine {faults['engine']}, contiguous {faults['contiguous']}"
            )
        plan_id = 2 * len(sizes)
        for i in range(args.latency_samples):
            plan_id += 1
            j = i % num_gpu
            plan = LoadPlan(
                plan_id=plan_id,
                kind="load",
                gpu_block_ids=(j,),
                cpu_block_ids=(j,),
                request_ids=("bench",),
                request_id="bench",
                num_tokens=0,
            )
            latencies.append(await _wakeup(engine, poller, plan, use_cuda))
        tg.cancel_scope.cancel()
    await engine.aclose()
    host.close()
    latencies.sort()
    if latencies:
        p99 = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]
        print(
            f"wake-up latency (copy finished -> awaiter resumed) over {len(latencies)} copies: "
            f"median {statistics.median(latencies) * 1e6:.0f} us, p99 {p99 * 1e6:.0f} us"
        )
    if args.json is not None:
        payload = {
            "engine": name,
            "layout": args.layout,
            "kind": layout.kind,
            "dtype": layout.dtype,
            "bytes_per_block": layout.bytes_per_block,
            "reps": args.reps,
            "streaming": None if use_cuda else STREAMING,
            "results": results,
            "page_faults": faults if _minor_faults is not None else None,
            "wakeup_latency_s": {
                "samples": len(latencies),
                "median": statistics.median(latencies) if latencies else None,
            },
        }
        write_output(args.json, json.dumps(payload, indent=2) + "\n")
    return 0


async def _wakeup(
    engine: ThreadCopyEngine | CudaCopyEngine,
    poller: CompletionPoller,
    plan: TransferPlan,
    use_cuda: bool,
) -> float:
    task: TransferTask = engine.submit(plan)
    fired: list[float] = []
    watcher: threading.Thread | None = None
    if isinstance(engine, CudaCopyEngine) and use_cuda:
        cuda: Any = torch.cuda
        marker = cuda.Event()
        marker.record(engine.stream(plan.kind))

        def watch() -> None:  # off the loop: blocking here is fine
            marker.synchronize()
            fired.append(time.perf_counter())

        watcher = threading.Thread(target=watch)
        watcher.start()
    poller.track(task)
    await task
    resumed = time.perf_counter()
    if watcher is not None:
        await anyio.to_thread.run_sync(watcher.join)
        return max(0.0, resumed - fired[0])
    at = task._fired_at()
    return max(0.0, resumed - at) if at is not None else 0.0


async def _heartbeat(lags: list[float], stop: anyio.Event, period: float = 0.001) -> None:
    while not stop.is_set():
        t0 = time.perf_counter()
        await anyio.sleep(period)
        lags.append(time.perf_counter() - t0 - period)


def _lag_line(what: str, lags: list[float]) -> str:
    lags = sorted(lags)
    if not lags:
        return f"{what}: no heartbeat ran"
    p99 = lags[min(len(lags) - 1, int(0.99 * len(lags)))]
    return (
        f"{what}: heartbeat lag over {len(lags)} ticks: median {statistics.median(lags) * 1e3:.2f}"
        f" ms, p99 {p99 * 1e3:.2f} ms, max {lags[-1] * 1e3:.2f} ms"
    )


async def _loop_lag(args: argparse.Namespace) -> int:
    """Loop lag of a 1 ms heartbeat while ``ThreadCopyEngine`` copies (FM-09, FM-10)."""
    from kvoffload.testing import CopyFaults  # noqa: PLC0415

    small = KVLayout(num_layers=1, num_kv_heads=1, head_size=4, block_size=1, dtype="float32")
    big = KVLayout(num_layers=4, num_kv_heads=4, head_size=64, block_size=16, dtype="float32")
    results: dict[str, Any] = {}
    for name, layout, count, faults in (
        ("5000 small submits", small, 5000, None),
        ("one 8 MiB copy held 200 ms", big, 1, CopyFaults(delay_s=0.2)),
    ):
        kv = [
            torch.zeros(layout.tensor_shape(128), dtype=torch.float32)
            for _ in range(layout.num_layers)
        ]
        host = HostKVBuffer(layout, 128, pin_memory="never")
        engine = ThreadCopyEngine(layout, kv, host, copy_hook=faults)
        poller = CompletionPoller(lambda task: None, poll_interval_s=0.0005)
        lags: list[float] = []
        submits: list[float] = []
        stop = anyio.Event()
        async with anyio.create_task_group() as tg:
            await tg.start(poller.run)
            tg.start_soon(_heartbeat, lags, stop)
            await anyio.sleep(0.01)
            for i in range(count):
                ids = tuple(range(128)) if count == 1 else (i % 128,)
                plan = StorePlan(
                    plan_id=i,
                    kind="store",
                    gpu_block_ids=ids,
                    cpu_block_ids=ids[::-1],
                    request_ids=("bench",),
                    block_hashes=(),
                )
                t0 = time.perf_counter()
                task = engine.submit(plan)
                submits.append(time.perf_counter() - t0)
                poller.track(task)
                if i % 100 == 99:
                    await anyio.lowlevel.checkpoint()
            await poller.drain()
            stop.set()
            tg.cancel_scope.cancel()
        await engine.aclose()
        host.close()
        submits.sort()
        print(_lag_line(name, lags))
        print(
            f"{name}: submit() median {statistics.median(submits) * 1e6:.0f} us, "
            f"max {submits[-1] * 1e6:.0f} us"
        )
        results[name] = {
            "max_lag_s": max(lags, default=None),
            "median_lag_s": statistics.median(lags) if lags else None,
            "median_submit_s": statistics.median(submits),
        }
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    return 0


def _contiguous(
    max_bytes: int, device: torch.device
) -> tuple[Callable[[int], tuple[float, float]], Callable[[int], tuple[float, float]]]:
    """Timers of one contiguous device→host and host→device copy of ``nbytes``.

    Each takes ``nbytes`` (at most ``max_bytes``; the first bytes of one pair of buffers)
    and returns ``(best, single)`` seconds for one copy. On CPU ``single`` is one plain
    ``memmove`` on one thread and ``best`` the faster of that and torch's ``copy_`` (which
    may use several threads); on CUDA both are the pinned ``copy_``.
    """
    if device.type == "cuda":
        dev = torch.empty(max_bytes, dtype=torch.uint8, device=device)
        pinned = torch.empty(max_bytes, dtype=torch.uint8, pin_memory=True)

        def timed_cuda(
            dst: torch.Tensor, src: torch.Tensor
        ) -> Callable[[int], tuple[float, float]]:
            def once(nbytes: int) -> tuple[float, float]:
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                dst[:nbytes].copy_(src[:nbytes], non_blocking=True)
                torch.cuda.synchronize()
                seconds = time.perf_counter() - t0
                return seconds, seconds

            return once

        return timed_cuda(pinned, dev), timed_cuda(dev, pinned)
    src = torch.empty(max_bytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty(max_bytes, dtype=torch.uint8).fill_(0)

    def timed_cpu(a: torch.Tensor, b: torch.Tensor) -> Callable[[int], tuple[float, float]]:
        def once(nbytes: int) -> tuple[float, float]:
            t0 = time.perf_counter()
            a[:nbytes].copy_(b[:nbytes])
            t1 = time.perf_counter()
            ctypes.memmove(a.data_ptr(), b.data_ptr(), nbytes)
            t2 = time.perf_counter()
            return min(t1 - t0, t2 - t1), t2 - t1

        return once

    return timed_cpu(dst, src), timed_cpu(src, dst)
