# Sourced by scripts/test.sh, scripts/with_redis.sh and scripts/install_valkey.sh: the one
# place that decides whether a script may install a system package, and how.
#
# A system package (redis-server, valkey-server) is installed only when the caller asked
# for it: under CI=true (a throwaway CI machine), with KVOFFLOAD_INSTALL_SYSTEM_PACKAGES=1,
# or with scripts/test.sh --install-system-packages. Otherwise the script says what is
# missing and how to get it, and fails. An install prints what it is about to do first,
# never starts or enables the package's service (a policy-rc.d that answers 101 during the
# install, then the service's boot links are removed), and checks that none is left.

system_installs_allowed() {
    [ "${CI:-}" = true ] || [ "${KVOFFLOAD_INSTALL_SYSTEM_PACKAGES:-0}" = 1 ]
}

# Where a server binary comes from, for the "missing" message.
_server_hint() {
    case "$1" in
        redis-server) echo "sudo apt-get install --no-install-recommends redis-server (Debian/Ubuntu), or any Redis >= 6 on PATH" ;;
        valkey-server) echo "sudo apt-get install --no-install-recommends valkey-server (Debian 13+, Ubuntu 24.04+; Debian 12: from bookworm-backports, -t bookworm-backports), or any Valkey on PATH" ;;
        *) echo "install $1" ;;
    esac
}

# missing_server_message NAME WHO: the lines that say precisely what is missing.
missing_server_message() {
    local name="$1" who="$2"
    cat <<EOF
$who: $name is not installed (not on PATH), and the Redis tier's tests need it
  (tests/tiers/test_redis.py, tests/tiers/test_tier_bench.py and every test that uses a Redis tier).
  Install it yourself:  $(_server_hint "$name")
  or let the script install it with apt-get (it then prints what it installs, starts no service):
    KVOFFLOAD_INSTALL_SYSTEM_PACKAGES=1 bash scripts/test.sh
    bash scripts/test.sh --install-system-packages
EOF
}

# apt_install_without_services PACKAGE... [-- APT-ARGS...]: apt-get install without starting or
# enabling a service, then check that none was left enabled or running.
# Needs root (CI machines run as root; a user who asked for it runs the script with sudo).
apt_install_without_services() {
    local apt_args=() packages=()
    while [ "$#" -gt 0 ]; do
        if [ "$1" = -- ]; then
            shift
            apt_args=("$@")
            break
        fi
        packages+=("$1")
        shift
    done
    if [ "$(id -u)" -ne 0 ]; then
        echo "installing ${packages[*]} needs root: run the command with sudo, or install it yourself" >&2
        return 1
    fi
    export DEBIAN_FRONTEND=noninteractive
    local pulled
    pulled="$(apt-get install -s --no-install-recommends "${apt_args[@]}" "${packages[@]}" 2>/dev/null \
        | awk '/^Inst / { printf "%s%s", sep, $2; sep = " " }')" || true
    echo "installing with apt-get ${apt_args[*]}: ${pulled:-${packages[*]}} (no service will be started or enabled)" >&2
    # invoke-rc.d and deb-systemd-invoke ask policy-rc.d before they start a service;
    # 101 means "not allowed". Keep one the system already has.
    local policy=/usr/sbin/policy-rc.d ours=0
    if [ ! -e "$policy" ]; then
        printf '#!/bin/sh\n# kvoffload: no service starts during this install\nexit 101\n' >"$policy"
        chmod 755 "$policy"
        ours=1
    fi
    local rc=0
    apt-get install -y -qq --no-install-recommends "${apt_args[@]}" "${packages[@]}" >&2 || rc=$?
    if [ "$ours" = 1 ]; then
        rm -f "$policy"
    fi
    [ "$rc" -eq 0 ] || return "$rc"
    local package
    for package in "${packages[@]}"; do
        _leave_service_disabled "$package" || return 1
    done
}

# The Debian packages enable their unit (and sysv boot links) in postinst, whatever
# policy-rc.d says: undo that, then check.
_leave_service_disabled() {
    local unit="$1"
    if command -v deb-systemd-helper >/dev/null 2>&1; then
        deb-systemd-helper disable "$unit.service" >/dev/null 2>&1 || true
    fi
    if [ -x "/etc/init.d/$unit" ] && command -v update-rc.d >/dev/null 2>&1; then
        update-rc.d "$unit" disable >/dev/null 2>&1 || true
    fi
    if command -v systemctl >/dev/null 2>&1; then
        if [ "$(systemctl is-enabled "$unit.service" 2>/dev/null || true)" = enabled ]; then
            echo "$unit.service is still enabled after the install" >&2
            return 1
        fi
    fi
    if compgen -G "/etc/rc[2-5].d/S??$unit" >/dev/null; then
        echo "$unit still has boot links in /etc/rc?.d after the install" >&2
        return 1
    fi
    # The package's own service runs as its own user (redis, valkey); a throwaway server of
    # a test runs as the caller.
    local user="${unit%-server}"
    if id -u "$user" >/dev/null 2>&1 && pgrep -u "$user" -x "$unit" >/dev/null 2>&1; then
        echo "a $unit service of user $user is running after the install" >&2
        return 1
    fi
}

# ensure_server NAME WHO: NAME (redis-server or valkey-server) is on PATH afterwards, or
# the caller learns precisely why not (status 1).
ensure_server() {
    local name="$1" who="$2"
    if command -v "$name" >/dev/null 2>&1; then
        return 0
    fi
    if ! system_installs_allowed; then
        missing_server_message "$name" "$who" >&2
        return 1
    fi
    if [ "$name" = valkey-server ]; then
        bash "$(dirname "${BASH_SOURCE[0]}")/install_valkey.sh" >&2
    else
        export DEBIAN_FRONTEND=noninteractive
        echo "$who: $name is missing; installing it (CI=true or KVOFFLOAD_INSTALL_SYSTEM_PACKAGES=1)" >&2
        apt-get update -qq >&2
        apt_install_without_services redis-server
    fi
    command -v "$name" >/dev/null 2>&1
}
