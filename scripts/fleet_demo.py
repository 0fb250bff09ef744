"""Two example servers sharing one Redis Cluster: a conversation moves from A to B.

Starts examples/server/app.py three times on free loopback ports: A and B with the same
``redis-cluster`` tier (through ``KVOFFLOAD_TIERS``), and B0 without a tier. Each
conversation's first turns go to A; its last turn goes to B and to B0. B finds the earlier
turns' blocks in the cluster (A wrote them down) and loads them; B0 computes them. Prints,
per server, the prompt tokens loaded and computed, the hit rate (prompt tokens not
computed) and the server-side time to first token, as a table and as JSON.

    bash scripts/with_redis_cluster.sh .venv/bin/python scripts/fleet_demo.py
    .venv/bin/python scripts/fleet_demo.py --startup-nodes redis://10.0.0.5:6379

Needs the ``examples`` and ``redis`` extras (from a clone, ``pip install '.[examples,redis]'``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx

APP = Path(__file__).resolve().parent.parent / "examples" / "server" / "app.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(tiers: list[dict[str, object]] | None, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "KVOFFLOAD_TIERS"}
    # This checkout's kvoffload, whatever the environment has installed.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(APP.parents[2]), env.get("PYTHONPATH")]))
    if tiers is not None:
        env["KVOFFLOAD_TIERS"] = json.dumps(tiers)
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, str(APP), "--port", str(port), "--device", "cpu"],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited; see {log}")
        try:
            if httpx.get(url + "/stats", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
    raise RuntimeError(f"server on {url} did not start; see {log}")


def complete(url: str, prompt: list[int], max_tokens: int) -> dict[str, object]:
    r = httpx.post(
        url + "/v1/completions",
        json={"prompt": prompt, "max_tokens": max_tokens},
        timeout=600,
    )
    r.raise_for_status()
    return dict(r.json())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--startup-nodes",
        default=os.environ.get("KVOFFLOAD_TEST_REDIS_CLUSTER_URLS", ""),
        help="comma-separated cluster node URLs (default: $KVOFFLOAD_TEST_REDIS_CLUSTER_URLS)",
    )
    p.add_argument("--conversations", type=int, default=4)
    p.add_argument("--turns", type=int, default=3, help="turns on A before the one on B")
    p.add_argument("--user-tokens", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    urls = [u for u in args.startup_nodes.split(",") if u]
    if not urls:
        p.error("no startup nodes (--startup-nodes or $KVOFFLOAD_TEST_REDIS_CLUSTER_URLS)")
    tier = {
        "kind": "redis-cluster",
        "startup_nodes": urls,
        "key_prefix": f"kvoffload-fleet:{uuid.uuid4().hex[:8]}:",
    }
    logs = Path(os.environ.get("TMPDIR", "/tmp"))
    procs = []
    try:
        a, url_a = start([tier], logs / "kvoffload-fleet-a.log")
        procs.append(a)
        b, url_b = start([tier], logs / "kvoffload-fleet-b.log")
        procs.append(b)
        b0, url_b0 = start(None, logs / "kvoffload-fleet-b0.log")
        procs.append(b0)
        rng = random.Random(args.seed)
        finals: dict[str, list[dict[str, object]]] = {"B (shared tier)": [], "B0 (no tier)": []}
        for c in range(args.conversations):
            prompt: list[int] = []
            for _ in range(args.turns):
                prompt += [rng.randrange(256) for _ in range(args.user_tokens)]
                answer = complete(url_a, prompt, args.max_tokens)
                prompt += list(answer["choices"][0]["token_ids"])  # type: ignore[index]
            prompt += [rng.randrange(256) for _ in range(args.user_tokens)]
            time.sleep(1.0)  # A's write-downs land (they run behind A's stores)
            for name, url in (("B (shared tier)", url_b), ("B0 (no tier)", url_b0)):
                body = complete(url, prompt, args.max_tokens)
                timing = dict(body["kvoffload"])  # type: ignore[arg-type]
                timing["prompt_tokens"] = len(prompt)
                finals[name].append(timing)
            print(f"conversation {c}: {len(prompt)} prompt tokens", file=sys.stderr)
        report = {}
        print(
            f"{'server':16} {'prompt':>7} {'loaded':>7} {'computed':>8} {'hit rate':>8} "
            f"{'TTFT p50 ms':>11}"
        )
        for name, rows in finals.items():
            prompt_tokens = sum(int(r["prompt_tokens"]) for r in rows)  # type: ignore[call-overload]
            computed = sum(int(r["computed_tokens"]) for r in rows)  # type: ignore[call-overload]
            loaded = sum(int(r["loaded_tokens"]) for r in rows)  # type: ignore[call-overload]
            ttft = statistics.median(float(r["ttft_s"]) for r in rows) * 1000  # type: ignore[arg-type]
            hit = 1 - min(computed, prompt_tokens) / prompt_tokens
            report[name] = {
                "prompt_tokens": prompt_tokens,
                "loaded_tokens": loaded,
                "computed_tokens": computed,
                "hit_rate": hit,
                "ttft_p50_ms": ttft,
            }
            print(
                f"{name:16} {prompt_tokens:>7} {loaded:>7} {computed:>8} {hit:>8.2f} {ttft:>11.1f}"
            )
        stats = httpx.get(url_b + "/stats", timeout=10).json()
        print(
            json.dumps(
                {"report": report, "b_stats_tiers": stats.get("offloader", {}).get("tiers")},
                default=str,
            )[:4000]
        )
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
