"""A small serving loop on CPU that offloads its KV cache with `KVOffloader`.

The toy engine below has what a real one has, in miniature: a paged KV cache (one tensor
per layer, 16-token blocks), a block allocator that keeps blocks a copy reads from reuse
(through kvoffload's ``RefCountPinner``), and a forward
pass that computes each block's K and V with real matrix products: its cost grows with the
tokens, and recomputing a block gives bit-identical KV. Each request goes through the step
loop kvoffload documents, through an ``OffloadRequest`` handle: ``req.lookup`` (how much of
the prompt the CPU pool holds; pins it), allocate a block table, ``req.load`` into it and
await the load, prefill the rest in chunks with ``req.advance`` and ``off.store`` after
each, decode (``req.extend`` hashes the answer's blocks as they fill), and leave the
``with`` block, which finishes the request.

For a sample of requests that loaded from CPU, the demo recomputes the prompt from scratch,
compares the KV in the cache bit for bit (a mismatch exits with status 1) and times that
full prefill: the time to first token without offload, measured in the same run.

    python examples/serve_multiturn.py
    python examples/serve_multiturn.py --plot ttft.png
    python examples/serve_multiturn.py --conversations 4 --turns 3 --cpu-blocks 64 --verbose
    python examples/serve_multiturn.py --trace ../shared/traces/synthetic_trace.jsonl
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import random
import statistics
import sys
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import anyio.to_thread
import torch
from tqdm import tqdm

from kvoffload import KVOffloader, OffloadConfig, OffloadRequest, RefCountPinner, TransferError
from kvoffload.bench.trace import read_trace
from kvoffload.bench.workload import WorkloadSpec, generate_workload

BLOCK = 16  # tokens per KV block
LAYERS, HEADS, HEAD_SIZE = 4, 4, 64
HIDDEN = HEADS * HEAD_SIZE
VOCAB = 32000
CHUNK = 256  # prefill chunk (tokens, a multiple of BLOCK): one engine step
QUICK = os.environ.get("KVOFFLOAD_EXAMPLE_QUICK") == "1"  # CI: shrink everything


# -- the toy engine ----------------------------------------------------------------------------


class BlockAllocator:
    """GPU block allocator. A block that a copy in flight names is pinned (its
    ``RefCountPinner``, the offloader's ``GpuBlockPinner``); freeing such a block only
    marks it released: it rejoins the free list when its last pin goes."""

    def __init__(self, num_blocks: int) -> None:
        self._free: deque[int] = deque(range(num_blocks))
        self._released: set[int] = set()
        self.pinner = RefCountPinner(on_release=self._unpinned)

    def allocate(self, n: int) -> list[int] | None:
        if n > len(self._free):
            return None
        return [self._free.popleft() for _ in range(n)]

    def free(self, block_ids: Sequence[int]) -> None:
        for b in block_ids:
            if self.pinner.is_pinned(b):
                self._released.add(b)  # a store still reads it: hand it out later
            else:
                self._free.append(b)

    def _unpinned(self, block_ids: Sequence[int]) -> None:
        for b in block_ids:
            if b in self._released:
                self._released.remove(b)
                self._free.append(b)


class ToyModel:
    """Deterministic per-block KV: a block's K/V depend on its tokens, its positions and
    the previous block's V (as attention would), through a few matmuls per layer."""

    def __init__(self, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        scale = HIDDEN**-0.5
        self.embed = torch.randn(VOCAB, HIDDEN, generator=g)
        self.freqs = torch.exp(torch.linspace(0.0, -9.0, HIDDEN))
        self.w_kv = [torch.randn(HIDDEN, 2 * HIDDEN, generator=g) * scale for _ in range(LAYERS)]
        self.w_up = [torch.randn(HIDDEN, 2 * HIDDEN, generator=g) * scale for _ in range(LAYERS)]
        self.w_down = [
            torch.randn(2 * HIDDEN, HIDDEN, generator=g) * scale / 2 for _ in range(LAYERS)
        ]

    def block_kv(
        self, tokens: Sequence[int], pos0: int, prev_v: Sequence[torch.Tensor] | None
    ) -> list[torch.Tensor]:
        """Per layer, a ``(2, BLOCK, HEADS, HEAD_SIZE)`` float32 tensor for one block.

        A partial last block is padded to ``BLOCK`` tokens, so every matmul has the same
        shape (and the same rounding) wherever and whenever the block is computed.
        """
        ids = torch.zeros(BLOCK, dtype=torch.long)
        ids[: len(tokens)] = torch.tensor(tokens, dtype=torch.long) % VOCAB
        pos = torch.arange(pos0, pos0 + BLOCK, dtype=torch.float32)[:, None]
        h = self.embed[ids] + torch.sin(pos * self.freqs)
        out = []
        for layer in range(LAYERS):
            x = h if prev_v is None else h + prev_v[layer].float().mean(0).reshape(HIDDEN)
            k, v = (x @ self.w_kv[layer]).split(HIDDEN, dim=1)
            out.append(torch.stack([k, v]).reshape(2, BLOCK, HEADS, HEAD_SIZE))
            h = h + torch.tanh(x @ self.w_up[layer]) @ self.w_down[layer]
        return out


class ToyEngine:
    """A paged KV cache (CPU tensors standing in for GPU memory) and its compute."""

    def __init__(self, num_gpu_blocks: int, dtype: torch.dtype = torch.bfloat16) -> None:
        shape = (num_gpu_blocks, 2, BLOCK, HEADS, HEAD_SIZE)  # the "blocks_first" layout
        self.kv = [torch.zeros(shape, dtype=dtype) for _ in range(LAYERS)]
        self.allocator = BlockAllocator(num_gpu_blocks)
        self.model = ToyModel()

    def compute(
        self,
        table: Sequence[int],
        tokens: Sequence[int],
        start: int,
        end: int,
        *,
        kv: Sequence[torch.Tensor] | None = None,
    ) -> None:
        """Compute the KV of ``tokens[start:end]`` (``start`` block-aligned) into the
        blocks ``table`` names, in the cache or in ``kv``. Block ``i`` reads block
        ``i - 1``'s V from there, whether it was loaded or computed."""
        kv = self.kv if kv is None else kv
        for i in range(start // BLOCK, -(-end // BLOCK)):
            prev = None if i == 0 else [t[table[i - 1], 1] for t in kv]
            out = self.model.block_kv(tokens[i * BLOCK : (i + 1) * BLOCK], i * BLOCK, prev)
            for layer, layer_kv in zip(kv, out, strict=True):
                layer[table[i]] = layer_kv  # rounds to the cache dtype

    def recompute(self, tokens: Sequence[int]) -> list[torch.Tensor]:
        """The prompt's KV computed from scratch into fresh tensors (block i at index i)."""
        n = -(-len(tokens) // BLOCK)
        fresh = [torch.empty((n, *t.shape[1:]), dtype=t.dtype) for t in self.kv]
        self.compute(range(n), tokens, 0, len(tokens), kv=fresh)
        return fresh


def find_mismatches(
    kv: Sequence[torch.Tensor], table: Sequence[int], expected: Sequence[torch.Tensor]
) -> list[int]:
    """The request blocks whose KV in ``kv`` differs in any bit from ``expected``
    (per layer, block ``i`` of the request at index ``i``)."""
    return [
        i
        for i in range(expected[0].shape[0])
        if not all(torch.equal(c[table[i]], e[i]) for c, e in zip(kv, expected, strict=True))
    ]


class KVMismatchError(RuntimeError):
    """The KV in the cache differs from freshly recomputed KV."""


# -- workloads ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Request:
    """One request: its prompt, and the answer the engine will decode after it."""

    group: int  # for the plot: the turn (generated) or the tenth of the trace
    prompt: list[int]
    answer: list[int]  # tokens to decode (the answer the next turn's prompt contains)


def generated_requests(conversations: int, turns: int, seed: int) -> list[Request]:
    """Conversations that grow turn by turn on top of four shared system prompts."""
    spec = WorkloadSpec(
        num_sessions=conversations,
        turns=(turns, turns),
        system_prompt_tokens=256 if QUICK else 512,
        answer_tokens=(64, 384),
        vocab_size=VOCAB,
        seed=seed,
    )
    turns_list = list(generate_workload(spec))
    # The workload draws an answer after yielding its turn: read it off the next turn.
    following: dict[int, tuple[int, ...]] = {}
    answers: list[list[int]] = []
    for r in reversed(turns_list):
        nxt = following.get(r.session_id, ())
        answers.append(list(nxt[len(r.token_ids) : len(r.token_ids) + r.output_length]))
        following[r.session_id] = r.token_ids
    return [
        Request(r.turn, list(r.token_ids), a)
        for r, a in zip(turns_list, reversed(answers), strict=True)
    ]


def trace_requests(path: Path, limit: int, block_tokens: int, seed: int) -> list[Request]:
    """Mooncake trace requests; each ``hash_id`` becomes ``block_tokens`` synthetic tokens,
    so equal hash-id prefixes give equal token prefixes (512-token trace blocks, scaled)."""
    requests = []
    for i, r in enumerate(read_trace(path, limit=limit)):
        tokens = [
            t
            for h in r.hash_ids
            for t in random.Random(seed * 1_000_003 + h).choices(range(VOCAB), k=block_tokens)
        ]
        length = max(1, min(len(tokens), round(r.input_length * block_tokens / 512)))
        requests.append(Request(i * 10 // limit, tokens[:length], []))
    return requests


# -- serving -----------------------------------------------------------------------------------


@dataclass(slots=True)
class Served:
    """What one request cost."""

    group: int
    prompt_tokens: int
    loaded_tokens: int
    ttft_s: float  # from the lookup until the prompt's last token is computed
    load_s: float  # from submitting the load until it was awaited
    prefill_s: float  # compute of the prompt tokens that were not loaded
    decoded_tokens: int
    full_prefill_s: float | None = None  # measured when verified: the TTFT without offload


class Server:
    """Serves requests one after another on ``engine``, offloading through ``off``."""

    def __init__(self, off: KVOffloader, engine: ToyEngine, verify_every: int) -> None:
        self.off, self.engine, self.verify_every = off, engine, verify_every
        self.hits = self.verified_blocks = 0

    async def allocate(self, n: int) -> list[int]:
        """``n`` free GPU blocks, waiting once for copies in flight to release their pins."""
        blocks = self.engine.allocator.allocate(n)
        if blocks is None:
            await self.off.drain()
            blocks = self.engine.allocator.allocate(n)
        if blocks is None:
            raise RuntimeError(f"{n} more blocks do not fit the GPU KV cache")
        return blocks

    async def run_steps(self, req: OffloadRequest, table: list[int], start: int, step: int) -> None:
        """Compute ``req``'s tokens from ``start`` on, ``step`` tokens per engine step; after
        each step tell the offloader what is computed and let it store the new full blocks."""
        done = start
        while done < req.num_tokens:
            end = min(done + step, req.num_tokens)
            # The forward pass runs off the event loop, as a GPU kernel would.
            await anyio.to_thread.run_sync(self.engine.compute, table, req.token_ids, done, end)
            done = end
            req.advance(table, done)  # update() with the hashes of the computed full blocks
            self.off.store()  # copies the newly computed full blocks in the background

    async def serve(self, rid: str, request: Request) -> Served:
        """Serve one request through the step loop kvoffload documents."""
        off, prompt = self.off, request.prompt
        t0 = time.perf_counter()
        # The handle hashes the prompt's blocks now; leaving the "with" block finishes the
        # request (blocks that a store still reads stay pinned until it completes).
        with off.request(rid, prompt) as req:
            # 1. Lookup. With allow_defer, None means "the next block is being stored right
            #    now": waiting for the copies in flight and asking again gives a longer hit.
            hit = req.lookup(allow_defer=True)
            if hit is None:
                await off.drain()
                hit = req.lookup()
            # 2. The block table: one GPU block per 16 tokens, the partial last one included.
            table = await self.allocate(req.blocks_for(len(prompt)))
            # 3. Load the hit into the first blocks of the table; compute must wait for it.
            t1 = time.perf_counter()
            if hit and (task := req.load(table)) is not None:
                try:
                    await task
                except TransferError:
                    hit = 0  # a failed load is recomputed, never used
            t2 = time.perf_counter()
            # 4. Prefill the rest of the prompt in chunks; then the first token is ready.
            await self.run_steps(req, table, hit, CHUNK)
            t3 = time.perf_counter()
            served = Served(
                request.group, len(prompt), hit, t3 - t0, t2 - t1, t3 - t2, len(request.answer)
            )
            if hit:
                await self.verify(rid, table, prompt, served)
            # 5. Decode the answer, a block per step here (a token per step in a real
            #    engine); extend() hashes each block the answer fills, so the next turn
            #    loads it too. The last turn's answer is never reused.
            if request.answer:
                req.extend(request.answer)
                table += await self.allocate(req.blocks_needed(have=len(table)))
                await self.run_steps(req, table, len(prompt) // BLOCK * BLOCK, BLOCK)
        # 6. The request is finished; free its GPU blocks (pinned ones wait for their copy).
        self.engine.allocator.free(table)
        return served

    async def verify(self, rid: str, table: list[int], prompt: list[int], served: Served) -> None:
        """Every ``verify_every``-th hit: recompute the prompt from scratch (timed: the
        TTFT without offload) and compare the cache with it bit for bit."""
        self.hits += 1
        if (self.hits - 1) % self.verify_every:
            return
        t0 = time.perf_counter()
        expected = await anyio.to_thread.run_sync(self.engine.recompute, prompt)
        served.full_prefill_s = time.perf_counter() - t0
        if bad := find_mismatches(self.engine.kv, table, expected):
            raise KVMismatchError(f"{rid}: blocks {bad} differ from freshly recomputed KV")
        self.verified_blocks += served.loaded_tokens // BLOCK


async def serve(args: argparse.Namespace, requests: list[Request]) -> tuple[list[Served], str]:
    """Serve ``requests``; return the records and the offloader's statistics, as text."""
    longest = max(-(-(len(r.prompt) + len(r.answer)) // BLOCK) for r in requests)
    engine = ToyEngine(max(args.gpu_blocks, longest))
    config = OffloadConfig(block_size=BLOCK, num_cpu_blocks=args.cpu_blocks, model_id="toy@v1")
    async with KVOffloader(config, engine.kv, pinner=engine.allocator.pinner) as off:
        server = Server(off, engine, args.verify_every)
        served = [
            await server.serve(f"req-{i}", req)
            for i, req in enumerate(
                tqdm(requests, unit="req", file=sys.stderr, disable=not args.progress)
            )
        ]
        await off.drain()
        stats = off.statistics()
    s, checked = stats.scheduler, sum(r.full_prefill_s is not None for r in served)
    return served, (
        f"KV verified: {server.verified_blocks} blocks bit-exact (loaded blocks of {checked} "
        f"requests vs a full recompute)\n"
        f"offloader: stored {s.stored_blocks} blocks, loaded {s.loaded_blocks}, deferred "
        f"stores {s.deferred_blocks} blocks in {s.deferred_steps} steps, evictions "
        f"{stats.pool.evictions}, deferred lookups {s.deferred_lookups}, "
        f"failed transfers {s.failed_stores + s.failed_loads}"
    )


def report(served: list[Served], stats_lines: str) -> None:
    """Print what the run computed, loaded and saved."""
    prompt = sum(r.prompt_tokens for r in served)
    loaded = sum(r.loaded_tokens for r in served)
    computed = prompt - loaded
    print(f"requests served: {len(served)}")
    print(f"prefix hit rate: {loaded / prompt:.3f} (tokens loaded from CPU / prompt tokens)")
    print(
        f"prompt tokens: {prompt:,} = {computed:,} computed + {loaded:,} loaded "
        f"({sum(r.decoded_tokens for r in served):,} answer tokens decoded)"
    )
    prefill_us = sum(r.prefill_s for r in served) / max(computed, 1) * 1e6
    load_us = sum(r.load_s for r in served if r.loaded_tokens) / max(loaded, 1) * 1e6
    print(f"per token: prefill compute {prefill_us:.1f} us, load from CPU {load_us:.2f} us")
    if ratios := [r.full_prefill_s / r.ttft_s for r in served if r.full_prefill_s]:
        print(
            f"TTFT speed-up on hit requests: {statistics.median(ratios):.1f}x median over "
            f"{len(ratios)} (full prefill vs load + prefill of the rest)"
        )
    print(stats_lines)


def plot(served: list[Served], path: Path, xlabel: str) -> None:
    """Median TTFT per turn, with offload (every request) and with a full prefill."""
    try:
        import matplotlib  # noqa: PLC0415 - optional dependency, imported on demand

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        raise SystemExit(
            "--plot needs matplotlib: from a kvoffload clone, pip install '.[plot]'"
        ) from None
    series = {
        "with offload": [(r.group, r.ttft_s) for r in served],
        "full prefill (verified requests)": [
            (r.group, r.full_prefill_s) for r in served if r.full_prefill_s is not None
        ],
    }
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, points in series.items():
        xs = sorted({g for g, _ in points})
        ys = [statistics.median(v * 1e3 for g, v in points if g == x) for x in xs]
        ax.plot(xs, ys, marker="o", label=label)
    ax.set(xlabel=xlabel, ylabel="median time to first token (ms)", yscale="log")
    ax.legend()
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    print(f"plot: {path}")


def positive(text: str) -> int:
    """An argparse type: an integer >= 1."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return int(text)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the arguments, serve, print the report; return the exit code."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--conversations", type=positive, default=6 if QUICK else 20)
    p.add_argument(
        "--turns", type=positive, default=3 if QUICK else 6, help="turns per conversation"
    )
    p.add_argument("--cpu-blocks", type=positive, default=2048, help="CPU pool size, in blocks")
    p.add_argument("--gpu-blocks", type=positive, default=384, help="GPU KV cache size, in blocks")
    p.add_argument("--seed", type=positive, default=0, help="workload seed")
    p.add_argument("--verify-every", type=positive, default=6, help="check every Nth hit request")
    p.add_argument("--trace", type=Path, help="replay a Mooncake-format trace instead")
    p.add_argument("--trace-block-tokens", type=positive, default=16, help="tokens per trace block")
    p.add_argument("--limit", type=positive, default=20 if QUICK else 100, help="trace requests")
    p.add_argument("--plot", type=Path, help="draw the median TTFT per turn into this PNG")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    p.add_argument("--verbose", action="store_true", help="show kvoffload's INFO logs")
    args = p.parse_args(argv)
    # kvoffload logs nothing until the application configures logging; its events are
    # key=value facts such as "event=store_deferred request_id=req-7 needed=12 free=0".
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING)

    if args.trace is not None:
        if not args.trace.is_file():
            p.error(f"trace file not found: {args.trace}")
        requests = trace_requests(args.trace, args.limit, args.trace_block_tokens, args.seed)
    else:
        requests = generated_requests(args.conversations, args.turns, args.seed)
    start = time.perf_counter()
    try:
        served, stats_lines = asyncio.run(serve(args, requests))
    except KVMismatchError as exc:
        print(f"KV MISMATCH: {exc}", file=sys.stderr)
        return 1
    report(served, stats_lines)
    print(f"wall time: {time.perf_counter() - start:.1f} s")
    if args.plot is not None:
        plot(served, args.plot, "turn" if args.trace is None else "tenth of the trace")
    return 0


if __name__ == "__main__":
    sys.exit(main())
