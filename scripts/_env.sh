# Sourced by scripts/demo.sh and scripts/test.sh: creates .venv once and installs
# kvoffload into it. torch is pinned to the CPU build that this machine kind keeps
# on disk, so set-up never downloads a multi-GB CUDA wheel. A GPU user installs the
# torch build they want first; kvoffload only asks for torch>=2.4.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV="${KVOFFLOAD_VENV:-.venv}"
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
extras="${1:-}"
stamp="$VENV/.kvoffload-installed${extras:+-$extras}"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    if ! "$PY" -c 'import torch' 2>/dev/null; then
        "$PY" -m pip install -q --disable-pip-version-check "torch==${KVOFFLOAD_TORCH_VERSION:-2.13.0}"
    fi
    "$PY" -m pip install -q --disable-pip-version-check -e ".${extras:+[$extras]}"
    touch "$stamp"
fi
