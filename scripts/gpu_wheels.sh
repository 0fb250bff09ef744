#!/usr/bin/env bash
# Download, here, the wheels that scripts/gpu_check.sh needs on a GPU machine that has no
# network and whose image lacks them (Python 3.12, x86-64 Linux), into .whl/ (git
# ignores it). Then carry .whl to the GPU machine along with the working tree.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
rm -rf .whl
python3 -m pip download -q --disable-pip-version-check --only-binary=:all: \
    --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl \
    "pydantic>=2.7" "pydantic-settings>=2.3" "structlog>=24.1" "trio>=0.25" \
    "pytest-asyncio>=0.24" "pytest-timeout>=2.3" "tqdm>=4.66"
ls .whl
