# Sourced by scripts/test_sglang.sh: creates .venv-sglang once, with SGLang and kvoffload,
# for the SGLang HiCache storage backend's tests (tests_sglang/). SGLang's own requirements
# pin a CUDA torch and GPU kernels that a CPU machine cannot use, so SGLang is installed
# with --no-deps and only the light packages its HiCache modules import are added, every
# one pinned, with torch named at its exact CPU version on the same command line so that
# nothing here ever pulls a CUDA wheel.
#
# SGLang imports torchvision unconditionally; the index's torchvision wheels are linked
# against CUDA torch and do not load on the CPU build, so none is installed: the tests put
# a stub on their path (tests_sglang/stubs/torchvision), never the package.
#
# pip reports that SGLang's own pins (a CUDA torch 2.14.1, GPU kernels) are not met: that is
# expected here and not an error.
#
# KVOFFLOAD_SGLANG_VENV picks another place for the environment (default .venv-sglang).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
SGLANG_VENV="${KVOFFLOAD_SGLANG_VENV:-.venv-sglang}"
SGLANG_VERSION=0.5.23
TORCH_VERSION=2.13.0
# What SGLang 0.5.23's HiCache modules (storage base, backend factory, host pools, cache
# controller) import, at the versions it pins where it pins one.
SGLANG_LIGHT_DEPS=(
    "aiohttp==3.14.5"
    "apache-tvm-ffi==0.1.11"
    "compressed-tensors==0.18.0"
    "dill==0.4.1"
    "gguf==0.19.0"
    "ipython==9.18.1"
    "msgspec==0.23.0"
    "numpy==2.4.6"
    "orjson==3.13.0"
    "packaging==26.4"
    "pillow==13.0.0"
    "psutil==7.2.2"
    "pybase64==1.5.1"
    "pydantic==2.14.4"
    "pyyaml==6.0.4"
    "pyzmq==27.3.0"
    "requests==2.34.2"
    "sentencepiece==0.2.1"
    "starlette==1.10.0"
    "tqdm==4.70.1"
    "transformers==5.19.0"
    "triton==3.9.0"
)
if [ ! -x "$SGLANG_VENV/bin/python" ]; then
    python3 -m venv "$SGLANG_VENV"
fi
SGLANG_PY="$SGLANG_VENV/bin/python"
stamp="$SGLANG_VENV/.kvoffload-installed-sglang-$SGLANG_VERSION"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ "${BASH_SOURCE[0]}" -nt "$stamp" ]; then
    pip_install=("$SGLANG_PY" -m pip install -q --disable-pip-version-check)
    "${pip_install[@]}" --upgrade "pip>=24"
    "${pip_install[@]}" "torch==$TORCH_VERSION"
    "${pip_install[@]}" --no-deps "sglang==$SGLANG_VERSION"
    "${pip_install[@]}" "torch==$TORCH_VERSION" "${SGLANG_LIGHT_DEPS[@]}"
    "${pip_install[@]}" "torch==$TORCH_VERSION" -e '.[redis]' \
        "pytest==9.2.0" "pytest-timeout==2.4.0"
    # a torchvision pulled in by anything above would fail to load against CPU torch
    "$SGLANG_PY" -m pip uninstall -q -y torchvision
    touch "$stamp"
fi
