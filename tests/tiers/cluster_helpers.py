"""Real Redis Cluster (or Valkey cluster) processes of a test's own, on loopback ports.

`RedisClusterProcs` does in Python what scripts/with_redis_cluster.sh does in bash, so a
test may SIGKILL or SIGSTOP its own nodes without disturbing the shared cluster.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tier_helpers import REDIS_SERVER_ENV, redis_missing

CLUSTER_URLS_ENV = "KVOFFLOAD_TEST_REDIS_CLUSTER_URLS"


def free_cluster_ports(n: int) -> list[int]:
    """``n`` loopback ports free now whose cluster bus ports (port + 10000) are free too."""
    ports: list[int] = []
    while len(ports) < n:
        port = random.randrange(20000, 45000)
        if any(abs(port - p) in (0, 10000) for p in ports):
            continue
        try:
            for p in (port, port + 10000):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        ports.append(port)
    return ports


def command(port: int, *args: str, timeout: float = 2.0) -> bytes:
    """One command to a node over a raw socket (RESP); the reply's raw bytes."""
    parts = [f"*{len(args)}\r\n".encode()]
    for a in args:
        b = a.encode()
        parts.append(b"$%d\r\n%s\r\n" % (len(b), b))
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(b"".join(parts))
        data = b""
        s.settimeout(timeout)
        while True:
            chunk = s.recv(65536)
            data += chunk
            if not chunk or _complete(data):
                return data


def _complete(data: bytes) -> bool:
    if data[:1] in (b"+", b"-", b":"):
        return data.endswith(b"\r\n")
    if data[:1] == b"$":
        head, _, rest = data.partition(b"\r\n")
        size = int(head[1:])
        return size < 0 or len(rest) >= size + 2
    return True


@dataclass
class Node:
    port: int
    proc: subprocess.Popen[bytes] | None
    dir: Path

    @property
    def name(self) -> str:
        return f"127.0.0.1:{self.port}"


