"""Host bytes per cached token with KV cache groups, measured through `GroupedScheduler`.

Models shaped like gpt-oss, Gemma 3 and Gemma 2 (full-attention and sliding-window layers
in their proportions, 8 KV heads of 128, bf16, 16-token blocks) are each served one long
prompt; every store plan is completed, and the published CPU blocks of
each group, times their size, divided by the tokens a later lookup can hit, give the host
bytes per cached token. The same model treated as all-full-attention (one group of every
layer) is measured the same way. Usage::

    python -m scripts.groups_memory [--tokens 32768] [--checkpoints 1024 4096]
"""

from __future__ import annotations

import argparse

from kvoffload.groups import KVCacheGroup
from kvoffload.hashing import BlockHasher
from kvoffload.pool.block_pool import CpuBlockPool
from kvoffload.scheduler.groups import GroupedScheduler

PAGE = 16 * 2 * 8 * 128 * 2  # bs 16, K and V, 8 KV heads of 128, bf16


def measure(groups: tuple[KVCacheGroup, ...], tokens: int, checkpoint: int) -> tuple[float, int]:
    """(host bytes per cached token, the hit) after storing one prompt of ``tokens``."""
    pools = {g.name: CpuBlockPool(tokens // g.block_size + 1) for g in groups}
    sched = GroupedScheduler(groups, pools, checkpoint_tokens=checkpoint)
    toks = list(range(tokens + 1))
    hashes: dict[str, list[bytes]] = {}
    for g in groups:
        hasher = BlockHasher(g.namespace(model_id="m").root, g.block_size)
        hasher.extend(toks)
        hashes[g.name] = list(hasher.block_hashes)
    tables: dict[str, list[int | None]] = {
        g.name: list(range(tokens // g.block_size)) for g in groups
    }
    sched.update("a", tables, {n: h[: tokens // 16] for n, h in hashes.items()}, tokens)
    for plan in (sched.plan_stores(), sched.finish("a")):
        if plan is not None:
            sched.complete_all(plan, True)
    hit = sched.lookup("b", hashes, tokens + 1)
    used = sum(pools[g.name].num_cached * g.bytes_per_block for g in groups)
    return used / hit, hit


MODELS = (  # name, layers, full-attention layers, window
    ("gpt-oss-like", 24, 12, 128),
    ("Gemma-3-like", 30, 5, 1024),
    ("Gemma-2-like", 26, 13, 4096),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--checkpoints", type=int, nargs="+", default=[1024, 4096])
    args = parser.parse_args()
    print(
        "| model | layers (full) | window | checkpoint_tokens | all-full KiB/token "
        "| groups KiB/token | less |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, layers, full_layers, window in MODELS:
        all_full = (
            KVCacheGroup(
                name="all",
                kind="full",
                block_size=16,
                num_layers=layers,
                bytes_per_layer_block=PAGE,
            ),
        )
        for checkpoint in args.checkpoints:
            hybrid = (
                KVCacheGroup(
                    name="full",
                    kind="full",
                    block_size=16,
                    num_layers=full_layers,
                    bytes_per_layer_block=PAGE,
                ),
                KVCacheGroup(
                    name="swa",
                    kind="sliding_window",
                    window=window,
                    block_size=16,
                    num_layers=layers - full_layers,
                    bytes_per_layer_block=PAGE,
                ),
            )
            h_bytes, h_hit = measure(hybrid, args.tokens, checkpoint)
            f_bytes, f_hit = measure(all_full, args.tokens, checkpoint)
            if h_hit != f_hit:
                raise SystemExit(f"{name}: hits differ ({h_hit} vs {f_hit})")
            print(
                f"| {name} | {layers} ({full_layers}) | {window} | {checkpoint} "
                f"| {f_bytes / 1024:.1f} | {h_bytes / 1024:.1f} | {f_bytes / h_bytes:.2f}x |"
            )


if __name__ == "__main__":
    main()
