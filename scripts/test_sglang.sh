#!/usr/bin/env bash
# Run the SGLang HiCache storage backend's tests (tests_sglang/) in their own environment,
# .venv-sglang, which scripts/sglang_env.sh creates once (SGLang 0.5.23 without its GPU
# requirements, CPU torch, kvoffload editable with the redis extra, pytest).
# The tests need SGLang: if it does not import, they fail; they are never skipped.
#
# Usage: bash scripts/test_sglang.sh [pytest args]     (from any directory; no prompts)
#        KVOFFLOAD_SGLANG_VENV=/elsewhere bash scripts/test_sglang.sh
set -euo pipefail

export PIP_NO_INPUT=1 PIP_ROOT_USER_ACTION=ignore
# shellcheck source=scripts/sglang_env.sh
source "$(dirname "${BASH_SOURCE[0]}")/sglang_env.sh"
# sglang_env.sh has changed into the repository root and set $SGLANG_PY.

start=$SECONDS
echo "==> pytest tests_sglang"
rc=0
"$SGLANG_PY" -m pytest -c tests_sglang/pytest.ini --rootdir tests_sglang tests_sglang "$@" || rc=$?
if [ "$rc" -eq 5 ]; then
    echo "pytest collected no SGLang tests: treating that as a failure" >&2
    exit 1
fi
echo "SGLang backend tests finished in $((SECONDS - start))s (exit $rc)"
exit "$rc"
