"""A toy engine over CPU KV tensors, and real redis-server processes, for the tier tests."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import anyio
import pytest
import torch

from kvoffload.config import KVLayout, OffloadConfig
from kvoffload.hashing import BlockHash
from kvoffload.offloader import KVOffloader
from kvoffload.tiers.stats import TierStatistics

BS = 4
NUM_GPU_BLOCKS = 32
REDIS_URL_ENV = "KVOFFLOAD_TEST_REDIS_URL"
# The server binary (redis-server, or valkey-server) for the shared server that
# scripts/with_redis.sh starts and for the tests' own servers.
REDIS_SERVER_ENV = "KVOFFLOAD_TEST_REDIS_SERVER"


def layout(head_size: int = 8) -> KVLayout:
    """Two layers of float32 KV: 1 KiB blocks by default, 8 KiB with ``head_size=64``."""
    return KVLayout(
        num_layers=2, num_kv_heads=2, head_size=head_size, dtype="float32", block_size=BS
    )


def make_kv(head_size: int = 8, num_blocks: int = NUM_GPU_BLOCKS) -> list[torch.Tensor]:
    """Zeroed GPU-side KV tensors (on CPU)."""
    lay = layout(head_size)
    return [torch.zeros(lay.tensor_shape(num_blocks)) for _ in range(lay.num_layers)]


def expected_block(block_hash: BlockHash, kv: Sequence[torch.Tensor]) -> torch.Tensor:
    """The KV the toy engine computes for a block: a function of its hash only."""
    gen = torch.Generator().manual_seed(int.from_bytes(block_hash[:8], "little") >> 1)
    return torch.randn((len(kv), *kv[0].shape[1:]), generator=gen)


def block_kv(kv: Sequence[torch.Tensor], gpu_block: int) -> torch.Tensor:
    return torch.stack([t[gpu_block] for t in kv])


def tokens(prompt: int, num_blocks: int) -> list[int]:
    """A prompt of ``num_blocks`` full blocks plus one token (so every block is loadable)."""
    return [prompt * 100_000 + i for i in range(num_blocks * BS + 1)]


def config(tiers: list[dict[str, object]], **overrides: object) -> OffloadConfig:
    values: dict[str, object] = {"block_size": BS, "num_cpu_blocks": 16, "tiers": tiers}
    values.update(overrides)
    return OffloadConfig(**values)


async def compute_and_store(
    off: KVOffloader,
    kv: list[torch.Tensor],
    request_id: str,
    prompt: list[int],
    gpu_ids: Sequence[int],
) -> list[BlockHash]:
    """Compute a prompt's blocks into ``gpu_ids``, store them on CPU and finish."""
    hashes = off.hash_prompt(prompt)
    for i, block_hash in enumerate(hashes):
        want = expected_block(block_hash, kv)
        for layer, t in enumerate(kv):
            t[gpu_ids[i]] = want[layer]
    off.update(request_id, list(gpu_ids), hashes, len(hashes) * BS)
    for task in off.store():
        await task
    off.finish(request_id)
    return hashes


async def lookup_load(
    off: KVOffloader,
    kv: list[torch.Tensor],
    request_id: str,
    prompt: list[int],
    gpu_ids: Sequence[int],
    *,
    allow_defer: bool = True,
    deadline_s: float = 10.0,
) -> int:
    """Look a prompt up (asking again while deferred), load the hit and check it bit-exact.

    Returns:
        The loaded tokens.
    """
    hashes = off.hash_prompt(prompt)
    hit = None
    with anyio.fail_after(deadline_s):
        while True:
            hit = off.lookup(request_id, hashes, len(prompt), allow_defer=allow_defer)
            if hit is not None:
                break
            await anyio.sleep(0.005)
    for gpu in gpu_ids:
        for t in kv:
            t[gpu] = float("nan")
    task = off.load(request_id, list(gpu_ids), hit)
    if task is not None:
        await task
    for i in range(hit // BS):
        assert torch.equal(block_kv(kv, gpu_ids[i]), expected_block(hashes[i], kv)), i
    off.finish(request_id)
    return hit


def tier_stats(off: KVOffloader, index: int = 0) -> TierStatistics:
    stats = off.statistics().tiers
    assert stats is not None
    return stats.tiers[index]


async def wait_until(predicate: Callable[[], bool], deadline_s: float = 10.0) -> None:
    with anyio.fail_after(deadline_s):
        while not predicate():
            await anyio.sleep(0.005)


async def settle(off: KVOffloader) -> None:
    """Wait for every store, write-down and promotion to end."""
    await off.drain()
    tiers = off.tiers
    assert tiers is not None
    await wait_until(
        lambda: tiers.statistics().refs_held == 0 and tiers.statistics().promotions_in_flight == 0
    )


def check(off: KVOffloader) -> None:
    off.scheduler.check_invariants()
    if off.tiers is not None:
        off.tiers.check_invariants()


# -- redis -------------------------------------------------------------------------------


def redis_missing(what: str) -> None:
    """Fail under CI (it must provide Redis), skip elsewhere."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"{what}: CI must run the tests under scripts/with_redis.sh")
    pytest.skip(what)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    """A redis-server process of the test's own on a free loopback port, persistence off."""

    def __init__(self, *args: str, unix_socket: bool = False) -> None:
        """``args``: more server options (``--requirepass``, ``--proto-max-bulk-len`` ...);
        ``unix_socket``: listen on a socket in the server's directory, no TCP port."""
        name = os.environ.get(REDIS_SERVER_ENV, "redis-server")
        binary = shutil.which(name)
        if binary is None:
            redis_missing(f"{name} is not installed")
        self.binary = str(binary)
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="kvoffload-redis-"))
        self.proc: subprocess.Popen[bytes] | None = None
        self.args = args
        self.socket = self.dir / "redis.sock" if unix_socket else None

    @property
    def url(self) -> str:
        if self.socket is not None:
            return f"unix://{self.socket}?db=0"
        return f"redis://127.0.0.1:{self.port}/0"

    def _answers(self) -> bool:
        family = socket.AF_UNIX if self.socket is not None else socket.AF_INET
        address = str(self.socket) if self.socket is not None else ("127.0.0.1", self.port)
        with socket.socket(family) as s:
            s.settimeout(0.2)
            s.connect(address)
            s.sendall(b"PING\r\n")
            reply = s.recv(64)
        # A server with a password answers NOAUTH: it is up all the same.
        return reply.startswith((b"+PONG", b"-NOAUTH"))

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                self.binary,
                "--bind", "127.0.0.1",
                "--port", "0" if self.socket is not None else str(self.port),
                *(("--unixsocket", str(self.socket)) if self.socket is not None else ()),
                "--save", "",
                "--appendonly", "no",
                "--dir", str(self.dir),
                *self.args,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                if self._answers():
                    return
            except OSError:
                pass
            time.sleep(0.02)
        raise RuntimeError(f"redis-server at {self.url} did not start")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            self.proc.wait(timeout=10)
            self.proc = None

    def pause(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


def patch_file(path: Path, offset: int, change: Callable[[bytes], bytes], size: int = 1) -> None:
    """Replace ``size`` bytes at ``offset`` of a file by ``change(old)`` (real corruption)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        old = f.read(size)
        f.seek(offset)
        f.write(change(old))
