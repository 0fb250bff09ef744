"""Fixtures of the vLLM integration tests. vLLM must import: a missing vLLM fails here."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

# One process: the engine core and the worker run in the test process, so a connector
# class defined in this directory is importable by module path and started quickly.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import pytest
import vllm  # noqa: F401  - a missing vLLM is an error, never a skip
from harness import write_tiny_llama
from redis_cluster import RedisClusterProcs, redis_cluster


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama: only a config.json, random weights."""
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture
def own_redis_cluster() -> Iterator[RedisClusterProcs]:
    """A six-node Redis Cluster of this test's own on loopback (3 primaries, 3 replicas),
    ready (``cluster_state:ok``); every node stopped by its pid after the test. Skips
    without redis-server, its cli or the redis extra; fails instead under ``CI=true``."""
    with redis_cluster() as cluster:
        yield cluster
