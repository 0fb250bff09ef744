#!/usr/bin/env bash
# The CPU recipe of docs/vllm.md ("On a CPU"), run as written on a tiny random-weight Llama:
# writes the model's config.json to a temporary directory (no download), starts vLLM's
# OpenAI server on 127.0.0.1 with KVOffloadConnector, sends two completions that share a
# 256-token prefix, prints their usage, and stops the server by its process id.
#
# Usage: bash scripts/vllm_cpu_serve.sh     (after bash scripts/vllm_env.sh; no prompts)
#        KVOFFLOAD_VLLM_PORT=8123 bash scripts/vllm_cpu_serve.sh
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
"$VLLM_PY" -c "
import sys; sys.path.insert(0, 'tests_vllm')
from pathlib import Path
from harness import write_tiny_llama
write_tiny_llama(Path(sys.argv[1]))
" "$model" 2>/dev/null

# The recipe. VLLM_CPU_KVCACHE_SPACE: GiB of host memory for vLLM's own KV cache (without
# it, vLLM asks for gpu_memory_utilization x all host memory). --load-format dummy and
# --skip-tokenizer-init only because the tiny model has no weights and no tokenizer.
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
"$VLLM_PY" -m vllm.entrypoints.openai.api_server \
    --model "$model" --load-format dummy --skip-tokenizer-init --dtype float32 \
    --max-model-len 2048 --host 127.0.0.1 --port "$port" \
    --kv-transfer-config '{
      "kv_connector": "KVOffloadConnector",
      "kv_connector_module_path": "kvoffload.integrations.vllm",
      "kv_role": "kv_both",
      "kv_load_failure_policy": "recompute",
      "kv_connector_extra_config": {"cpu_bytes": "256MiB"}
    }' >"$dir/server.log" 2>&1 &
pid=$!
cleanup() {
    kill -INT "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
    rm -rf "$dir"
}
trap cleanup EXIT

echo "vllm_cpu_serve: starting vLLM (pid $pid) on port $port; its log: $dir/server.log" >&2
until "$VLLM_PY" -c "import urllib.request, sys; urllib.request.urlopen(sys.argv[1], timeout=2)" \
    "http://127.0.0.1:$port/health" 2>/dev/null; do
    if ! kill -0 "$pid" 2>/dev/null; then
        echo "vllm_cpu_serve: the server exited; its log:" >&2
        cat "$dir/server.log" >&2
        exit 1
    fi
    sleep 1
done
"$VLLM_PY" - "$port" "$model" <<'PY'
import json
import sys
import urllib.request

port, model = sys.argv[1], sys.argv[2]
prefix = [(7 * i) % 500 + 2 for i in range(256)]
for n, tail in enumerate(([11, 12, 13], [21, 22, 23, 24])):
    body = {"model": model, "prompt": prefix + tail, "max_tokens": 4}
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as reply:
        usage = json.load(reply)["usage"]
    print(f"request {n}: {usage['prompt_tokens']} prompt tokens, "
          f"{usage['completion_tokens']} generated")
PY
echo "vllm_cpu_serve: the recipe ran; stopping the server" >&2
