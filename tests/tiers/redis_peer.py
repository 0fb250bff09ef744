"""A second process sharing a Redis tier: looks a prompt up, promotes and loads it.

Usage: python redis_peer.py URL KEY_PREFIX MODEL_ID PROMPT_ID NUM_BLOCKS
Prints the tokens it loaded (after checking them bit-exact) and exits 0.
"""

from __future__ import annotations

import sys

import anyio
from tier_helpers import config, lookup_load, make_kv, tier_stats, tokens

from kvoffload.offloader import KVOffloader


async def main(url: str, prefix: str, model_id: str, prompt_id: int, num_blocks: int) -> None:
    kv = make_kv()
    tiers = [{"kind": "redis", "url": url, "key_prefix": prefix}]
    async with KVOffloader(config(tiers, model_id=model_id), kv) as off:
        prompt = tokens(prompt_id, num_blocks)
        hit = await lookup_load(off, kv, "peer", prompt, range(num_blocks))
        stats = tier_stats(off)
        print(hit, stats.blocks_promoted, stats.failed_checks)


if __name__ == "__main__":
    url, prefix, model_id, prompt_id, num_blocks = sys.argv[1:]
    anyio.run(main, url, prefix, model_id, int(prompt_id), int(num_blocks))
