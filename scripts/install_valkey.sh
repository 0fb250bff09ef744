#!/usr/bin/env bash
# Install valkey-server (and valkey-cli) from the system package manager.
#
# Debian 12 ships Valkey in bookworm-backports only: when no configured suite has the
# package, this adds that suite first (apt takes nothing else from backports unless asked).
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive

if command -v valkey-server >/dev/null 2>&1; then
    exit 0
fi
target=()
apt-get update -qq
if [ -z "$(apt-cache policy valkey-server 2>/dev/null | awk '/Candidate:/ {print $2}' | grep -v '(none)')" ]; then
    . /etc/os-release
    if [ "${ID:-}" != debian ] || [ -z "${VERSION_CODENAME:-}" ]; then
        echo "install_valkey: no valkey-server package here and not Debian; install Valkey by hand" >&2
        exit 1
    fi
    echo "deb http://deb.debian.org/debian ${VERSION_CODENAME}-backports main" \
        > /etc/apt/sources.list.d/kvoffload-backports.list
    apt-get update -qq
    target=(-t "${VERSION_CODENAME}-backports")
fi
apt-get install -y -qq --no-install-recommends "${target[@]}" valkey-server
valkey-server --version