class RedisClusterProcs:
    """Six nodes (three primaries, a replica each) of the test's own.

    Args:
        node_timeout_ms: ``cluster-node-timeout`` (how soon a dead primary fails over).
        full_coverage: ``cluster-require-full-coverage``.
    """

    def __init__(self, *, node_timeout_ms: int = 1000, full_coverage: bool = True) -> None:
        name = os.environ.get(REDIS_SERVER_ENV, "redis-server")
        binary = shutil.which(name)
        cli = shutil.which(name.replace("-server", "-cli"))
        if binary is None or cli is None:
            redis_missing(f"{name} (and its cli) is not installed")
        self.binary = str(binary)
        self.cli = str(cli)
        self.node_timeout_ms = node_timeout_ms
        self.full_coverage = full_coverage
        self.root = Path(tempfile.mkdtemp(prefix="kvoffload-cluster-"))
        self.nodes: dict[int, Node] = {}

    @property
    def urls(self) -> list[str]:
        return [f"redis://127.0.0.1:{port}" for port in self.nodes]

    def _spawn(self, node: Node) -> None:
        node.proc = subprocess.Popen(
            [
                self.binary,
                "--bind", "127.0.0.1",
                "--port", str(node.port),
                "--save", "",
                "--appendonly", "no",
                "--cluster-enabled", "yes",
                "--cluster-config-file", str(node.dir / "nodes.conf"),
                "--cluster-node-timeout", str(self.node_timeout_ms),
                "--repl-diskless-sync-delay", "0",
                "--cluster-require-full-coverage", "yes" if self.full_coverage else "no",
                "--dir", str(node.dir),
                "--logfile", str(node.dir / "server.log"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip

    def start(self) -> None:
        for port in free_cluster_ports(6):
            node = Node(port, None, self.root / str(port))
            node.dir.mkdir()
            self.nodes[port] = node
            self._spawn(node)
        for port in self.nodes:
            self._wait_ping(port)
        create = subprocess.run(
            [
                self.cli, "--cluster", "create",
                *(n.name for n in self.nodes.values()),
                "--cluster-replicas", "1", "--cluster-yes",
            ],
            capture_output=True,
            check=False,
            timeout=60,
        )  # fmt: skip
        if create.returncode != 0:
            raise RuntimeError(f"cluster create failed: {create.stdout!r} {create.stderr!r}")
        self.wait_ok()
        self.wait_replicas_synced()
        self.wait_topology_known()

    def wait_topology_known(self, deadline_s: float = 30.0) -> None:
        """Poll until every node knows three primaries with slots and three replicas (so a
        client's slot map, from any node, names every replica)."""
        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            if all(self._knows_all(p) for p in self.live_ports()):
                return
            time.sleep(0.05)
        raise RuntimeError("the nodes did not agree on the topology")

    def _knows_all(self, port: int) -> bool:
        rows = self.cluster_nodes(port)
        primaries = [r for r in rows if "master" in r[2] and len(r) > 8]
        replicas = [r for r in rows if "slave" in r[2] and r[3] != "-"]
        return len(primaries) == 3 and len(replicas) == 3

    def _wait_ping(self, port: int, deadline_s: float = 10.0) -> None:
        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            try:
                if command(port, "PING", timeout=0.2).startswith(b"+PONG"):
                    return
            except OSError:
                time.sleep(0.02)
        raise RuntimeError(f"node {port} did not start")

    def info(self, port: int, section: str) -> dict[str, str]:
        raw = (
            command(port, "CLUSTER", "INFO")
            if section == "cluster"
            else command(port, "INFO", section)
        )
        text = raw.split(b"\r\n", 1)[1].decode(errors="replace")
        out: dict[str, str] = {}
        for line in text.splitlines():
            if ":" in line and not line.startswith("#"):
                k, _, v = line.partition(":")
                out[k] = v.strip()
        return out

    def cluster_nodes(self, port: int) -> list[list[str]]:
        raw = command(port, "CLUSTER", "NODES")
        text = raw.split(b"\r\n", 1)[1].decode()
        return [line.split() for line in text.splitlines() if line.strip()]

    def live_ports(self) -> list[int]:
        return [p for p, n in self.nodes.items() if n.proc is not None]

    def primaries(self) -> list[int]:
        """Ports of the live primaries that own slots, as a live node sees them."""
        for port in self.live_ports():
            try:
                rows = self.cluster_nodes(port)
            except OSError:
                continue
            return [
                int(r[1].split("@")[0].rsplit(":", 1)[1])
                for r in rows
                if "master" in r[2] and "fail" not in r[2] and len(r) > 8
            ]
        raise RuntimeError("no live node")

    def replica_of(self, primary: int) -> int:
        rows = self.cluster_nodes(primary)
        mine = next(r[0] for r in rows if "myself" in r[2])
        return next(int(r[1].split("@")[0].rsplit(":", 1)[1]) for r in rows if r[3] == mine)

    def state_ok(self) -> bool:
        for port in self.live_ports():
            try:
                if self.info(port, "cluster").get("cluster_state") != "ok":
                    return False
            except OSError:
                return False
        return True

    def wait_ok(self, deadline_s: float = 30.0) -> None:
        """Poll (bounded) until every live node reports ``cluster_state:ok``."""
        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            if self.state_ok():
                return
            time.sleep(0.05)
        raise RuntimeError("the cluster did not reach cluster_state:ok")

    def wait_promoted(self, port: int, deadline_s: float = 30.0) -> None:
        """Poll (bounded) until node ``port`` calls itself a primary that owns slots (a
        killed primary's failure is noticed only after the node timeout: until then the
        cluster still reports ``ok``)."""
        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            me = next(r for r in self.cluster_nodes(port) if "myself" in r[2])
            if "master" in me[2] and len(me) > 8:
                return
            time.sleep(0.05)
        raise RuntimeError(f"node {port} was not promoted")

    def wait_replicas_synced(self, deadline_s: float = 30.0) -> None:
        """Poll until every primary has a replica whose link is up and offset caught up."""
        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            if all(self._synced(p) for p in self.primaries()):
                return
            time.sleep(0.05)
        raise RuntimeError("replicas did not sync")

    def _synced(self, primary: int) -> bool:
        info = self.info(primary, "replication")
        offset = int(info.get("master_repl_offset", "0"))
        replica = info.get("slave0", "")
        fields = dict(kv.split("=", 1) for kv in replica.split(",") if "=" in kv)
        return fields.get("state") == "online" and int(fields.get("offset", "-1")) >= offset

    def kill(self, port: int) -> None:
        """SIGKILL a node (no shutdown, no save)."""
        node = self.nodes[port]
        assert node.proc is not None
        node.proc.send_signal(signal.SIGKILL)
        node.proc.wait(timeout=10)
        node.proc = None

    def restart(self, port: int) -> None:
        """Start a killed node again (same port and node id, empty: persistence is off)."""
        node = self.nodes[port]
        assert node.proc is None
        self._spawn(node)
        self._wait_ping(port)

    def pause(self, port: int) -> None:
        proc = self.nodes[port].proc
        assert proc is not None
        proc.send_signal(signal.SIGSTOP)

    def resume(self, port: int) -> None:
        proc = self.nodes[port].proc
        assert proc is not None
        proc.send_signal(signal.SIGCONT)

    def close(self) -> None:
        for node in self.nodes.values():
            if node.proc is not None:
                node.proc.send_signal(signal.SIGCONT)
                node.proc.terminate()
        for node in self.nodes.values():
            if node.proc is not None:
                try:
                    node.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    node.proc.kill()
                    node.proc.wait(timeout=10)
                node.proc = None
        shutil.rmtree(self.root, ignore_errors=True)
