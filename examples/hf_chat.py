"""A multi-turn chat served by a Hugging Face ``transformers`` model through kvoffload.

The model is a Llama built from a ``LlamaConfig`` with random weights and a fixed seed (no
download); ``--model PATH`` loads a local checkpoint instead. It runs on
`kvoffload.integrations.transformers.PagedEngine`: a paged KV cache whose block budget is
too small to keep the earlier turns of every conversation, with a `KVOffloader` behind it.

Conversations interleave: turn 1 of every conversation, then turn 2 of every
conversation, and so on. Each turn's prompt is the conversation so far (a long system
prompt, the earlier questions and the model's own answers) plus a new question, so
prompts grow to thousands of tokens. Each request runs twice, side by side:

- with offload: the engine's GPU prefix cache, then kvoffload's CPU pool, then compute;
- with the GPU prefix cache only: a second engine of the same size without offload;
- with a full recompute: a third engine without prefix cache or offload.

The generated tokens must be identical (greedy, float32; a difference exits with status
1). A table per turn shows the prompt tokens, how many were computed, taken from the GPU
prefix cache or loaded from CPU, and the time to first token (TTFT) both ways.

    python examples/hf_chat.py
    python examples/hf_chat.py --conversations 6 --turns 8 --plot ttft.png
    python examples/hf_chat.py --profile
    python examples/hf_chat.py --model gemma3      # sliding-window + full attention
    python examples/hf_chat.py --model qwen3_next  # linear attention + full attention
    python examples/hf_chat.py --model /path/to/llama-checkpoint

Gemma 3 and Qwen3-Next are offloaded with their KV cache groups (full attention plus
sliding-window blocks, or plus recurrent state snapshots): a hit loads every group.

Needs the ``transformers`` extra (from a kvoffload clone, ``pip install '.[transformers]'``;
and ``.[plot]`` for ``--plot``).
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import torch
from tqdm import tqdm

from kvoffload import KVOffloader, OffloadConfig
from kvoffload.integrations.transformers import GenerationResult, PagedEngine

QUICK = os.environ.get("KVOFFLOAD_EXAMPLE_QUICK") == "1"  # CI: shrink everything
BLOCK = 16  # tokens per KV block

# The random model and the workload, full size and quick (CI) size.
SIZES: dict[str, dict[str, int]] = {
    "full": {
        "hidden": 256,
        "layers": 4,
        "heads": 8,
        "kv_heads": 2,
        "intermediate": 704,
        "vocab": 4096,
        "system": 1536,
        "question": 160,
        "answer": 32,
    },
    "quick": {
        "hidden": 64,
        "layers": 2,
        "heads": 4,
        "kv_heads": 2,
        "intermediate": 128,
        "vocab": 512,
        "system": 192,
        "question": 40,
        "answer": 8,
    },
}


def random_llama(size: dict[str, int], seed: int) -> Any:
    """A Llama with random weights (rotary embeddings, grouped-query attention), float32."""
    from transformers import LlamaConfig, LlamaForCausalLM  # noqa: PLC0415 - optional extra

    config = LlamaConfig(
        vocab_size=size["vocab"],
        hidden_size=size["hidden"],
        intermediate_size=size["intermediate"],
        num_hidden_layers=size["layers"],
        num_attention_heads=size["heads"],
        num_key_value_heads=size["kv_heads"],
        max_position_embeddings=16384,
    )
    torch.manual_seed(seed)
    model: Any = LlamaForCausalLM(config)
    return model.float().eval()


def random_family(family: str, size: dict[str, int], seed: int) -> Any:
    """A random-weight model of ``family``: ``llama``; ``gemma3`` (Gemma 3 text: sliding-window
    layers around a full-attention one); ``qwen3_next`` (gated delta net linear attention
    around a full-attention layer)."""
    import transformers  # noqa: PLC0415 - optional extra

    if family == "llama":
        return random_llama(size, seed)
    common: dict[str, Any] = {
        "vocab_size": size["vocab"],
        "hidden_size": size["hidden"],
        "intermediate_size": size["intermediate"],
        "num_hidden_layers": 3,
        "num_attention_heads": size["heads"],
        "num_key_value_heads": size["kv_heads"],
        "head_dim": size["hidden"] // size["heads"],
        "max_position_embeddings": 16384,
    }
    torch.manual_seed(seed)
    model: Any
    if family == "gemma3":
        config: Any = transformers.Gemma3TextConfig(
            **common,
            sliding_window=4 * BLOCK,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        )
        model = transformers.Gemma3ForCausalLM(config)
    else:
        head = size["hidden"] // size["heads"]
        config = transformers.Qwen3NextConfig(
            **common,
            linear_num_value_heads=size["heads"],
            linear_num_key_heads=size["kv_heads"],
            linear_key_head_dim=head,
            linear_value_head_dim=head,
            linear_conv_kernel_dim=4,
            mlp_only_layers=[0, 1, 2],
            layer_types=["linear_attention", "full_attention", "linear_attention"],
        )
        model = transformers.Qwen3NextForCausalLM(config)
    return model.float().eval()


FAMILIES = ("gemma3", "llama", "qwen3_next")
"""``--model`` names of the random-weight models (anything else is a checkpoint path)."""


def load_model(path: Path) -> Any:
    """A local checkpoint (never downloaded), in float32."""
    from transformers import AutoModelForCausalLM  # noqa: PLC0415 - optional extra

    auto: Any = AutoModelForCausalLM
    return auto.from_pretrained(path, dtype=torch.float32, local_files_only=True).eval()


@dataclass(slots=True)
class Turn:
    """One request, measured both ways."""

    turn: int
    prompt_tokens: int
    offload: GenerationResult
    gpu_only: GenerationResult
    recompute: GenerationResult
    attention_s: tuple[float, float] | None = None  # --profile: offload, full recompute

    @property
    def ratio(self) -> float:
        """TTFT with a full recompute over TTFT with offload."""
        return (self.recompute.ttft_s or 0.0) / (self.offload.ttft_s or float("inf"))


class AttentionTimer:
    """With ``--profile``: the seconds spent in paged attention, per request up to its first
    token (the engine's forward passes run in a worker thread, one at a time)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.until_first_token: dict[tuple[int, str], float] = {}

    def install(self) -> None:
        """Wrap the registered attention function (after the engines registered it)."""
        from transformers import AttentionInterface  # noqa: PLC0415 - optional extra

        from kvoffload.integrations.transformers import (  # noqa: PLC0415
            ATTENTION_NAME,
            paged_attention,
        )

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return paged_attention(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0

        AttentionInterface.register(ATTENTION_NAME, timed)


async def run_once(
    engine: PagedEngine,
    rid: str,
    prompt: Sequence[int],
    n: int,
    timer: AttentionTimer | None = None,
) -> GenerationResult:
    """Serve one request alone on ``engine``; its result."""
    engine.add_request(rid, prompt, max_new_tokens=n)
    start = timer.seconds if timer is not None else 0.0
    first: float | None = None
    result: GenerationResult | None = None
    while engine.has_work:
        for out in await engine.step():
            if first is None and out.token_id is not None and timer is not None:
                first = timer.seconds - start
                timer.until_first_token[id(engine), rid] = first
            result = out.result or result
    if result is None or result.finish_reason not in {"length", "stop"}:
        raise RuntimeError(f"{rid} ended with {result and result.finish_reason}")
    return result


async def chat(args: argparse.Namespace, size: dict[str, int]) -> tuple[list[Turn], str]:
    """Run the interleaved conversations; return every turn and the offloader's counters."""
    if args.model is None or str(args.model) in FAMILIES:
        model = random_family(str(args.model or "llama"), size, args.seed)
    else:
        model = load_model(args.model)
    vocab = int(model.config.vocab_size)
    rng = random.Random(args.seed)
    system = [rng.randrange(vocab) for _ in range(size["system"])]
    # Each conversation starts from the same system prompt with its own first line.
    history = [
        system + [rng.randrange(vocab) for _ in range(BLOCK)] for _ in range(args.conversations)
    ]
    max_tokens = size["system"] + BLOCK + args.turns * (size["question"] + size["answer"])
    # By default the GPU cache holds the longest request and little more: earlier turns
    # of the other conversations do not stay on the GPU.
    gpu_blocks = max(args.gpu_blocks or 0, -(-max_tokens // BLOCK) + 4)
    engine = PagedEngine(model, num_gpu_blocks=gpu_blocks, block_size=BLOCK)
    gpu_only = PagedEngine(model, num_gpu_blocks=gpu_blocks, block_size=BLOCK)
    full = PagedEngine(
        model,
        num_gpu_blocks=-(-max_tokens // BLOCK) + 2,
        block_size=BLOCK,
        enable_prefix_caching=False,
    )
    config = OffloadConfig(
        block_size=BLOCK,
        num_cpu_blocks=args.cpu_blocks,
        model_id=f"hf-chat@{args.seed}",
        # hybrids: store points every 4 blocks, and at the end (one full-attention group
        # stores every block, and refuses the setting)
        checkpoint_tokens=None if [g.kind for g in engine.kv_groups] == ["full"] else 4 * BLOCK,
    )
    timer = None
    if args.profile:
        timer = AttentionTimer()
        timer.install()
    turns: list[Turn] = []
    total = args.conversations * args.turns
    bar = tqdm(total=total, unit="req", file=sys.stderr, disable=not args.progress)
    # One spelling for every family: a Llama has one group, Gemma 3 and Qwen3-Next several.
    args.offloaded = True
    async with KVOffloader(
        config, engine.offload_kv, groups=engine.kv_groups, pinner=engine.pinners
    ) as off:
        engine.attach(off)
        for t in range(1, args.turns + 1):
            for c in range(args.conversations):
                conv = history[c]
                conv += [rng.randrange(vocab) for _ in range(size["question"])]
                rid = f"c{c}-t{t}"
                offload = await run_once(engine, rid, conv, size["answer"], timer)
                gpu = await run_once(gpu_only, rid, conv, size["answer"], timer)
                recompute = await run_once(full, rid, conv, size["answer"], timer)
                for other, name in ((gpu, "the GPU cache only"), (recompute, "a full recompute")):
                    if offload.output_token_ids != other.output_token_ids:
                        raise TokenMismatchError(
                            f"{rid}: offload generated {offload.output_token_ids}, "
                            f"{name} {other.output_token_ids}"
                        )
                attention = None
                if timer is not None:
                    attention = (
                        timer.until_first_token[id(engine), rid],
                        timer.until_first_token[id(full), rid],
                    )
                turns.append(Turn(t, len(conv), offload, gpu, recompute, attention))
                conv += offload.output_token_ids
                bar.update()
        bar.close()
        await off.drain()
        stats = off.statistics()
        off.check_invariants()
    engine.allocator.check_invariants()
    s = stats.scheduler
    return turns, (
        f"offloader: stored {s.stored_blocks} blocks, loaded {s.loaded_blocks}, "
        f"CPU pool evictions {stats.pool.evictions}, failed transfers "
        f"{s.failed_stores + s.failed_loads}; GPU blocks {gpu_blocks}, "
        f"GPU prefix-cache evictions {engine.allocator.statistics().evicted_blocks}"
    )


class TokenMismatchError(RuntimeError):
    """Offload and full recompute generated different tokens."""


def report(turns: list[Turn], stats_line: str, *, offloaded: bool = True) -> float | None:
    """Print the per-turn table; return the median TTFT ratio of turns >= 3."""
    print(
        f"{'turn':>4} {'prompt':>7} {'computed':>8} {'gpu hit':>8} {'loaded':>7} "
        f"{'TTFT offload':>13} {'GPU cache only':>14} {'TTFT full':>10} {'ratio':>6}"
    )
    for t in sorted({x.turn for x in turns}):
        rows = [x for x in turns if x.turn == t]

        def med(values: list[float]) -> float:
            return statistics.median(values)

        print(
            f"{t:>4} {med([x.prompt_tokens for x in rows]):>7.0f} "
            f"{med([x.offload.computed_tokens for x in rows]):>8.0f} "
            f"{med([x.offload.gpu_cached_tokens for x in rows]):>8.0f} "
            f"{med([x.offload.loaded_tokens for x in rows]):>7.0f} "
            f"{med([(x.offload.ttft_s or 0) * 1e3 for x in rows]):>10.1f} ms "
            f"{med([(x.gpu_only.ttft_s or 0) * 1e3 for x in rows]):>11.1f} ms "
            f"{med([(x.recompute.ttft_s or 0) * 1e3 for x in rows]):>7.1f} ms "
            f"{med([x.ratio for x in rows]):>5.1f}x"
        )
    print("(medians over the conversations; computed + gpu hit + loaded = prompt;")
    print(" ratio = TTFT full recompute / TTFT with offload)")
    print(
        f"tokens identical with {'offload, ' if offloaded else 'the '}GPU cache only and full "
        f"recompute: {len(turns)} requests"
    )
    print(stats_line)
    later = [x.ratio for x in turns if x.turn >= 3]
    if later:
        print(f"median TTFT ratio, turns >= 3: {statistics.median(later):.1f}x")
        return statistics.median(later)
    return None


def profile(turns: list[Turn]) -> None:
    """Where the time to first token goes, turns >= 3 (medians)."""
    later = [x for x in turns if x.turn >= 3 and x.attention_s is not None]
    if not later:
        return
    print("where the time to first token goes, turns >= 3 (medians, ms):")
    for label, way, which in (("with offload", "offload", 0), ("full recompute", "recompute", 1)):
        res: list[GenerationResult] = [getattr(x, way) for x in later]
        ttft = statistics.median((r.ttft_s or 0) * 1e3 for r in res)
        fwd = statistics.median(r.forward_s * 1e3 for r in res)
        attn = statistics.median((x.attention_s or (0.0, 0.0))[which] * 1e3 for x in later)
        load = statistics.median(r.load_wait_s * 1e3 for r in res)
        other = statistics.median(
            ((r.ttft_s or 0) - r.forward_s - r.load_wait_s) * 1e3 for r in res
        )
        computed = statistics.median(r.computed_tokens for r in res)
        print(
            f"  {label:<15} TTFT {ttft:7.1f} = forward {fwd:7.1f} (attention {attn:6.1f}, "
            f"{computed:.0f} tokens computed) + load wait {load:5.1f} + other {other:5.1f}"
        )


def plot(turns: list[Turn], path: Path) -> None:
    """Median TTFT per turn, with offload and with a full recompute."""
    try:
        import matplotlib  # noqa: PLC0415 - optional dependency, imported on demand

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        raise SystemExit(
            "--plot needs matplotlib: from a kvoffload clone, pip install '.[plot]'"
        ) from None
    xs = sorted({x.turn for x in turns})
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, way in (
        ("with offload", "offload"),
        ("GPU prefix cache only", "gpu_only"),
        ("full recompute", "recompute"),
    ):
        ys = [
            statistics.median((getattr(x, way).ttft_s or 0) * 1e3 for x in turns if x.turn == t)
            for t in xs
        ]
        ax.plot(xs, ys, marker="o", label=label)
    ax.set(xlabel="turn", ylabel="median time to first token (ms)", yscale="log")
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
    """Parse the arguments, run the chat, print the report; return the exit code."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--conversations", type=positive, default=3 if QUICK else 4)
    p.add_argument("--turns", type=positive, default=3 if QUICK else 6)
    p.add_argument(
        "--gpu-blocks",
        type=positive,
        help="GPU KV cache size, in blocks (default: the longest request + 4)",
    )
    p.add_argument("--cpu-blocks", type=positive, default=4096, help="CPU pool size, in blocks")
    p.add_argument("--seed", type=int, default=0, help="model and workload seed")
    p.add_argument(
        "--model",
        type=Path,
        help=f"a random-weight family ({', '.join(FAMILIES)}; default llama) or a local "
        "transformers checkpoint to load",
    )
    p.add_argument("--plot", type=Path, help="draw the median TTFT per turn into this PNG")
    p.add_argument(
        "--profile", action="store_true", help="break the TTFT down: forward, attention, load"
    )
    p.add_argument("--no-progress", dest="progress", action="store_false")
    p.add_argument("--verbose", action="store_true", help="show kvoffload's INFO logs")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING)
    if args.model is not None and str(args.model) not in FAMILIES and not args.model.is_dir():
        p.error(f"model directory not found: {args.model}")
    size = SIZES["quick" if QUICK else "full"]
    start = time.perf_counter()
    try:
        turns, stats_line = anyio.run(chat, args, size)
    except TokenMismatchError as exc:
        print(f"TOKEN MISMATCH: {exc}", file=sys.stderr)
        return 1
    report(turns, stats_line, offloaded=getattr(args, "offloaded", True))
    profile(turns)
    print(f"wall time: {time.perf_counter() - start:.1f} s")
    if args.plot is not None:
        plot(turns, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
