"""`RedisTier`: one key per block on a Redis or Valkey server (the ``redis`` extra).

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
from urllib.parse import urlsplit

from kvoffload._extras import needs_extra

try:
    import redis.asyncio as aioredis
    from redis.backoff import NoBackoff
    from redis.retry import Retry
except ImportError as exc:  # pragma: no cover - exercised without the extra
    raise ImportError(needs_extra("kvoffload.tiers.redis", "redis")) from exc

from kvoffload._logging import get_logger
from kvoffload.config import redact_url
from kvoffload.errors import TierError
from kvoffload.hashing import BlockHash
from kvoffload.tiers._redis_values import (
    make_key_prefix,
    pack_values,
    sort_replies,
    unpack_values,
)
from kvoffload.tiers._threads import IoThreads
from kvoffload.tiers.base import BlockRead, BlockWrite
from kvoffload.tiers.format import HEADER_SIZE

__all__ = ["RedisTier"]

_log = get_logger("tiers.redis")

_MIN_BULK_LIMIT = 1 << 20
"""The smallest ``proto-max-bulk-len`` a server accepts: smaller values never hit it."""


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
        self._value_nbytes = HEADER_SIZE + block_nbytes
        self._bulk_limit: int | None = None  # the server's proto-max-bulk-len, when known
        self._write_refused = ""  # why the server refuses every write (reads still work)
        self._bad_replies = 0
        self._answered = True  # the server answered the last ping

    def __repr__(self) -> str:
        return f"RedisTier(name={self._name!r}, url={redact_url(self._url)!r})"

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
            options: dict[str, Any] = {}
            if urlsplit(self._url).scheme != "unix":
                options["socket_keepalive"] = True  # a Unix socket connection takes none
            try:
                pool = aioredis.BlockingConnectionPool.from_url(
                    self._url,
                    max_connections=self._max_connections + 1,
                    retry=Retry(NoBackoff(), 0),
                    **options,
                )
            except ValueError as exc:
                raise TierError(
                    f"redis tier {self._name!r}: bad url {redact_url(self._url)!r}: {exc}"
                ) from exc
            self._client = aioredis.Redis(connection_pool=pool)
        await self._get_client().ping()
        await self._check_bulk_limit()

    async def _check_bulk_limit(self) -> None:
        """Read the server's ``proto-max-bulk-len`` and refuse to start when one block's
        value exceeds it (the server would drop the connection on every write)."""
        try:
            reply: Mapping[Any, Any] = await self._get_client().config_get("proto-max-bulk-len")
        except aioredis.ResponseError as exc:  # CONFIG refused or renamed: learn it on a write
            _log.debug("redis_config_refused", tier=self._name, error=str(exc))
            return
        # Keys and values are bytes (no decode_responses); str keys where decoding is on.
        raw = reply.get(b"proto-max-bulk-len", reply.get("proto-max-bulk-len"))
        if raw is None:
            return
        raw = raw.decode() if isinstance(raw, bytes) else str(raw)
        self._bulk_limit = int(raw)
        if self._value_nbytes > self._bulk_limit:
            raise TierError(self._too_large(f"the server's proto-max-bulk-len is {raw}"))

    def _too_large(self, why: str) -> str:
        return (
            f"redis tier {self._name!r}: a block is stored as one value of "
            f"{self._value_nbytes} bytes ({self._nbytes} of KV and a {HEADER_SIZE}-byte "
            f"header), but {why}: the server refuses every write. Raise the server's "
            f"proto-max-bulk-len to at least {self._value_nbytes} (then restart the "
            "offloader) or use smaller blocks"
        )

    async def ping(self) -> None:
        """Send ``PING``; check again that a block fits in the server's value limit.

        Raises:
            TierError: the server refused a write because a block is larger than its
                ``proto-max-bulk-len`` (see `reads_ok()`).
        """
        self._answered = False
        await self._get_client().ping()
        self._answered = True
        if self._write_refused:  # it answers: reads work, writes do not
            raise TierError(self._write_refused)
        if self._bulk_limit is not None and self._value_nbytes > self._bulk_limit:
            await self._check_bulk_limit()

    def reads_ok(self) -> bool:
        """Whether only writes fail: the server refuses values of a block's size (its
        ``proto-max-bulk-len`` is smaller) and answered the last `ping()`."""
        return bool(self._write_refused) and self._answered

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
        try:
            async with client.pipeline(transaction=False) as pipe:
                for block, value in zip(blocks, values, strict=True):
                    pipe.set(self.key(block.block_hash), value, ex=self._ttl)
                acks: list[Any] = await pipe.execute()
        except (aioredis.ConnectionError, aioredis.ResponseError) as exc:
            await self._check_refused(exc)
            raise
        return sum(1 for ack in acks if ack)

    async def _check_refused(self, exc: Exception) -> None:
        """A write failed: when the value may exceed the server's bulk limit (unknown:
        CONFIG is refused) and the server still answers, it refused the value's size."""
        if self._bulk_limit is not None or self._value_nbytes <= _MIN_BULK_LIMIT:
            return
        if "bulk length" not in str(exc):  # the server said why ("invalid bulk length")
            # Or it just closed the connection: it refused the value if it answers PING
            # (twice: the first may take a connection it closed).
            for attempt in range(2):
                try:
                    await self._get_client().ping()
                    break
                except Exception:
                    if attempt:
                        return  # the server is down, not refusing our values
        self._write_refused = self._too_large(
            f"the server refused a write of it ({type(exc).__name__}: {exc}) and still "
            f"answers: its proto-max-bulk-len is below {self._value_nbytes} (CONFIG is "
            "refused, so the limit could not be read at start-up)"
        )
        _log.error("redis_write_refused", tier=self._name, error=self._write_refused)
        raise TierError(self._write_refused) from exc

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
        client = self._get_client()
        keys = [self.key(h) for h in block_hashes]
        async with client.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.get(key)
            # An error reply (a key of another type: WRONGTYPE) is that key's miss alone.
            replies: list[Any] = await pipe.execute(raise_on_error=False)
        values, bad = sort_replies(self._name, keys, replies)
        if bad:
            self._bad_replies += len(bad)
            try:
                await client.delete(*(keys[p] for p in bad))
            except aioredis.RedisError as exc:  # the next read finds it again
                _log.warning("redis_bad_key_not_deleted", tier=self._name, error=repr(exc))
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
        """The server URL (password hidden), key prefix, expiry, the keys whose reply was
        an error (``bad_replies``: a key of another type; each was a miss and deleted), and
        the server's value limit (``proto_max_bulk_len``, 0 when unknown)."""
        return {
            "url": redact_url(self._url),
            "key_prefix": self._prefix.decode(),
            "ttl_s": self._ttl or 0,
            "bad_replies": self._bad_replies,
            "proto_max_bulk_len": self._bulk_limit or 0,
            "write_refused": self._write_refused,
        }
