#!/usr/bin/env bash
# Run a command next to a throwaway six-node Redis Cluster: scripts/with_redis_cluster.sh CMD [ARGS...]
#
# Starts six redis-server processes on free loopback ports (each with its cluster bus port,
# port + 10000, free too) with cluster-enabled yes and persistence off, in a temporary
# directory; joins them into three primaries with a replica each
# (redis-cli --cluster create ... --cluster-replicas 1 --cluster-yes); waits until every
# node reports cluster_state:ok; exports the startup URLs, comma-separated, as
# KVOFFLOAD_TEST_REDIS_CLUSTER_URLS; runs CMD; and stops every node by its process id at
# the end, whether CMD passed or not. Exits with CMD's status.
#
# KVOFFLOAD_TEST_REDIS_SERVER=valkey-server runs Valkey (and valkey-cli) instead; the
# tests' own clusters use the same binary. The server must be installed (redis-server
# from the system packages, valkey-server with scripts/install_valkey.sh).
set -euo pipefail

server="${KVOFFLOAD_TEST_REDIS_SERVER:-redis-server}"
export KVOFFLOAD_TEST_REDIS_SERVER="$server"
case "$server" in
    redis-server | valkey-server) ;;
    *) echo "with_redis_cluster: KVOFFLOAD_TEST_REDIS_SERVER=$server: redis-server or valkey-server" >&2; exit 2 ;;
esac
cli="${server%-server}-cli"  # redis-cli or valkey-cli, from the same packages
for binary in "$server" "$cli"; do
    if ! command -v "$binary" >/dev/null 2>&1; then
        echo "with_redis_cluster: $binary is not installed" >&2
        exit 1
    fi
done

dir="$(mktemp -d "${TMPDIR:-/tmp}/kvoffload-redis-cluster.XXXXXX")"
pids=()
cleanup() {
    for pid in "${pids[@]}"; do
        kill -CONT "$pid" 2>/dev/null || true
        kill "$pid" 2>/dev/null || true
    done
    for pid in "${pids[@]}"; do
        wait "$pid" 2>/dev/null || true
    done
    rm -rf "$dir"
}
trap cleanup EXIT

# Six ports whose cluster bus ports (port + 10000) are free as well.
mapfile -t ports < <(python3 - <<'PY'
import random, socket
ports = []
while len(ports) < 6:
    port = random.randrange(20000, 45000)
    if port in ports or port + 10000 in ports:
        continue
    try:
        for p in (port, port + 10000):
            with socket.socket() as s:
                s.bind(("127.0.0.1", p))
    except OSError:
        continue
    ports.append(port)
print("\n".join(map(str, ports)))
PY
)

for port in "${ports[@]}"; do
    mkdir -p "$dir/$port"
    "$server" --bind 127.0.0.1 --port "$port" --save '' --appendonly no \
        --cluster-enabled yes --cluster-config-file "$dir/$port/nodes.conf" \
        --cluster-node-timeout 2000 --repl-diskless-sync-delay 0 \
        --dir "$dir/$port" --logfile "$dir/$port/server.log" \
        --daemonize no &
    pids+=("$!")
done

for port in "${ports[@]}"; do
    for _ in $(seq 1 100); do
        if "$cli" -h 127.0.0.1 -p "$port" ping 2>/dev/null | grep -q PONG; then
            break
        fi
        sleep 0.05
    done
    if ! "$cli" -h 127.0.0.1 -p "$port" ping 2>/dev/null | grep -q PONG; then
        echo "with_redis_cluster: $server on port $port did not answer; its log:" >&2
        cat "$dir/$port/server.log" >&2 || true
        exit 1
    fi
done

nodes=()
for port in "${ports[@]}"; do
    nodes+=("127.0.0.1:$port")
done
if ! "$cli" --cluster create "${nodes[@]}" --cluster-replicas 1 --cluster-yes >"$dir/create.log" 2>&1; then
    echo "with_redis_cluster: $cli --cluster create failed:" >&2
    cat "$dir/create.log" >&2
    exit 1
fi

for port in "${ports[@]}"; do
    for _ in $(seq 1 200); do
        if "$cli" -h 127.0.0.1 -p "$port" cluster info 2>/dev/null | grep -q 'cluster_state:ok'; then
            break
        fi
        sleep 0.05
    done
    if ! "$cli" -h 127.0.0.1 -p "$port" cluster info 2>/dev/null | grep -q 'cluster_state:ok'; then
        echo "with_redis_cluster: node $port never reported cluster_state:ok" >&2
        exit 1
    fi
done

urls=()
for port in "${ports[@]}"; do
    urls+=("redis://127.0.0.1:$port")
done
KVOFFLOAD_TEST_REDIS_CLUSTER_URLS="$(IFS=,; echo "${urls[*]}")"
export KVOFFLOAD_TEST_REDIS_CLUSTER_URLS
echo "with_redis_cluster: $server cluster (pids ${pids[*]}) at $KVOFFLOAD_TEST_REDIS_CLUSTER_URLS" >&2
set +e
"$@"
status=$?
set -e
exit "$status"
