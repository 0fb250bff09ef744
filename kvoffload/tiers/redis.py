"""`RedisTier`: one key per block on a Redis or Valkey server (``kvoffload[redis]``).

A block is one value: the 96-byte header (format version, namespace digest, block hash,
payload length, checksum) followed by the payload, written with a single ``SET`` so a
reader sees the whole old value or the whole new one, never half a block. Keys are
``<key_prefix><namespace digest, 16 hex>:<block hash, 64 hex>``; several blocks move in one
pipeline. Expiry is ``ttl_s`` or the server's ``maxmemory`` policy; a missing key is a
miss. Runs on asyncio (``redis.asyncio`` with the hiredis parser).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any, final

try:
    import redis.asyncio as aioredis
    from redis.backoff import NoBackoff
    from redis.retry import Retry
except ImportError as exc:  # pragma: no cover - exercised without the extra
    raise ImportError(
        "kvoffload.tiers.redis needs the redis extra: pip install 'kvoffload[redis]'"
    ) from exc

from kvoffload.errors import TierError
from kvoffload.hashing import BlockHash
from kvoffload.tiers._redis_values import make_key_prefix, pack_values, redact, unpack_values
from kvoffload.tiers._threads import IoThreads
from kvoffload.tiers.base import BlockRead, BlockWrite

__all__ = ["RedisTier"]


@final
class RedisTier:
    """A `SecondaryTier` on a Redis 7 or Valkey server.

    Args:
        url: ``redis://host:port/db`` (``rediss://`` and ``unix://`` too).
        block_nbytes: size of one block's payload.
        namespace: the 32-byte namespace digest (part of every key).
        key_prefix: prefix of every key.
        ttl_s: expiry of each key in seconds (``None``: none).
        max_connections: connections in the pool (one per operation in flight).
        name: the name in statistics and logs.
    """

    def __init__(
        self,
        url: str,
        *,
        block_nbytes: int,
        namespace: bytes,
        key_prefix: str = "kvoffload:",
        ttl_s: int | None = None,
        max_connections: int = 8,
        name: str = "redis",
    ) -> None:
        self._url = url
        self._nbytes = block_nbytes
        self._prefix = make_key_prefix(key_prefix, namespace)
        self._ttl = ttl_s
        self._max_connections = max_connections
        self._name = name
        self._client: aioredis.Redis | None = None
        # Values are built and unpacked (copies and checksums) in these threads.
        self._threads = IoThreads(max_connections, f"kvoffload-redis-{name}")
        self._closed = False

    def __repr__(self) -> str:
        return f"RedisTier(name={self._name!r}, url={redact(self._url)!r})"

    @property
    def name(self) -> str:
        """The tier's name."""
        return self._name

    def key(self, block_hash: BlockHash) -> bytes:
        """The key a block is stored under."""
        return self._prefix + block_hash.hex().encode()

    def _get_client(self) -> aioredis.Redis:
        if self._client is None:
            raise TierError(f"redis tier {self._name!r} is not open")
        return self._client

    async def open(self) -> None:
        """Create the connection pool and check the server answers.

        Raises:
            TierError: the URL is invalid, or the event loop is not asyncio's (trio).
                Connection errors propagate (the manager marks the tier unhealthy and
                retries).
        """
        try:
            asyncio.get_running_loop()
        except RuntimeError as exc:
            raise TierError(
                f"redis tier {self._name!r} runs on asyncio only (redis.asyncio); this event "
                "loop is not asyncio's"
            ) from exc
        if self._client is None:
            try:
                pool = aioredis.BlockingConnectionPool.from_url(
                    self._url,
                    max_connections=self._max_connections + 1,
                    retry=Retry(NoBackoff(), 0),
                    socket_keepalive=True,
                )
            except ValueError as exc:
                raise TierError(f"redis tier {self._name!r}: bad url: {exc}") from exc
            self._client = aioredis.Redis(connection_pool=pool)
        await self.ping()

    async def ping(self) -> None:
        """Send ``PING``."""
        await self._get_client().ping()

    async def exists(self, block_hashes: Sequence[BlockHash]) -> int:
        """The leading run of ``block_hashes`` whose keys exist (one pipelined round trip)."""
        if not block_hashes:
            return 0
        async with self._get_client().pipeline(transaction=False) as pipe:
            for block_hash in block_hashes:
                pipe.exists(self.key(block_hash))
            found: list[Any] = await pipe.execute()
        n = 0
        for present in found:
            if not present:
                break
            n += 1
        return n

    async def put(self, blocks: Sequence[BlockWrite]) -> int:
        """``SET`` each block (header and payload as one value) in one pipeline.

        Returns:
            Blocks the server acknowledged.
        """
        if not blocks:
            return 0
        client = self._get_client()
        values = await self._threads.run(pack_values, blocks)
        async with client.pipeline(transaction=False) as pipe:
            for block, value in zip(blocks, values, strict=True):
                pipe.set(self.key(block.block_hash), value, ex=self._ttl)
            acks: list[Any] = await pipe.execute()
        return sum(1 for ack in acks if ack)

    async def get(
        self, block_hashes: Sequence[BlockHash], into: Sequence[memoryview]
    ) -> list[BlockRead | None]:
        """``GET`` blocks in one pipeline and copy their payloads into ``into``.

        A value shorter or longer than a block is delivered as it is (the caller's check
        rejects it); a missing key is ``None``.
        """
        if len(block_hashes) != len(into):
            raise ValueError(f"{len(block_hashes)} hashes but {len(into)} buffers")
        if not block_hashes:
            return []
        async with self._get_client().pipeline(transaction=False) as pipe:
            for block_hash in block_hashes:
                pipe.get(self.key(block_hash))
            values: list[bytes | None] = await pipe.execute()

        return await self._threads.run(unpack_values, values, into)

    async def delete(self, block_hashes: Sequence[BlockHash]) -> None:
        """``DEL`` the blocks' keys."""
        if block_hashes:
            await self._get_client().delete(*(self.key(h) for h in block_hashes))

    async def close(self) -> None:
        """Close the connection pool. Idempotent."""
        if self._closed:
            return
        self._closed = True
        client, self._client = self._client, None
        self._threads.shutdown()
        if client is not None:
            await client.aclose(close_connection_pool=True)

    def statistics(self) -> Mapping[str, int | float | str | bool]:
        """The server URL (password hidden), key prefix and expiry."""
        return {
            "url": redact(self._url),
            "key_prefix": self._prefix.decode(),
            "ttl_s": self._ttl or 0,
        }
