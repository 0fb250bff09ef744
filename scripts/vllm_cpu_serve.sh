#!/usr/bin/env bash
# The CPU recipe of docs/vllm.md ("On a CPU"), run on a tiny random-weight Llama, with a
# workload that outgrows vLLM's own KV cache so that kvoffload has something to serve:
# writes the model's config.json to a temporary directory (no download), starts vLLM's
# OpenAI server on 127.0.0.1 with KVOffloadConnector, sends 8 distinct prompts of 700
# tokens and then the first 3 again (scripts/vllm_workload.py), prints for each request
# where its prompt tokens came from (vLLM's own /metrics counters), and stops the server
# by its process id. The server's log is kept; the last line says where.
#
# Usage: bash scripts/vllm_cpu_serve.sh     (after bash scripts/vllm_env.sh; no prompts)
#        KVOFFLOAD_VLLM_PORT=8123 bash scripts/vllm_cpu_serve.sh
#        KVOFFLOAD_VLLM_VENV=/path/to/venv bash scripts/vllm_cpu_serve.sh   (another env)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VLLM_PY="${KVOFFLOAD_VLLM_VENV:-.venv-vllm}/bin/python"
if [ ! -x "$VLLM_PY" ]; then
    echo "vllm_cpu_serve: $VLLM_PY is missing: run bash scripts/vllm_env.sh first" >&2
    exit 1
fi
port="${KVOFFLOAD_VLLM_PORT:-8000}"
dir="$(mktemp -d "${TMPDIR:-/tmp}/kvoffload-vllm-cpu.XXXXXX")"
model="$dir/tiny-llama"
log="$dir/server.log"
"$VLLM_PY" -c "
import sys; sys.path.insert(0, 'tests_vllm')
from pathlib import Path
from harness import write_tiny_llama
write_tiny_llama(Path(sys.argv[1]))
" "$model" 2>/dev/null

# The server. `vllm serve` is vLLM's entry point, but the CPU build (the distribution
# vllm-cpu) has no distribution named vllm and its `vllm` command stops with
# PackageNotFoundError before it reads its arguments; the module below is what
# `vllm serve` runs for one API server (python -m vllm.entrypoints.openai.api_server,
# now deprecated, runs it too), with `vllm serve`'s options and the model as --model.
if "$VLLM_PY" -c "import importlib.metadata as m; m.version('vllm')" 2>/dev/null; then
    serve=("${VLLM_PY%/python}/vllm" serve)
else
    serve=("$VLLM_PY" -m vllm.entrypoints.launchers.api_server.entry)
fi

# The sizing. vLLM's CPU backend stores 128 tokens per block (--block-size left out).
# VLLM_CPU_KVCACHE_SPACE=1 (GiB) would give vLLM 8192 blocks of this tiny model (2 layers
# x K and V x 128 tokens x 2 heads x 32 x 4 bytes = 128 KiB a block): every prompt below
# would stay in vLLM's own prefix cache, and kvoffload would never be asked for one.
# --num-gpu-blocks-override 16 caps vLLM's own cache at 16 blocks, one of them vLLM's null
# block: 15 usable, 1920 tokens. The 8 prompts of 700 tokens hold 5 full blocks each (40
# in all); once the 5 prompts after the first 3 have taken their 25 blocks, the first 3
# are out of vLLM's cache, and kvoffload serves 640 of the 700 tokens of each one sent
# again (its 5 full blocks; the partial last block is computed). --max-model-len 1024 (8
# blocks): vLLM refuses to start when one request of max-model-len does not fit its cache.
# kvoffload's pool, cpu_bytes 64MiB (512 blocks of 128 KiB), holds all 40.
# A hybrid model (sliding-window, chunked or recurrent-state layers with full attention)
# needs more blocks for the same prompts: every KV cache group takes its own blocks for a
# request from this one pool (docs/vllm.md, "Size vLLM's cache so that offload has work").
# --load-format dummy and --skip-tokenizer-init only because the tiny model has no
# weights and no tokenizer (the prompts are token ids).
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
"${serve[@]}" \
    --model "$model" --load-format dummy --skip-tokenizer-init --dtype float32 \
    --num-gpu-blocks-override 16 --max-model-len 1024 --host 127.0.0.1 --port "$port" \
    --kv-transfer-config '{
      "kv_connector": "KVOffloadConnector",
      "kv_connector_module_path": "kvoffload.integrations.vllm",
      "kv_role": "kv_both",
      "kv_load_failure_policy": "recompute",
      "kv_connector_extra_config": {"cpu_bytes": "64MiB"}
    }' >"$log" 2>&1 &
pid=$!
cleanup() {
    kill -INT "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
    rm -rf "$model"
    echo "vllm_cpu_serve: the server's log is kept: $log" >&2
}
trap cleanup EXIT

echo "vllm_cpu_serve: starting vLLM (pid $pid) on port $port; its log: $log" >&2
until "$VLLM_PY" -c "import urllib.request, sys; urllib.request.urlopen(sys.argv[1], timeout=2)" \
    "http://127.0.0.1:$port/health" 2>/dev/null; do
    if ! kill -0 "$pid" 2>/dev/null; then
        echo "vllm_cpu_serve: the server exited; its log:" >&2
        cat "$log" >&2
        exit 1
    fi
    sleep 1
done
"$VLLM_PY" scripts/vllm_workload.py --port "$port" --model "$model" \
    --prompts 8 --prompt-tokens 700 --repeat 3
echo "vllm_cpu_serve: the recipe ran; stopping the server" >&2
