"""Replay concurrent multi-turn conversations against the example server.

Each conversation sends its turns one after the other; conversations run at the same time.
A turn's prompt is the previous turn's prompt, the answer to it, and a new user message,
so every turn after the first shares a growing prefix with the one before: the server can
take it from its GPU prefix cache or load it from the CPU pool instead of computing it.
Prompts are token ids, so the shared prefix is exact.

At the end it prints the prefix hit rate (prompt tokens the server did not compute) and
time-to-first-token percentiles, measured here from sending the request to receiving the
first token of the stream.

    python examples/server/client.py --url http://127.0.0.1:8000
    python examples/server/client.py --conversations 8 --turns 4 --user-tokens 300
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx


@dataclass(frozen=True, slots=True)
class TurnResult:
    """One request as the client saw it."""

    conversation: int
    turn: int
    prompt_ids: list[int]
    prompt_tokens: int
    output_ids: list[int]
    ttft_s: float
    server_ttft_s: float
    server_load_wait_s: float
    server_forward_s: float
    gpu_cached_tokens: int
    loaded_tokens: int
    computed_tokens: int
    tier_tokens: int = 0
    """Of ``loaded_tokens``, those a secondary tier promoted for this request."""
    miss_reason: str | None = None
    """Why the cached prefix stopped where it did (a `MissReason` value)."""


@dataclass(frozen=True, slots=True)
class Summary:
    """What a replay measured."""

    requests: int
    prompt_tokens: int
    gpu_cached_tokens: int
    loaded_tokens: int
    computed_tokens: int
    hit_rate: float
    cpu_hit_rate: float
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    later_turns_ttft_p50_s: float | None
    tier_tokens: int = 0
    miss_reasons: dict[str, int] = field(default_factory=dict)


async def complete(
    client: httpx.AsyncClient, prompt: Sequence[int], max_tokens: int
) -> tuple[list[int], float, dict[str, Any]]:
    """Stream one completion; return its tokens, the time to its first token, and the
    server's ``kvoffload`` timings.

    Raises:
        RuntimeError: the server answered with an error (its message is included).
    """
    body = {"prompt": list(prompt), "max_tokens": max_tokens, "stream": True}
    tokens: list[int] = []
    ttft = 0.0
    info: dict[str, Any] = {}
    start = time.perf_counter()
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            raise RuntimeError(f"server answered {response.status_code}: {response.text}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"server error: {event['error']['message']}")
            ids = event["choices"][0]["token_ids"]
            if ids and not tokens:
                ttft = time.perf_counter() - start
            tokens.extend(ids)
            if "kvoffload" in event:
                info = event["kvoffload"]
    return tokens, ttft, info


async def conversation(
    client: httpx.AsyncClient,
    index: int,
    turns: int,
    user_tokens: int,
    max_tokens: int,
    vocab: int,
    rng: random.Random,
) -> list[TurnResult]:
    """One conversation's turns, in order."""
    prompt: list[int] = []
    results = []
    for turn in range(turns):
        prompt += [rng.randrange(vocab) for _ in range(user_tokens)]
        output, ttft, info = await complete(client, prompt, max_tokens)
        results.append(
            TurnResult(
                conversation=index,
                turn=turn,
                prompt_ids=list(prompt),
                prompt_tokens=len(prompt),
                output_ids=output,
                ttft_s=ttft,
                server_ttft_s=float(info.get("ttft_s", 0.0)),
                server_load_wait_s=float(info.get("load_wait_s", 0.0)),
                server_forward_s=float(info.get("forward_s", 0.0)),
                gpu_cached_tokens=int(info.get("gpu_cached_tokens", 0)),
                loaded_tokens=int(info.get("loaded_tokens", 0)),
                computed_tokens=int(info.get("computed_tokens", 0)),
                tier_tokens=sum(
                    int(t["tokens"])
                    for t in info.get("cached_tokens_by_source", {}).get("tiers", {}).values()
                ),
                miss_reason=info.get("miss_reason"),
            )
        )
        prompt += output
    return results


