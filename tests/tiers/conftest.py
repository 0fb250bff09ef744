from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pytest
from cluster_helpers import CLUSTER_URLS_ENV, RedisClusterProcs
from tier_helpers import REDIS_URL_ENV, RedisServer, redis_missing


def _need_client() -> None:
    try:
        import redis.asyncio  # noqa: F401, PLC0415
    except ImportError:
        redis_missing(
            "the redis package is not installed (from a kvoffload clone: pip install '.[redis]')"
        )


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def redis_url() -> str:
    """The shared server that scripts/with_redis.sh started (CI fails without one)."""
    url = os.environ.get(REDIS_URL_ENV)
    if not url:
        redis_missing(f"{REDIS_URL_ENV} is not set")
    _need_client()
    return str(url)


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    """A redis-server of this test's own, started, that the test may stop and restart."""
    _need_client()
    server = RedisServer()
    server.start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def start_redis() -> Iterator[Callable[..., RedisServer]]:
    """Start redis-servers of this test's own with more options (stopped at the end):
    ``start_redis("--requirepass", "pw")``, ``start_redis(unix_socket=True)``."""
    _need_client()
    servers: list[RedisServer] = []

    def start(*args: str, unix_socket: bool = False) -> RedisServer:
        server = RedisServer(*args, unix_socket=unix_socket)
        servers.append(server)
        server.start()
        return server

    try:
        yield start
    finally:
        for server in servers:
            server.close()


@pytest.fixture
def redis_cluster_urls() -> list[str]:
    """The shared cluster that scripts/with_redis_cluster.sh started (CI fails without one)."""
    urls = os.environ.get(CLUSTER_URLS_ENV)
    if not urls:
        redis_missing(f"{CLUSTER_URLS_ENV} is not set (run under scripts/with_redis_cluster.sh)")
    _need_client()
    return str(urls).split(",")


@pytest.fixture
def own_cluster_factory() -> Iterator[Callable[..., RedisClusterProcs]]:
    """Starts six-node clusters of this test's own, which it may kill or pause; stops them."""
    _need_client()
    made: list[RedisClusterProcs] = []

    def make(**kw: object) -> RedisClusterProcs:
        cluster = RedisClusterProcs(**kw)  # type: ignore[arg-type]
        made.append(cluster)
        cluster.start()
        return cluster

    try:
        yield make
    finally:
        for cluster in made:
            cluster.close()
