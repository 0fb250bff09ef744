"""Host bytes per cached token of a sliding-window model, offloaded end to end.

A random-weight Gemma 3 text model (5 sliding-window layers and 1 full-attention layer,
window 128, 16-token blocks) serves interleaved multi-turn conversations through
`PagedEngine` and a multi-group `KVOffloader` (`groups=engine.kv_groups`). After the last
turn, every conversation's whole history is looked up (a fresh handle, released at once):
the host bytes of the CPU blocks published in every group, divided by the tokens those
lookups hit, are the host bytes per cached token. The same model with every layer made a
full-attention layer (one group: the single-group offloader) is measured the same way.
Usage::

    python -m scripts.groups_offload_memory [--conversations 4] [--turns 4]
        [--questions 48 240] [--checkpoints 128 256 512]

Each turn adds a question of ``--questions`` tokens and a 16-token answer.
"""

from __future__ import annotations

import argparse
import random
from typing import Any

import anyio
import torch
import transformers

from kvoffload import KVOffloader, OffloadConfig
from kvoffload.integrations.transformers import PagedEngine

BS = 16
WINDOW = 128
LAYERS = ["sliding_attention"] * 5 + ["full_attention"]


def model(layer_types: list[str]) -> Any:
    cfg = transformers.Gemma3TextConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=len(layer_types),
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=WINDOW,
        layer_types=layer_types,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.Gemma3ForCausalLM(cfg).eval()


async def measure(
    layer_types: list[str], conversations: int, turns: int, question: int, checkpoint: int
) -> tuple[int, int]:
    """(host bytes of the published CPU blocks, tokens the histories' lookups hit)."""
    engine = PagedEngine(model(layer_types), num_gpu_blocks=160, block_size=BS)
    config = OffloadConfig(block_size=BS, num_cpu_blocks=4096, checkpoint_tokens=checkpoint)
    rng = random.Random(1)
    convs = [[rng.randrange(512) for _ in range(96)] for _ in range(conversations)]
    async with KVOffloader(
        config, engine.offload_kv, groups=engine.kv_groups, pinner=engine.pinners
    ) as off:
        engine.attach(off)
        for turn in range(turns):
            for c, conv in enumerate(convs):
                conv.extend(rng.randrange(512) for _ in range(question))
                engine.add_request(f"c{c}-t{turn}", conv, max_new_tokens=16)
                (res,) = await engine.run_until_done()
                conv.extend(res.output_token_ids)
        await off.drain()
        hit = 0
        for c, conv in enumerate(convs):
            with off.request(f"probe{c}", conv) as req:
                hit += req.lookup()
                req.release()
        stats = off.statistics()
        if stats.groups is None:  # one group: the single-group pool
            used = stats.pool.num_cached * off.layout.bytes_per_block
        else:
            sizes = {g.name: g.bytes_per_block for g in engine.kv_groups}
            used = sum(s.cached_cpu_blocks * sizes[n] for n, s in stats.groups.items())
    return used, hit


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--questions", type=int, nargs="+", default=[48, 240])
    parser.add_argument("--checkpoints", type=int, nargs="+", default=[128, 256, 512])
    args = parser.parse_args()
    print(
        "| question tokens | checkpoint_tokens | all-full bytes/token | groups bytes/token "
        "| less | tokens hit (all-full, groups) |"
    )
    print("|---|---|---|---|---|---|")
    n, turns = args.conversations, args.turns
    for question in args.questions:
        all_full = ["full_attention"] * len(LAYERS)
        full_used, full_hit = anyio.run(measure, all_full, n, turns, question, 256)
        full = full_used / full_hit
        for checkpoint in args.checkpoints:
            used, hit = anyio.run(measure, LAYERS, n, turns, question, checkpoint)
            per = used / hit
            print(
                f"| {question} | {checkpoint} | {full:.0f} | {per:.0f} | {full / per:.2f}x "
                f"| {full_hit}, {hit} |"
            )


if __name__ == "__main__":
    main()
