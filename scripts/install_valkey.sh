#!/usr/bin/env bash
# Install valkey-server (and valkey-cli) from the system package manager, for the Redis
# tier's tests against Valkey. Runs only under CI=true or KVOFFLOAD_INSTALL_SYSTEM_PACKAGES=1
# (scripts/test.sh --install-system-packages sets it); otherwise it says what to install
# and fails. Needs root.
#
# Debian 12 ships Valkey in bookworm-backports only: when no configured suite has the
# package, this adds that suite for the install (apt takes nothing else from backports
# unless asked) and removes the source again afterwards. It prints each step first, and
# starts and enables no service (scripts/_system_packages.sh).
set -euo pipefail
# shellcheck source=scripts/_system_packages.sh
source "$(dirname "${BASH_SOURCE[0]}")/_system_packages.sh"

if command -v valkey-server >/dev/null 2>&1; then
    exit 0
fi
if ! system_installs_allowed; then
    missing_server_message valkey-server install_valkey >&2
    exit 1
fi
if [ "$(id -u)" -ne 0 ]; then
    echo "install_valkey: installing valkey-server needs root: run it with sudo" >&2
    exit 1
fi
export DEBIAN_FRONTEND=noninteractive
echo "install_valkey: apt-get update" >&2
apt-get update -qq
target=()
source_list=""
if [ -z "$(apt-cache policy valkey-server 2>/dev/null | awk '/Candidate:/ {print $2}' | grep -v '(none)')" ]; then
    . /etc/os-release
    if [ "${ID:-}" != debian ] || [ -z "${VERSION_CODENAME:-}" ]; then
        echo "install_valkey: no valkey-server package here and not Debian; install Valkey by hand" >&2
        exit 1
    fi
    source_list=/etc/apt/sources.list.d/kvoffload-backports.list
    echo "install_valkey: adding ${VERSION_CODENAME}-backports as $source_list for this install (removed afterwards)" >&2
    echo "deb http://deb.debian.org/debian ${VERSION_CODENAME}-backports main" >"$source_list"
    trap 'rm -f "$source_list"' EXIT
    apt-get update -qq
    target=(-t "${VERSION_CODENAME}-backports")
fi
apt_install_without_services valkey-server -- "${target[@]}"
valkey-server --version