def _percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarize(results: Sequence[TurnResult]) -> Summary:
    """Hit rates and TTFT percentiles over every turn.

    Raises:
        ValueError: no results.
    """
    if not results:
        raise ValueError("no results to summarize")
    prompt = sum(r.prompt_tokens for r in results)
    gpu = sum(r.gpu_cached_tokens for r in results)
    loaded = sum(r.loaded_tokens for r in results)
    ttfts = [r.ttft_s for r in results]
    later = [r.ttft_s for r in results if r.turn > 0]
    reasons: dict[str, int] = {}
    for r in results:
        if r.miss_reason is not None:
            reasons[r.miss_reason] = reasons.get(r.miss_reason, 0) + 1
    return Summary(
        requests=len(results),
        prompt_tokens=prompt,
        gpu_cached_tokens=gpu,
        loaded_tokens=loaded,
        computed_tokens=sum(r.computed_tokens for r in results),
        hit_rate=(gpu + loaded) / prompt,
        cpu_hit_rate=loaded / prompt,
        ttft_p50_s=statistics.median(ttfts),
        ttft_p90_s=_percentile(ttfts, 0.9),
        ttft_p99_s=_percentile(ttfts, 0.99),
        later_turns_ttft_p50_s=statistics.median(later) if later else None,
        tier_tokens=sum(r.tier_tokens for r in results),
        miss_reasons=reasons,
    )


async def replay(
    url: str,
    *,
    conversations: int = 4,
    turns: int = 3,
    user_tokens: int = 64,
    max_tokens: int = 8,
    vocab: int = 256,
    seed: int = 0,
) -> list[TurnResult]:
    """Run the conversations concurrently against the server at ``url``."""
    rng = random.Random(seed)
    seeds = [rng.randrange(2**32) for _ in range(conversations)]
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(300.0)) as client:
        per_conversation = await asyncio.gather(
            *(
                conversation(
                    client, i, turns, user_tokens, max_tokens, vocab, random.Random(seeds[i])
                )
                for i in range(conversations)
            )
        )
    return [r for results in per_conversation for r in results]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--user-tokens", type=int, default=64, help="new tokens per turn")
    parser.add_argument("--max-tokens", type=int, default=8, help="tokens generated per turn")
    parser.add_argument("--vocab", type=int, default=256, help="prompt token ids are below it")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = parser.parse_args(argv)
    try:
        results = asyncio.run(
            replay(
                args.url,
                conversations=args.conversations,
                turns=args.turns,
                user_tokens=args.user_tokens,
                max_tokens=args.max_tokens,
                vocab=args.vocab,
                seed=args.seed,
            )
        )
    except (httpx.HTTPError, RuntimeError) as exc:
        print(f"replay failed: {exc}", file=sys.stderr)
        return 1
    summary = summarize(results)
    if args.json:
        print(json.dumps(asdict(summary)))
        return 0
    print(f"requests: {summary.requests}")
    print(
        f"prompt tokens: {summary.prompt_tokens:,} = {summary.gpu_cached_tokens:,} GPU cache "
        f"+ {summary.loaded_tokens:,} loaded from CPU + {summary.computed_tokens:,} computed"
    )
    if summary.tier_tokens:
        print(f"  of those loaded, promoted from a tier first: {summary.tier_tokens:,}")
    print(f"hit rate: {summary.hit_rate:.3f} (from CPU: {summary.cpu_hit_rate:.3f})")
    if summary.miss_reasons:
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(summary.miss_reasons.items()))
        print(f"requests by miss reason: {reasons}")
    print(
        f"TTFT p50 {summary.ttft_p50_s * 1e3:.1f} ms, p90 {summary.ttft_p90_s * 1e3:.1f} ms, "
        f"p99 {summary.ttft_p99_s * 1e3:.1f} ms"
    )
    if summary.later_turns_ttft_p50_s is not None:
        print(f"TTFT p50 of turns after the first: {summary.later_turns_ttft_p50_s * 1e3:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
