#!/usr/bin/env bash
# Set up the dev environment (once, in .venv) and run every check CI runs, stopping at the
# first failure: the test suite (next to a throwaway redis-server on 127.0.0.1), the Redis
# tier's tests again against a throwaway valkey-server, the Redis Cluster tier's tests on
# a throwaway six-node Redis cluster and a six-node Valkey cluster, ruff (lint and format), mypy
# --strict, the docs site built with --strict, every script in examples/, and the vLLM
# integration tests on a real vLLM engine on CPU in their own environment (.venv-vllm).
#
# It needs redis-server and valkey-server on PATH and installs them (with apt-get, as root)
# only when asked: under CI=true, with KVOFFLOAD_INSTALL_SYSTEM_PACKAGES=1, or with
# --install-system-packages. It then prints what it installs first and starts or enables no
# service. Without them it says what is missing and how to get it, and fails before running
# anything. Python packages go into .venv and .venv-vllm only.
#
# Usage: bash scripts/test.sh [--install-system-packages]   (from any directory; no prompts)
set -euo pipefail

for arg in "$@"; do
    case "$arg" in
        --install-system-packages) export KVOFFLOAD_INSTALL_SYSTEM_PACKAGES=1 ;;
        -h | --help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"; exit 0 ;;
        *) echo "test.sh: unknown argument $arg (--install-system-packages)" >&2; exit 2 ;;
    esac
done

# The servers first: a missing one fails now, not ten minutes in.
# shellcheck source=scripts/_system_packages.sh
source "$(dirname "${BASH_SOURCE[0]}")/_system_packages.sh"
missing=()
for server in redis-server valkey-server; do
    command -v "$server" >/dev/null 2>&1 || missing+=("$server")
done
if [ "${#missing[@]}" -gt 0 ]; then
    if ! system_installs_allowed; then
        for server in "${missing[@]}"; do
            missing_server_message "$server" test.sh >&2
        done
        exit 1
    fi
    echo "test.sh: will install with apt-get (no service started or enabled): ${missing[*]}" >&2
    for server in "${missing[@]}"; do
        ensure_server "$server" test.sh || exit 1
    done
fi

export PIP_NO_INPUT=1 PIP_ROOT_USER_ACTION=ignore
# shellcheck source=scripts/_env.sh
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh" dev
# _env.sh has changed into the repository root and set $PY.

start=$SECONDS
section() {
    printf '\n==> %s\n' "$*"
}

section "pytest (next to a throwaway redis-server)"
rc=0
bash scripts/with_redis.sh "$PY" -m pytest -m "not redis_cluster" || rc=$?
if [ "$rc" -eq 5 ]; then
    echo "pytest collected no tests: treating that as a failure" >&2
    exit 1
elif [ "$rc" -ne 0 ]; then
    exit "$rc"
fi

section "pytest: the Redis tier against Valkey (a throwaway valkey-server)"
KVOFFLOAD_TEST_REDIS_SERVER=valkey-server bash scripts/with_redis.sh \
    "$PY" -m pytest -p no:randomly tests/tiers/test_redis.py tests/tiers/test_tier_bench.py

section "pytest: the Redis Cluster tier (a throwaway six-node cluster, Redis then Valkey)"
bash scripts/with_redis_cluster.sh "$PY" -m pytest -m redis_cluster tests/tiers/test_redis_cluster.py
KVOFFLOAD_TEST_REDIS_SERVER=valkey-server bash scripts/with_redis_cluster.sh \
    "$PY" -m pytest -m redis_cluster tests/tiers/test_redis_cluster.py

section "ruff check"
"$PY" -m ruff check .

section "ruff format --check"
"$PY" -m ruff format --check .

section "mypy --strict"
"$PY" -m mypy

section "mkdocs build --strict"
# NO_MKDOCS_2_WARNING silences mkdocs-material's end-of-life banner; it is not a warning
# about this site and --strict still fails on every real one.
export NO_MKDOCS_2_WARNING=1
site="$(mktemp -d "${TMPDIR:-/tmp}/kvoffload-site.XXXXXX")"
trap 'rm -rf "$site" "$site.log"' EXIT
# Not --quiet: it raises the log level above WARNING, and then --strict sees no warning to
# fail on.
if ! "$PY" -m mkdocs build --strict --site-dir "$site" >"$site.log" 2>&1; then
    grep -v '^INFO' "$site.log"
    echo "mkdocs build --strict failed" >&2
    exit 1
fi
grep -v '^INFO' "$site.log" || true

section "examples (KVOFFLOAD_EXAMPLE_QUICK=1)"
shopt -s nullglob
examples=(examples/*.py)
shopt -u nullglob
if [ "${#examples[@]}" -eq 0 ]; then
    echo "no examples to run"
fi
for example in "${examples[@]}"; do
    echo "--- $example"
    KVOFFLOAD_EXAMPLE_QUICK=1 "$PY" "$example" </dev/null
done

section "vLLM integration tests (own environment, .venv-vllm)"
bash scripts/test_vllm.sh

section "all checks passed in $((SECONDS - start))s"
