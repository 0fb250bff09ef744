"""A six-node Redis Cluster of the test's own on loopback, to pause one node with SIGSTOP.

The processes are those of the tier tests (``tests/tiers/cluster_helpers.py``,
`RedisClusterProcs`: three primaries with a replica each, on free ports whose bus ports are
free too, every node stopped by its pid); this module adds what the engine tests need: the
primary that holds a key, and this suite's rule for a missing server (a skip on a
developer's machine, a failure under ``CI=true``).
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1] / "tests" / "tiers"))

from cluster_helpers import RedisClusterProcs, command
from redis_server import require_redis_client, server_missing

__all__ = ["RedisClusterProcs", "owner_of", "redis_cluster"]

# No failover while a test pauses a primary: a replica promoted during the pause would
# serve the paused primary's keys.
NODE_TIMEOUT_MS = 60_000


@contextmanager
def redis_cluster() -> Iterator[RedisClusterProcs]:
    """Start a cluster (``KVOFFLOAD_TEST_REDIS_SERVER``: redis-server, the default, or
    valkey-server), wait until every node reports ``cluster_state:ok`` with its replica in
    sync, yield it, and stop every node by its pid (resumed first if paused), whatever
    happened."""
    require_redis_client()
    server = os.environ.get("KVOFFLOAD_TEST_REDIS_SERVER", "redis-server")
    for binary in (server, server.replace("-server", "-cli")):
        if shutil.which(binary) is None:
            server_missing(f"{binary} is not on PATH (a cluster needs the server and its cli)")
    cluster = RedisClusterProcs(node_timeout_ms=NODE_TIMEOUT_MS)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.close()


def owner_of(cluster: RedisClusterProcs, key: bytes) -> int | None:
    """The port of the primary that holds ``key`` now (``None``: no primary has it)."""
    for port in cluster.primaries():
        if command(port, "EXISTS", key.decode()) == b":1\r\n":
            return port
    return None
