#!/usr/bin/env bash
# GPU checks for the transfer layer, in one go (a few minutes on one GPU):
#   1. the `cuda`-marked tests (bit-exact round trips, FM-01/03/04 ordering on real streams)
#      plus the CPU transfer tests as a sanity check;
#   2. the copy benchmark for both layouts (2 MiB blocks and 32 KiB per-layer pieces).
# Needs: python3 with torch built for CUDA. kvoffload's own dependencies (anyio,
# pydantic, pydantic-settings, structlog, tqdm) and the test tools (pytest,
# pytest-timeout, pytest-asyncio, trio) are installed with pip if missing; torch is
# never reinstalled (--no-deps).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="${PYTHON:-python3}"
"$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "no CUDA device")'
need=()
for mod in anyio pydantic pydantic_settings structlog tqdm pytest pytest_timeout pytest_asyncio trio; do
    "$PY" -c "import $mod" 2>/dev/null || need+=("${mod//_/-}")
done
if [ "${#need[@]}" -gt 0 ]; then
    "$PY" -m pip install -q --disable-pip-version-check "${need[@]}"
fi
"$PY" -c 'import kvoffload' 2>/dev/null || "$PY" -m pip install -q --disable-pip-version-check --no-deps -e .
"$PY" -c 'import torch; print("torch", torch.__version__, "device", torch.cuda.get_device_name())'
timeout 180 "$PY" -m pytest -q -p no:cacheprovider tests/transfer -m cuda
timeout 120 "$PY" -m pytest -q -p no:cacheprovider tests/transfer -m "not cuda" -x
for layout in llama3-8b small-pieces; do
    timeout 120 "$PY" -c 'import sys, argparse
from kvoffload.bench import copy
p = argparse.ArgumentParser(); sub = p.add_subparsers(dest="c", required=True); copy.add_parser(sub)
a = p.parse_args(sys.argv[1:]); sys.exit(a.run(a))' copy --engine cuda --layout "$layout" --blocks 1,16,64,256 --reps 7
done
