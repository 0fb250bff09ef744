#!/usr/bin/env bash
# Set up the environment (once) and run the main demo. Arguments go to the demo script.
#
# Usage: bash scripts/demo.sh [demo arguments...]   (from any directory; no prompts)
set -euo pipefail

DEMO="examples/serve_multiturn.py"

export PIP_NO_INPUT=1 PIP_ROOT_USER_ACTION=ignore
# The explicit extras argument keeps the demo's own arguments away from _env.sh's. The
# demo extra is numpy, which kvoffload does not use but torch warns about at import.
# shellcheck source=scripts/_env.sh
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh" demo
# _env.sh has changed into the repository root and set $PY.

exec "$PY" "$DEMO" "$@"
