"""An engine's step loop calling kvoffload, complete and runnable on CPU.

A toy engine keeps its KV cache in per-layer CPU tensors (the shapes a real engine keeps
on the GPU) and "computes" KV with a deterministic formula. Two requests share a prefix:

1. request ``a`` misses, computes its prompt in chunks and decodes a few tokens; after
   every step the engine reports what it computed (``req.advance``) and starts the stores
   (``off.store``); leaving the ``with`` block finishes the request;
2. request ``b`` starts with the same 20 tokens: ``req.lookup`` finds them on the CPU,
   ``req.load`` copies them into ``b``'s GPU blocks, and the engine computes only the rest.

Each request goes through an ``OffloadRequest`` handle (``off.request(...)``): it hashes
the prompt and every generated token's block incrementally and makes the low-level calls
(``lookup``, ``load``, ``update``, ``finish``) with the right arguments.

The script checks that the loaded bytes equal the KV request ``a`` computed, that ``b``
computed only the tokens past the hit, and that every pin and reference was released.

    python examples/engine_step_loop.py

It takes well under a second, so ``KVOFFLOAD_EXAMPLE_QUICK=1`` (set by CI) changes nothing.
"""

from __future__ import annotations

import os
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
    RefCountPinner,
    TransferTask,
)

BLOCK_SIZE = 4  # tokens per KV block (real engines use 16 or more)
NUM_GPU_BLOCKS = 32  # the engine's whole KV cache
CHUNK_TOKENS = 8  # chunked prefill: at most this many prompt tokens per step
DECODE_STEPS = 3  # tokens request "a" generates after its prompt

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_size=8, dtype="float32", block_size=BLOCK_SIZE)


class ToyEngine:
    """Just enough of an inference engine: a KV cache, a block allocator, "compute"."""

    def __init__(self) -> None:
        # One tensor per layer, blocks_first: [num_blocks, 2 (K, V), block_size, heads, dim].
        self.kv = [torch.zeros(LAYOUT.tensor_shape(NUM_GPU_BLOCKS)) for _ in range(2)]
        self.free_blocks = list(range(NUM_GPU_BLOCKS))
        self.released: list[int] = []  # freed by requests, still pinned by a copy
        # The GpuBlockPinner: kvoffload pins a transfer's GPU blocks until the copy is done
        # (a count per block); when a block's last pin goes, reclaim() runs.
        self.pinner = RefCountPinner(on_release=self.reclaim)
        self.computed_tokens = 0  # tokens this engine ran through its "model"

    def allocate(self, table: list[int], num_blocks: int) -> None:
        """Grow a request's block table by ``num_blocks`` blocks."""
        table += [self.free_blocks.pop(0) for _ in range(num_blocks)]

    def free(self, table: Sequence[int]) -> None:
        """A request is done with its blocks. A block a copy still reads (a store of the
        request's last blocks, say) must not be reused before the copy is done."""
        for b in table:
            (self.released if self.pinner.is_pinned(b) else self.free_blocks).append(b)

    def reclaim(self, unpinned: Sequence[int]) -> None:
        """The pinner's release hook: released blocks whose last pin went are free."""
        for b in unpinned:
            if b in self.released:
                self.released.remove(b)
                self.free_blocks.append(b)

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
    # The handle hashes the prompt's full blocks now and each block that generated tokens
    # fill later. Leaving the "with" block finishes the request (also on an exception or a
    # cancellation): nothing more is stored for it and its lookup pin is released.
    with off.request(request_id, prompt, num_computed_tokens=0) as req:
        # -- admission: how much of the prompt can be loaded instead of computed? --------
        # num_computed_tokens above is what the engine's own (GPU) prefix cache holds for
        # this prompt: 0 here. The hit starts after it, is a multiple of the block size and
        # never covers the prompt's last token (that token's logits must be computed).
        hit = req.lookup()
        engine.allocate(table, req.blocks_for(len(prompt)))
        if hit:
            # The hit is pinned on the CPU. Give the load the whole block table: block i of
            # the request lands in table[i]. An engine that cannot take the hit after all
            # calls req.release() instead, or loads fewer tokens.
            task = req.load(table)
            assert task is not None
            # On CUDA: task.wait_on(compute_stream) orders the compute after the copy
            # without blocking the host. Here we simply await it; a failed load raises
            # TransferError and the engine would recompute those tokens instead.
            result = await task
            print(f"[{request_id}] loaded {result.num_blocks} blocks ({result.nbytes} bytes)")

        # -- the step loop: chunked prefill, then decode ----------------------------------
        num_computed = hit
        steps = 0
        while True:
            if num_computed < len(prompt):  # prefill, one chunk per step
                end = min(len(prompt), num_computed + CHUNK_TOKENS)
            elif steps < decode_steps:  # decode: the model "generates" one token per step
                req.extend([9000 + steps])  # hashes the block the token fills, if any
                steps += 1
                end = req.num_tokens
            else:
                break
            engine.allocate(table, req.blocks_needed(end, have=len(table)))
            engine.compute(req.token_ids, table, num_computed, end)
            num_computed = end
            # On CUDA: event = torch.cuda.Event(); event.record(compute_stream) here.

            # After the step: advance, then store. advance() reports the whole block table
            # and how many tokens have KV (it calls off.update with the hashes of exactly
            # the full, computed blocks); only those blocks are ever stored.
            req.advance(table, num_computed)
            # store: one batched transfer for every live request's new full blocks. On CUDA
            # pass after=event so the copy waits for the compute that wrote the blocks.
            # Awaiting the tasks is optional: the completion poller publishes the blocks.
            tasks: list[TransferTask] = off.store()
            for task in tasks:
                print(f"[{request_id}] step stores {task.plan.num_blocks} block(s)")

    # -- the request ended (the "with" block called req.finish()) -------------------------
    # The engine frees its GPU blocks; the pinner keeps those of running copies from reuse.
    # (A preempted request calls req.preempt() instead, and req.lookup() when resumed.)
    engine.free(table)
    return table, hit


async def main() -> None:
    quick = os.environ.get("KVOFFLOAD_EXAMPLE_QUICK") == "1"  # nothing to shorten here
    engine = ToyEngine()
    config = OffloadConfig(
        block_size=BLOCK_SIZE,
        num_cpu_blocks=64,
        model_id="toy-model@v1",  # mixed into every block hash
        enable_events=True,  # BlockStored / BlockRemoved events for take_events()
    )

    # Entering the offloader allocates the host buffer (in a worker thread), picks the copy
    # engine (worker threads for CPU tensors, CUDA streams for CUDA tensors) and starts the
    # completion poller in a task group it owns. Leaving it waits for every copy in flight.
    # One KVOffloader per engine process, opened once, for every request it serves.
    async with KVOffloader(config, gpu_kv=engine.kv, pinner=engine.pinner) as off:
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
        assert engine.pinner.num_pinned == 0  # every pin was released
        assert not engine.released  # and every block the pins held back is free again
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
