#!/usr/bin/env bash
# GPU checks for the transfer layer, in one go (a few minutes on one GPU):
#   1. the `cuda`-marked tests (bit-exact round trips, FM-01/03/04 ordering on real streams)
#      plus the CPU transfer tests as a sanity check;
#   2. the copy benchmark for both layouts (2 MiB blocks and 32 KiB per-layer pieces).
# Needs: python3 with torch built for CUDA. The GPU machine has no network: kvoffload's
# own dependencies that its image lacks travel as wheels in .whl/ (made here by
# `bash scripts/gpu_wheels.sh`), installed into a private folder, never over torch.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="${PYTHON:-python3}"
"$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "no CUDA device")'
if compgen -G ".whl/*.whl" >/dev/null; then
    site="${TMPDIR:-/tmp}/kvoffload-site"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --disable-pip-version-check \
        --upgrade --target "$site" .whl/*.whl
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
missing=()
for mod in anyio pydantic pydantic_settings structlog tqdm pytest pytest_timeout pytest_asyncio trio hypothesis; do
    "$PY" -c "import $mod" 2>/dev/null || missing+=("$mod")
done
if [ "${#missing[@]}" -gt 0 ]; then
    echo "missing Python packages: ${missing[*]} (run scripts/gpu_wheels.sh and carry .whl)" >&2
    exit 1
fi
"$PY" -c 'import torch; print("torch", torch.__version__, "device", torch.cuda.get_device_name())'
timeout 180 "$PY" -m pytest -q -p no:cacheprovider tests/transfer -m cuda
timeout 120 "$PY" -m pytest -q -p no:cacheprovider tests/transfer -m "not cuda" -x
for layout in llama3-8b small-pieces; do
    timeout 120 "$PY" -m kvoffload.bench copy --engine cuda --layout "$layout" \
        --blocks 1,16,64,256 --reps 7
done
