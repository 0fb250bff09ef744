#!/usr/bin/env bash
# Set up the dev environment (once, in .venv) and run every check CI runs, stopping at the
# first failure: the test suite (next to a throwaway redis-server on 127.0.0.1), the Redis
# tier's tests again against a throwaway valkey-server, the Redis Cluster tier's tests on
# a throwaway six-node Redis cluster and a six-node Valkey cluster, ruff (lint and format), mypy
# --strict, the docs site built with --strict, every script in examples/, and the vLLM
# integration tests on a real vLLM engine on CPU in their own environment (.venv-vllm),
# and the SGLang HiCache backend's tests with SGLang's own classes in theirs (.venv-sglang).
#
# How long: about 10 minutes on a quiet 2-core machine once the environments exist (the
# first run also installs .venv, .venv-vllm and .venv-sglang: about 20 minutes more), and
# 40 minutes or more on a loaded one. The two engine stages, last, are more than half of
# it: --fast skips them and says so at the end. Each
# stage starts with a line "==> stage N of M (elapsed): what"; --list prints the stages
# that would run and runs nothing. CI (.ci/run) always runs every stage.
#
# It needs redis-server and valkey-server on PATH and installs them (with apt-get, as root)
# only when asked: under CI=true, with KVOFFLOAD_INSTALL_SYSTEM_PACKAGES=1, or with
# --install-system-packages. It then prints what it installs first and starts or enables no
# service. Without them it says what is missing and how to get it, and fails before running
# anything. Python packages go into .venv and .venv-vllm only.
#
# Usage: bash scripts/test.sh [--fast] [--list] [--install-system-packages]
#        (from any directory; no prompts)
set -euo pipefail

fast=0
list=0
for arg in "$@"; do
    case "$arg" in
        --install-system-packages) export KVOFFLOAD_INSTALL_SYSTEM_PACKAGES=1 ;;
        --fast) fast=1 ;;
        --list) list=1 ;;
        -h | --help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"; exit 0 ;;
        *) echo "test.sh: unknown argument $arg (--fast, --list, --install-system-packages)" >&2; exit 2 ;;
    esac
done

# The stages, in order: "function|what it checks". Each function is defined below.
stages=(
    "stage_pytest|pytest (next to a throwaway redis-server)"
    "stage_valkey|pytest: the Redis tier against Valkey (a throwaway valkey-server)"
    "stage_cluster|pytest: the Redis Cluster tier (a throwaway six-node cluster, Redis then Valkey)"
    "stage_ruff_check|ruff check"
    "stage_ruff_format|ruff format --check"
    "stage_mypy|mypy --strict"
    "stage_mkdocs|mkdocs build --strict"
    "stage_examples|examples (KVOFFLOAD_EXAMPLE_QUICK=1)"
    "stage_vllm|vLLM integration tests (own environment, .venv-vllm)"
    "stage_sglang|SGLang HiCache backend tests (own environment, .venv-sglang)"
)
skipped=()
if [ "$fast" -eq 1 ]; then
    # The engine stages, last: each in its own environment.
    skipped=("${stages[-2]#*|}" "${stages[-1]#*|}")
    stages=("${stages[@]:0:${#stages[@]}-2}")
fi

# "3m07s"
duration() {
    printf '%dm%02ds' $(($1 / 60)) $(($1 % 60))
}

# What was skipped, for the last line; empty when every stage runs.
skipped_note() {
    if [ "${#skipped[@]}" -gt 0 ]; then
        local joined
        joined="$(printf '%s and ' "${skipped[@]}")"
        printf 'skipped (--fast): %s; run without --fast for every check' "${joined% and }"
    fi
}

if [ "$list" -eq 1 ]; then
    for i in "${!stages[@]}"; do
        printf 'stage %d of %d: %s\n' $((i + 1)) "${#stages[@]}" "${stages[i]#*|}"
    done
    if [ "${#skipped[@]}" -gt 0 ]; then
        skipped_note
        echo
    fi
    exit 0
fi

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

stage_pytest() {
    local rc=0
    bash scripts/with_redis.sh "$PY" -m pytest -m "not redis_cluster" || rc=$?
    if [ "$rc" -eq 5 ]; then
        echo "pytest collected no tests: treating that as a failure" >&2
        exit 1
    elif [ "$rc" -ne 0 ]; then
        exit "$rc"
    fi
}

stage_valkey() {
    KVOFFLOAD_TEST_REDIS_SERVER=valkey-server bash scripts/with_redis.sh \
        "$PY" -m pytest -p no:randomly tests/tiers/test_redis.py tests/tiers/test_tier_bench.py
}

stage_cluster() {
    bash scripts/with_redis_cluster.sh "$PY" -m pytest -m redis_cluster tests/tiers/test_redis_cluster.py
    KVOFFLOAD_TEST_REDIS_SERVER=valkey-server bash scripts/with_redis_cluster.sh \
        "$PY" -m pytest -m redis_cluster tests/tiers/test_redis_cluster.py
}

stage_ruff_check() {
    "$PY" -m ruff check .
}

stage_ruff_format() {
    "$PY" -m ruff format --check .
}

stage_mypy() {
    "$PY" -m mypy
}

stage_mkdocs() {
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
}

stage_examples() {
    local examples example
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
}

stage_vllm() {
    bash scripts/test_vllm.sh
}

stage_sglang() {
    bash scripts/test_sglang.sh
}

start=$SECONDS
for i in "${!stages[@]}"; do
    printf '\n==> stage %d of %d (%s): %s\n' $((i + 1)) "${#stages[@]}" \
        "$(duration $((SECONDS - start)))" "${stages[i]#*|}"
    "${stages[i]%%|*}"
done

printf '\n==> all %d checks passed in %s\n' "${#stages[@]}" "$(duration $((SECONDS - start)))"
if [ "${#skipped[@]}" -gt 0 ]; then
    printf '==> %s\n' "$(skipped_note)"
fi
