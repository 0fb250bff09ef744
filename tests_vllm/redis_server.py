"""A redis-server of the test's own on a free loopback port, to pause with SIGSTOP."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from types import TracebackType

import pytest

__all__ = ["RedisServer", "require_redis_client", "server_missing"]


def server_missing(what: str) -> None:
    """Skip without a Redis server; in CI (whose scripts/test.sh installs redis-server and
    valkey-server) fail instead."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"{what}: CI installs redis-server (scripts/test.sh)")
    pytest.skip(what)


def require_redis_client() -> None:
    """Skip without the ``redis`` extra; in CI (which installs it) fail instead."""
    try:
        import redis  # noqa: F401, PLC0415
    except ImportError:
        if os.environ.get("CI") == "true":
            pytest.fail("CI installs the redis extra into the vLLM environment")
        pytest.skip("the redis extra is not installed (pip install '.[redis]')")


class RedisServer:
    """redis-server (or valkey-server) on 127.0.0.1 and a free port, without persistence.

    `close()` (or leaving the ``with`` block) resumes a paused server, stops it by its pid
    and removes its directory, whatever happened.
    """

    def __init__(self) -> None:
        binary = shutil.which("redis-server") or shutil.which("valkey-server")
        if binary is None:
            server_missing("no redis-server (nor valkey-server) on PATH")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port: int = s.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.dir = tempfile.mkdtemp(prefix="kvoffload-vllm-redis-")
        self.proc = subprocess.Popen(
            [binary, "--bind", "127.0.0.1", "--port", str(self.port), "--save", "",
             "--appendonly", "no", "--dir", self.dir],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        end = time.monotonic() + 10
        while time.monotonic() < end:
            try:
                with socket.create_connection(("127.0.0.1", self.port), 0.2) as c:
                    c.sendall(b"PING\r\n")
                    if c.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.02)
        self.close()
        raise RuntimeError("redis-server did not start")

    def pause(self) -> None:
        """SIGSTOP: connections stay open, nothing answers."""
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT."""
        self.proc.send_signal(signal.SIGCONT)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.resume()
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
