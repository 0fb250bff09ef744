"""vLLM engines sharing kvoffload's tiers: a fleet on a Redis Cluster, a warm restart on disk.

Each engine is a fresh process (this script run with ``engine``), a vLLM CPU engine with a
tiny random-weight Llama and `KVOffloadConnector`:

1. Engine A (tier: the Redis Cluster) plays the first turn of every conversation.
2. Engine B (a new process, same cluster) plays each conversation's next turn, whose
   prompt is the first turn, its answer and a new message: the earlier part comes from
   the cluster, where A wrote it down.
3. Engine C (tier: a persistent disk file) plays the first turns and exits; engine D,
   restarted on the same file, plays the next turns from it.
4. Engine B0 (no connector) plays the next turns too: the reference tokens.

Prints, per engine, the prompt tokens served from kvoffload (loaded instead of computed),
those computed, the blocks promoted from the tier, and whether the tokens match B0's.

    bash scripts/vllm_fleet_demo.sh      (starts a throwaway cluster, then runs this)
    .venv-vllm/bin/python scripts/vllm_fleet_demo.py --startup-nodes redis://h:6379,...
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BLOCK = 32
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
    "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 32, "num_hidden_layers": 2, "vocab_size": 512,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "tie_word_embeddings": False, "torch_dtype": "float32", "bos_token_id": 0,
    "eos_token_id": 1,
}  # fmt: skip


def first_turns(n: int, tokens: int) -> list[list[int]]:
    return [[(c * 97 + i * 7) % 500 + 2 for i in range(tokens)] for c in range(n)]


def run_engine(spec: dict[str, Any]) -> dict[str, Any]:
    """One engine: play ``spec["prompts"]`` one after the other; what each one served."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    from vllm import LLM, SamplingParams  # noqa: PLC0415

    kwargs: dict[str, Any] = {}
    if spec["tiers"] is not None:
        kwargs["kv_transfer_config"] = {
            "kv_connector": "KVOffloadConnector",
            "kv_connector_module_path": "kvoffload.integrations.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "num_cpu_blocks": 256,
                "model_id": "fleet-demo-tiny-llama",
                "tiers": spec["tiers"],
            },
        }
    gpu_blocks = 64
    llm = LLM(
        model=spec["model"], load_format="dummy", skip_tokenizer_init=True, enforce_eager=True,
        block_size=BLOCK, num_gpu_blocks_override=gpu_blocks,
        max_model_len=(gpu_blocks - 1) * BLOCK, max_num_seqs=4,
        max_num_batched_tokens=gpu_blocks * BLOCK, enable_prefix_caching=True,
        dtype="float32", seed=0, **kwargs,
    )  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=spec["answer_tokens"], ignore_eos=True)
    turns = []
    for prompt in spec["prompts"]:
        (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        served = out.num_cached_tokens or 0
        answer = list(out.outputs[0].token_ids)
        turns.append({"prompt_tokens": len(prompt), "served": served, "answer": answer})
    promoted = 0
    core = llm.llm_engine.engine_core.engine_core
    connector = core.scheduler.connector
    if connector is not None and connector.scheduler_side.tiers is not None:
        promoted = connector.scheduler_side.tiers.statistics().blocks_promoted
    core.shutdown()  # the workers drain their write-downs into the tiers
    return {"turns": turns, "blocks_promoted": promoted}


def engine_process(spec: dict[str, Any]) -> dict[str, Any]:
    """`run_engine` in a fresh process (with this clone's kvoffload first on its path)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, __file__, "engine"], input=json.dumps(spec), capture_output=True,
        text=True, check=False, env=env,
    )  # fmt: skip
    if done.returncode != 0:
        sys.stderr.write(done.stderr[-4000:])
        raise SystemExit(f"engine process failed ({done.returncode})")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", nargs="?", default="demo", choices=["demo", "engine"])
    nodes = os.environ.get("KVOFFLOAD_TEST_REDIS_CLUSTER_URLS")
    parser.add_argument("--startup-nodes", default=nodes)
    parser.add_argument("--conversations", type=int, default=3)
    parser.add_argument("--first-tokens", type=int, default=400)
    parser.add_argument("--next-tokens", type=int, default=100)
    parser.add_argument("--answer-tokens", type=int, default=16)
    args = parser.parse_args()
    if args.mode == "engine":
        print(json.dumps(run_engine(json.loads(sys.stdin.read()))))
        return
    if not args.startup_nodes:
        raise SystemExit("no cluster: pass --startup-nodes or run scripts/vllm_fleet_demo.sh")
    work = Path(tempfile.mkdtemp(prefix="kvoffload-vllm-fleet-"))
    model = work / "tiny-llama"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY_LLAMA))
    cluster = [{"kind": "redis-cluster", "startup_nodes": args.startup_nodes.split(",")}]
    disk = [{"kind": "disk", "path": str(work / "kv.bin"), "capacity_bytes": "64MiB",
             "persist": True}]  # fmt: skip
    firsts = first_turns(args.conversations, args.first_tokens)

    def spec(tiers: list[dict[str, Any]] | None, prompts: list[list[int]]) -> dict[str, Any]:
        return {"model": str(model), "tiers": tiers, "prompts": prompts,
                "answer_tokens": args.answer_tokens}  # fmt: skip

    try:
        _demo(args, spec, cluster, disk, firsts)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _demo(
    args: argparse.Namespace,
    spec: Callable[[list[dict[str, Any]] | None, list[list[int]]], dict[str, Any]],
    cluster: list[dict[str, Any]],
    disk: list[dict[str, Any]],
    firsts: list[list[int]],
) -> None:
    a = engine_process(spec(cluster, firsts))
    nexts = [
        first + turn["answer"] + [(c * 31 + i * 11) % 500 + 2 for i in range(args.next_tokens)]
        for c, (first, turn) in enumerate(zip(firsts, a["turns"], strict=True))
    ]
    b = engine_process(spec(cluster, nexts))
    c = engine_process(spec(disk, firsts))
    d = engine_process(spec(disk, nexts))
    b0 = engine_process(spec(None, nexts))
    reference = [t["answer"] for t in b0["turns"]]

    rows = [
        ("A  first turns", "redis-cluster", a, None),
        ("B  next turns, new process", "redis-cluster", b, reference),
        ("C  first turns", "disk (persist)", c, None),
        ("D  next turns, restarted", "disk (persist)", d, reference),
        ("B0 next turns", "none", b0, None),
    ]
    print(f"\n{'engine':30} {'tier':15} {'prompt':>7} {'served':>7} {'computed':>9} "
          f"{'promoted':>9}  tokens as B0")  # fmt: skip
    summary = []
    for name, tier, run, ref in rows:
        prompt = sum(t["prompt_tokens"] for t in run["turns"])
        served = sum(t["served"] for t in run["turns"])
        same = "-" if ref is None else str([t["answer"] for t in run["turns"]] == ref).lower()
        print(f"{name:30} {tier:15} {prompt:7d} {served:7d} {prompt - served:9d} "
              f"{run['blocks_promoted'] * BLOCK:9d}  {same}")  # fmt: skip
        summary.append({"engine": name, "tier": tier, "prompt_tokens": prompt,
                        "served_tokens": served, "promoted_tokens": run["blocks_promoted"] * BLOCK,
                        "tokens_as_b0": same})  # fmt: skip
    print("\nserved: prompt tokens loaded instead of computed (kvoffload); promoted: tokens")
    print("brought from the tier into the CPU pool. A and C start empty; B and D are fresh")
    print("processes whose only source for the earlier turns is the tier.")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
