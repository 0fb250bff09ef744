"""An engine's step loop calling kvoffload, complete and runnable on CPU.

A toy engine keeps its KV cache in per-layer CPU tensors (the shapes a real engine keeps
on the GPU) and "computes" KV with a deterministic formula. Two requests share a prefix:

1. request ``a`` misses, computes its prompt in chunks and decodes a few tokens; after
   every step the engine reports what it computed (``update``) and starts the stores
   (``store``); at the end it calls ``finish``;
2. request ``b`` starts with the same 20 tokens: ``lookup`` finds them on the CPU, ``load``
   copies them into ``b``'s GPU blocks, and the engine computes only the rest.

The script checks that the loaded bytes equal the KV request ``a`` computed, that ``b``
computed only the tokens past the hit, and that every pin and reference was released.

    python examples/engine_step_loop.py

It takes well under a second, so ``KVOFFLOAD_EXAMPLE_QUICK=1`` (set by CI) changes nothing.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Sequence

import anyio
import torch

from kvoffload import (
    BlockHash,
    BlockRemoved,
    BlockStored,
    KVLayout,
    KVOffloader,
    OffloadConfig,
    TransferTask,
)

BLOCK_SIZE = 4  # tokens per KV block (real engines use 16 or more)
NUM_GPU_BLOCKS = 32  # the engine's whole KV cache
CHUNK_TOKENS = 8  # chunked prefill: at most this many prompt tokens per step
DECODE_STEPS = 3  # tokens request "a" generates after its prompt

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_size=8, dtype="float32", block_size=BLOCK_SIZE)


class PinCounter:
    """The engine's ``GpuBlockPinner``: a pin count per GPU block.

    kvoffload pins a transfer's GPU blocks right before submitting it and unpins them once
    its completion was observed. The engine must not hand a pinned block to another
    request; the same block may be pinned by two transfers at once, hence a count.
    """

    def __init__(self) -> None:
        self.counts: Counter[int] = Counter()

    def pin(self, gpu_block_ids: Sequence[int]) -> None:
        self.counts.update(gpu_block_ids)

    def unpin(self, gpu_block_ids: Sequence[int]) -> None:
        self.counts.subtract(gpu_block_ids)

    def is_pinned(self, gpu_block_id: int) -> bool:
        return self.counts[gpu_block_id] > 0


class ToyEngine:
    """Just enough of an inference engine: a KV cache, a block allocator, "compute"."""

    def __init__(self, pinner: PinCounter) -> None:
        # One tensor per layer, blocks_first: [num_blocks, 2 (K, V), block_size, heads, dim].
        self.kv = [torch.zeros(LAYOUT.tensor_shape(NUM_GPU_BLOCKS)) for _ in range(2)]
        self.free_blocks = list(range(NUM_GPU_BLOCKS))
        self.released: list[int] = []  # freed by requests, maybe still pinned by a copy
        self.pinner = pinner
        self.computed_tokens = 0  # tokens this engine ran through its "model"

    def allocate(self, table: list[int], num_tokens: int) -> None:
        """Grow a request's block table to hold ``num_tokens`` tokens."""
        self.reclaim()
        while len(table) * BLOCK_SIZE < num_tokens:
            table.append(self.free_blocks.pop(0))

    def free(self, table: Sequence[int]) -> None:
        """A request is done with its blocks; they are reused once no copy pins them."""
        self.released.extend(table)
        self.reclaim()

    def reclaim(self) -> None:
        """Return released blocks that no transfer pins any more to the free list."""
        still_pinned = [b for b in self.released if self.pinner.is_pinned(b)]
        self.free_blocks.extend(b for b in self.released if not self.pinner.is_pinned(b))
        self.released = still_pinned

    def compute(self, tokens: Sequence[int], table: Sequence[int], start: int, end: int) -> None:
        """Write the KV of tokens ``start..end-1``: a fixed function of token and position."""
        for pos in range(start, end):
            block, slot = table[pos // BLOCK_SIZE], pos % BLOCK_SIZE
            for layer, tensor in enumerate(self.kv):
                tensor[block, 0, slot] = expected_kv(tokens[pos], pos, layer, 0)
                tensor[block, 1, slot] = expected_kv(tokens[pos], pos, layer, 1)
        self.computed_tokens += end - start

    def block_kv(self, gpu_block_id: int) -> torch.Tensor:
        """Every layer's K and V of one GPU block (a copy)."""
        return torch.stack([t[gpu_block_id] for t in self.kv]).clone()


def expected_kv(token: int, pos: int, layer: int, k_or_v: int) -> torch.Tensor:
    """The "model": what the KV of one token is, as a [heads, dim] tile."""
    base = float(token * 1000 + pos * 10 + layer * 2 + k_or_v)
    return torch.full((LAYOUT.num_kv_heads, LAYOUT.head_size), base)


async def run_request(
    off: KVOffloader,
    engine: ToyEngine,
    request_id: str,
    prompt: list[int],
    decode_steps: int,
) -> tuple[list[int], int]:
    """Serve one request with the offloader; return its block table and the hit (tokens)."""
    table: list[int] = []

    # -- admission: how much of the prompt can be loaded instead of computed? ------------
    # num_computed_tokens is what the engine's own (GPU) prefix cache already holds for
    # this prompt: 0 here. The hit starts after it, is a multiple of the block size and
    # never covers the prompt's last token (that token's logits must be computed).
    hit = off.lookup(request_id, off.hash_prompt(prompt), len(prompt), num_computed_tokens=0)
    num_computed = 0
    if hit:
        # The hit is pinned on the CPU. Give the load the whole block table: block i of
        # the request lands in table[i]. An engine that cannot take the hit after all
        # calls off.release(request_id) instead, or loads fewer tokens.
        engine.allocate(table, len(prompt))
        task = off.load(request_id, table, hit)
        assert task is not None
        # On CUDA: task.wait_on(compute_stream) orders the compute after the copy without
        # blocking the host. Here we simply await it; a failed load raises TransferError
        # and the engine would recompute those tokens instead.
        result = await task
        print(f"[{request_id}] loaded {result.num_blocks} blocks ({result.nbytes} bytes)")
        num_computed = hit

    # -- the step loop: chunked prefill, then decode --------------------------------------
    tokens = list(prompt)
    steps = 0
    while True:
        if num_computed < len(prompt):  # prefill, one chunk per step
            end = min(len(prompt), num_computed + CHUNK_TOKENS)
        elif steps < decode_steps:  # decode: the model "generates" one token per step
            tokens.append(9000 + steps)
            steps += 1
            end = len(tokens)
        else:
            break
        engine.allocate(table, end)
        engine.compute(tokens, table, num_computed, end)
        num_computed = end
        # On CUDA: event = torch.cuda.Event(); event.record(compute_stream) here.

        # After the step, in this order: update -> store -> (finish, when the request ends).
        # update: the whole block table, the hashes of every full block so far, and how many
        # tokens have KV. Only full blocks entirely below num_computed are ever stored.
        # (A real engine hashes incrementally with kvoffload.hash_block_tokens.)
        off.update(request_id, table, off.hash_prompt(tokens), num_computed)
        # store: one batched transfer for every live request's new full blocks. On CUDA pass
        # after=event so the copy waits for the compute that wrote the blocks. Awaiting the
        # tasks is optional: the completion poller publishes the blocks either way.
        tasks: list[TransferTask] = off.store()
        for task in tasks:
            print(f"[{request_id}] step stores {task.plan.num_blocks} block(s)")

    # -- the request ends -------------------------------------------------------------------
    # finish: nothing more is stored for it; its state goes once its last copy completed.
    # The engine frees its GPU blocks; the pinner keeps those of running copies from reuse.
    # (A preempted request calls off.preempt(request_id) instead and starts over later.)
    off.finish(request_id)
    engine.free(table)
    return table, hit


async def main() -> None:
    quick = os.environ.get("KVOFFLOAD_EXAMPLE_QUICK") == "1"  # nothing to shorten here
    pinner = PinCounter()
    engine = ToyEngine(pinner)
    config = OffloadConfig(
        block_size=BLOCK_SIZE,
        num_cpu_blocks=64,
        model_id="toy-model@v1",  # mixed into every block hash
        enable_events=True,  # BlockStored / BlockRemoved events for take_events()
    )

    # Entering the offloader allocates the host buffer (in a worker thread), picks the copy
    # engine (worker threads for CPU tensors, CUDA streams for CUDA tensors) and starts the
    # completion poller in a task group it owns. Leaving it waits for every copy in flight.
    async with KVOffloader(config, gpu_kv=engine.kv, pinner=pinner) as off:
        shared = [100 + i for i in range(5 * BLOCK_SIZE)]  # 5 blocks both prompts share
        prompt_a = [*shared, 1, 2, 3, 4, 5, 6, 7]  # 27 tokens: 6 full blocks + 3
        prompt_b = [*shared, 50, 51, 52, 53, 54, 55]  # 26 tokens: diverges in block 5

        table_a, hit_a = await run_request(off, engine, "a", prompt_a, DECODE_STEPS)
        assert hit_a == 0  # nothing was cached yet
        kv_a = [engine.block_kv(g) for g in table_a[:5]]  # "a"'s KV of the shared blocks

        # Stores complete on their own; drain() only waits until they have, so that "b"
        # is sure to see them (a server would just carry on).
        await off.drain()
        for g in table_a:  # let the engine overwrite "a"'s blocks: "b" must not need them
            for tensor in engine.kv:
                tensor[g].fill_(-1.0)

        computed_before = engine.computed_tokens
        table_b, hit_b = await run_request(off, engine, "b", prompt_b, decode_steps=0)
        assert hit_b == 5 * BLOCK_SIZE, hit_b
        assert engine.computed_tokens - computed_before == len(prompt_b) - hit_b
        for i, want in enumerate(kv_a):
            assert torch.equal(engine.block_kv(table_b[i]), want), f"block {i} differs"
        print(f"[b] hit {hit_b} of {len(prompt_b)} prompt tokens; loaded KV is bit-exact")

        await off.drain()
        stats = off.statistics()
        print(
            f"stored {stats.scheduler.stored_blocks} blocks, loaded "
            f"{stats.scheduler.loaded_blocks}, hit tokens {stats.scheduler.hit_tokens}, "
            f"free CPU blocks {stats.pool.num_free}/{stats.pool.num_blocks}"
        )
        events = off.take_events()
        stored = sum(isinstance(e, BlockStored) for e in events)
        print(f"events: {stored} BlockStored, {len(events) - stored} other")
        assert stored == stats.scheduler.stored_blocks
        assert stats.pool.num_free == stats.pool.num_blocks  # no reference left behind
        assert stats.scheduler.live_requests == 0
        assert not +pinner.counts  # every pin was released
        off.scheduler.check_invariants()

        # reset: drop the whole CPU prefix cache (e.g. after a weight update).
        assert await off.reset()
        hashes: list[BlockHash] = off.hash_prompt(prompt_b)
        assert off.lookup("c", hashes, len(prompt_b)) == 0
        off.finish("c")
        removed = sum(isinstance(e, BlockRemoved) for e in off.take_events())
        print(f"reset: {removed} blocks unpublished; a new lookup hits nothing")
    if quick:
        print("(KVOFFLOAD_EXAMPLE_QUICK=1: the example is quick anyway)")


if __name__ == "__main__":
    anyio.run(main)
