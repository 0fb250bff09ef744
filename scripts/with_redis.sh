#!/usr/bin/env bash
# Run a command next to a throwaway redis-server: scripts/with_redis.sh CMD [ARGS...]
#
# When the server is missing it installs it with apt-get only under CI=true or
# KVOFFLOAD_INSTALL_SYSTEM_PACKAGES=1 (printing what it installs, starting no service);
# otherwise it says what is missing and how to get it, and exits 1. It starts the server on
# 127.0.0.1 on a free port with persistence off (in a temporary directory), exports its
# URL as KVOFFLOAD_TEST_REDIS_URL, runs CMD, and stops the server by its process id at the
# end, whether CMD passed or not. Exits with CMD's status.
#
# KVOFFLOAD_TEST_REDIS_SERVER=valkey-server runs Valkey instead of Redis (installed with
# scripts/install_valkey.sh); the tests' own servers use the same binary.
set -euo pipefail

server="${KVOFFLOAD_TEST_REDIS_SERVER:-redis-server}"
export KVOFFLOAD_TEST_REDIS_SERVER="$server"
case "$server" in
    redis-server | valkey-server) ;;
    *) echo "with_redis: KVOFFLOAD_TEST_REDIS_SERVER=$server: redis-server or valkey-server" >&2; exit 2 ;;
esac
# shellcheck source=scripts/_system_packages.sh
source "$(dirname "${BASH_SOURCE[0]}")/_system_packages.sh"
ensure_server "$server" with_redis || exit 1
cli="${server%-server}-cli"  # redis-cli or valkey-cli, from the same packages

dir="$(mktemp -d "${TMPDIR:-/tmp}/kvoffload-redis.XXXXXX")"
port="$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
"$server" --bind 127.0.0.1 --port "$port" --save '' --appendonly no \
    --dir "$dir" --logfile "$dir/redis.log" --daemonize no &
pid=$!

cleanup() {
    kill "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
    rm -rf "$dir"
}
trap cleanup EXIT

for _ in $(seq 1 100); do
    if "$cli" -h 127.0.0.1 -p "$port" ping 2>/dev/null | grep -q PONG; then
        break
    fi
    if ! kill -0 "$pid" 2>/dev/null; then
        echo "with_redis: $server exited; its log:" >&2
        cat "$dir/redis.log" >&2 || true
        exit 1
    fi
    sleep 0.1
done
if ! "$cli" -h 127.0.0.1 -p "$port" ping 2>/dev/null | grep -q PONG; then
    echo "with_redis: $server on port $port did not answer" >&2
    exit 1
fi

export KVOFFLOAD_TEST_REDIS_URL="redis://127.0.0.1:${port}/0"
echo "with_redis: $server pid $pid at $KVOFFLOAD_TEST_REDIS_URL" >&2
set +e
"$@"
status=$?
set -e
exit "$status"
