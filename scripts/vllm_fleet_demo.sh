#!/usr/bin/env bash
# vLLM engines sharing kvoffload's tiers (docs/vllm.md, "A fleet and a warm restart"):
# starts a throwaway six-node Redis Cluster on loopback (scripts/with_redis_cluster.sh),
# then scripts/vllm_fleet_demo.py: engine A plays the first turn of three conversations
# with the cluster as its tier; engine B, a new process, continues them and serves their
# earlier turns from the cluster; engine C plays the first turns on a persistent disk
# file and exits, engine D restarts on the file and continues them; engine B0 (no
# connector) gives the reference tokens. Prints what each engine served and from where.
#
# Usage: bash scripts/vllm_fleet_demo.sh            (after bash scripts/vllm_env.sh)
#        KVOFFLOAD_VLLM_VENV=/path/to/venv bash scripts/vllm_fleet_demo.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VLLM_PY="${KVOFFLOAD_VLLM_VENV:-.venv-vllm}/bin/python"
if [ ! -x "$VLLM_PY" ]; then
    echo "vllm_fleet_demo: $VLLM_PY is missing: run bash scripts/vllm_env.sh first" >&2
    exit 1
fi
exec bash scripts/with_redis_cluster.sh "$VLLM_PY" scripts/vllm_fleet_demo.py "$@"
