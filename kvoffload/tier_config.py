"""Settings of the secondary tiers: the entries of ``OffloadConfig.tiers``.

A tier is chosen by its ``kind``; pydantic picks the model from that field, so an error
names the tier's position, its kind and the field (``tiers.0.disk.capacity_bytes``). In
the environment the whole list is JSON::

    KVOFFLOAD_TIERS='[{"kind": "disk", "path": "/mnt/nvme/kv.bin", "capacity_bytes": "64GiB"}]'

Below `kvoffload.config`, which re-exports every name, and importing nothing of the tiers
themselves: reading the configuration never loads the tier code. URLs that may carry a
password are `SecretUrl`s, masked wherever the settings are printed, dumped or logged.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Literal
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from pydantic import (
    AfterValidator,
    BaseModel,
    ByteSize,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_serializer,
    model_validator,
)

from kvoffload._validation import describe
from kvoffload.errors import ConfigError

__all__ = [
    "AnyTierSettings",
    "DiskTierSettings",
    "RedisClusterTierSettings",
    "RedisTierSettings",
    "SecretUrl",
    "StartupNodeUrl",
    "TierSettings",
    "TierSettingsList",
    "mask_urls",
    "parse_tier_settings",
    "redact_url",
]

_MASK = "***"
_SECRET_PARAMS = frozenset({"password", "pass", "passwd", "secret", "token", "auth"})


def redact_url(url: str) -> str:
    """``url`` with its password (in the user part or a ``password=`` query parameter)
    replaced by ``***``; the rest (scheme, user, host, port, path) kept for diagnostics."""
    try:
        parts = urlsplit(url)
        netloc = parts.netloc
        if "@" in netloc:
            userinfo, _, hostport = netloc.rpartition("@")
            if ":" in userinfo:
                user = userinfo.split(":", 1)[0]
                netloc = f"{user}:{_MASK}@{hostport}"
        query = parts.query
        if query:
            pairs = parse_qsl(query, keep_blank_values=True)
            if any(k.lower() in _SECRET_PARAMS for k, _ in pairs):
                query = urlencode(
                    [(k, _MASK if k.lower() in _SECRET_PARAMS else v) for k, v in pairs],
                    safe="*",
                )
        return urlunsplit(parts._replace(netloc=netloc, query=query))
    except ValueError:
        return _MASK  # unparsable: show nothing of it


def mask_urls(value: object) -> object:
    """``value`` with the password of every URL in it masked (`redact_url`), for errors."""
    if isinstance(value, str):
        return redact_url(value) if "://" in value else value
    if isinstance(value, Mapping):
        return {k: mask_urls(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(mask_urls(v) for v in value)
    return value


class SecretUrl(SecretStr):
    """A URL that may carry a password: printed, dumped and serialised with the password
    masked (`redact_url`); `get_secret_value()` gives the real URL to connect with."""

    def _display(self) -> str:
        return redact_url(self.get_secret_value())


class _TierSettingsBase(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str | None = Field(
        default=None,
        min_length=1,
        max_length=64,
        description="Name in statistics and logs (default: the kind and the position).",
    )
    max_queued_writes: int = Field(
        default=64,
        ge=1,
        le=1 << 16,
        description="Most write-downs queued or in flight; each holds a CPU block. When full, "
        "new write-downs are skipped and counted.",
    )
    max_in_flight: int = Field(
        default=4,
        ge=1,
        le=1024,
        description="Most tier operations running at once; reads always keep one for themselves.",
    )
    max_batch_blocks: int = Field(
        default=16, ge=1, le=4096, description="Most blocks one tier operation moves."
    )
    op_timeout_s: float = Field(
        default=5.0,
        gt=0,
        le=3600,
        description="An operation running longer marks the tier unhealthy.",
    )
    retry_initial_s: float = Field(
        default=0.5, gt=0, le=3600, description="First wait before an unhealthy tier is retried."
    )
    retry_max_s: float = Field(
        default=30.0, gt=0, le=86400, description="Longest wait between retries (backoff cap)."
    )

    @model_validator(mode="after")
    def _retry_order(self) -> _TierSettingsBase:
        if self.retry_max_s < self.retry_initial_s:
            raise ValueError(
                f"retry_max_s={self.retry_max_s} is below retry_initial_s={self.retry_initial_s}"
            )
        return self


class DiskTierSettings(_TierSettingsBase):
    """A `DiskTier`: one preallocated file on a local disk.

    Attributes:
        path: the file (created; its directory must exist).
        capacity_bytes: file size; whole slots of one block (rounded up to 4 KiB) and
            128 bytes of a header page shared by 32 slots (`DiskTier.file_bytes`).
        persist: keep the file on close and reuse its blocks at the next start.
        direct_io: ``auto`` uses ``O_DIRECT`` where the file system and the buffers allow
            it; ``never`` always goes through the page cache.
        preallocate: reserve the file's space at start-up (a full disk fails the open);
            ``False`` makes a sparse file whose writes can fail with ``ENOSPC`` mid-run.
    """

    kind: Literal["disk"] = "disk"
    path: Path = Field(description="The tier's file; its directory must exist.")
    capacity_bytes: ByteSize = Field(
        ge=1 << 20, le=1 << 50, description="File size (e.g. '64GiB'), turned into whole slots."
    )
    persist: bool = Field(
        default=False,
        description="Keep the file on close; rebuild the index from slot headers at start-up.",
    )
    direct_io: Literal["auto", "never"] = Field(
        default="auto", description="Use O_DIRECT where possible (auto) or never."
    )
    preallocate: bool = Field(
        default=True,
        description="Reserve the whole file at start-up (posix_fallocate); false: a sparse "
        "file that takes disk space as blocks are written, so a full disk shows up as "
        "failed writes (ENOSPC) mid-run.",
    )


class RedisTierSettings(_TierSettingsBase):
    """A `RedisTier`: one key per block on a Redis or Valkey server.

    Attributes:
        url: ``redis://host:port/db`` (or ``rediss://``, ``unix:///path/to.sock``), a
            `SecretUrl`: its password is masked in ``repr``, ``str`` and dumps.
        key_prefix: prefix of every key.
        ttl_s: expiry of each key in seconds; ``None`` leaves eviction to ``maxmemory``.
    """

    # A rejected value never shows in an error message: it may hold the password.
    model_config = ConfigDict(frozen=True, extra="forbid", hide_input_in_errors=True)

    kind: Literal["redis"] = "redis"
    url: SecretUrl = Field(
        min_length=1,
        max_length=4096,
        description="Server URL, redis://host:port/db; its password is masked wherever the "
        "settings are printed, dumped or logged (url.get_secret_value() gives it).",
    )
    key_prefix: str = Field(
        default="kvoffload:", max_length=256, description="Prefix of every key this tier writes."
    )
    ttl_s: int | None = Field(
        default=None, ge=1, le=365 * 86400, description="Key expiry in seconds (None: none)."
    )
    max_in_flight: int = Field(
        default=8, ge=1, le=1024, description="Most commands or pipelines running at once."
    )

    @field_serializer("url", when_used="json")
    def _url_json(self, url: SecretUrl) -> str:
        return str(url)  # masked, but still naming the server


def _check_node_url(secret: SecretUrl) -> SecretUrl:
    url = secret.get_secret_value()
    parts = urlsplit(url)
    shown = parts._replace(netloc=parts.hostname or "").geturl()  # never the password
    if parts.scheme not in {"redis", "rediss"}:
        raise ValueError(f"{shown!r}: a cluster node URL is redis://host:port or rediss://")
    try:
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"{shown!r}: bad port ({exc})") from None
    if not parts.hostname or port is None:
        raise ValueError(f"{shown!r}: a cluster node URL names a host and a port")
    if parts.path not in {"", "/", "/0"}:
        raise ValueError(f"{shown!r}: a cluster has only database 0 (path {parts.path!r})")
    return secret


StartupNodeUrl = Annotated[
    SecretUrl,
    Field(min_length=1, max_length=4096, description="redis://[user:password@]host:port"),
    AfterValidator(_check_node_url),
]
"""One startup node of a Redis Cluster: ``redis://[user:password@]host:port`` (or
``rediss://``); database 0 only."""


class RedisClusterTierSettings(_TierSettingsBase):
    """A `RedisClusterTier`: one key per block on a Redis Cluster or a Valkey cluster.

    Attributes:
        startup_nodes: URLs of some nodes; the client learns the others from them.
        key_prefix: prefix of every key.
        ttl_s: expiry of each key in seconds; ``None`` leaves eviction to ``maxmemory``.
        read_from_replicas: read from replicas too (round robin), and from a replica when
            its primary's breaker is open.
        node_timeout_ms: socket connect and read timeout of one node.
        lookup_budget_ms: the longest one lookup operation of the tier (a probe, a read,
            a delete) waits for the nodes; nodes still busy then are misses.
        write_budget_ms: the same for one write-down batch.
        breaker_failures: consecutive failures (errors, timeouts) that open a node's breaker.
        breaker_backoff_ms: wait before an open breaker lets one probe through (doubled
            after each failed probe, up to ``breaker_backoff_max_ms``).
        refresh_interval_ms: the slot map is refreshed at most once per interval.
        max_reads_per_node: read pipelines in flight to one node at once.
        max_writes_per_node: write pipelines in flight to one node; a write-down finding
            them all busy skips that node's blocks (counted).
    """

    # A rejected value never shows in an error message: it may hold the password.
    model_config = ConfigDict(frozen=True, extra="forbid", hide_input_in_errors=True)

    kind: Literal["redis-cluster"] = "redis-cluster"
    startup_nodes: tuple[StartupNodeUrl, ...] = Field(
        min_length=1, max_length=64, description="Startup node URLs, redis://host:port."
    )
    key_prefix: str = Field(
        default="kvoffload:", max_length=256, description="Prefix of every key this tier writes."
    )
    ttl_s: int | None = Field(
        default=None, ge=1, le=365 * 86400, description="Key expiry in seconds (None: none)."
    )
    read_from_replicas: bool = Field(
        default=False,
        description="Read from replicas too, and from a replica while its primary's breaker "
        "is open.",
    )
    node_timeout_ms: int = Field(
        default=200, ge=1, le=60_000, description="Socket connect/read timeout of one node."
    )
    lookup_budget_ms: int = Field(
        default=50,
        ge=1,
        le=60_000,
        description="Longest one probe, read or delete waits for the nodes; late nodes are misses.",
    )
    write_budget_ms: int = Field(
        default=1000,
        ge=1,
        le=600_000,
        description="Longest one write-down batch waits for the nodes; late writes are lost.",
    )
    breaker_failures: int = Field(
        default=3, ge=1, le=1000, description="Consecutive failures that open a node's breaker."
    )
    breaker_backoff_ms: int = Field(
        default=500, ge=1, le=3_600_000, description="Wait before an open breaker's first probe."
    )
    breaker_backoff_max_ms: int = Field(
        default=10_000, ge=1, le=3_600_000, description="Longest wait between probes."
    )
    refresh_interval_ms: int = Field(
        default=1000, ge=1, le=3_600_000, description="Shortest time between slot map refreshes."
    )
    max_reads_per_node: int = Field(
        default=4, ge=1, le=256, description="Read pipelines in flight to one node."
    )
    max_writes_per_node: int = Field(
        default=2,
        ge=1,
        le=256,
        description="Write pipelines in flight to one node; beyond, its blocks are skipped.",
    )
    max_in_flight: int = Field(
        default=8, ge=1, le=1024, description="Most tier operations running at once."
    )

    @field_serializer("startup_nodes", when_used="json")
    def _nodes_json(self, nodes: tuple[SecretUrl, ...]) -> list[str]:
        return [str(node) for node in nodes]  # masked, but still naming the servers

    @model_validator(mode="after")
    def _budgets_fit(self) -> RedisClusterTierSettings:
        if self.breaker_backoff_max_ms < self.breaker_backoff_ms:
            raise ValueError(
                f"breaker_backoff_max_ms={self.breaker_backoff_max_ms} is below "
                f"breaker_backoff_ms={self.breaker_backoff_ms}"
            )
        budget_ms = max(self.lookup_budget_ms, self.write_budget_ms)
        if self.op_timeout_s * 1000 <= budget_ms:
            raise ValueError(
                f"op_timeout_s={self.op_timeout_s} must exceed the budgets (lookup_budget_ms="
                f"{self.lookup_budget_ms}, write_budget_ms={self.write_budget_ms}): an "
                "operation running past op_timeout_s marks the whole tier unhealthy"
            )
        return self


AnyTierSettings = DiskTierSettings | RedisTierSettings | RedisClusterTierSettings
"""Any one tier's settings model."""

TierSettings = Annotated[AnyTierSettings, Field(discriminator="kind")]
"""One entry of ``OffloadConfig.tiers``: a `DiskTierSettings`, `RedisTierSettings` or
`RedisClusterTierSettings`."""


def _check_tiers(
    tiers: tuple[AnyTierSettings, ...],
) -> tuple[AnyTierSettings, ...]:
    names: dict[str, int] = {}
    paths: dict[Path, int] = {}
    for i, tier in enumerate(tiers):
        name = tier.name or f"{tier.kind}{i}"
        if name in names:
            raise ValueError(f"tiers[{i}] and tiers[{names[name]}] are both named {name!r}")
        names[name] = i
        if isinstance(tier, DiskTierSettings):
            path = tier.path.expanduser().absolute()
            if path in paths:
                raise ValueError(f"tiers[{i}] and tiers[{paths[path]}] share the path {path}")
            paths[path] = i
    return tiers


TierSettingsList = Annotated[tuple[TierSettings, ...], AfterValidator(_check_tiers)]
"""The type of ``OffloadConfig.tiers``: tier settings with unique names and disk paths."""


class _Tiers(BaseModel):
    # A rejected value never shows in pydantic's message (a URL may hold a password).
    model_config = ConfigDict(frozen=True, extra="forbid", hide_input_in_errors=True)

    tiers: TierSettingsList


def parse_tier_settings(value: object, *, owner: str) -> tuple[AnyTierSettings, ...]:
    """Validate a list of tier settings given outside `OffloadConfig` (an engine's own
    configuration of kvoffload's tiers) exactly as ``OffloadConfig.tiers`` is validated.

    Args:
        value: the entries (dicts, or settings models), at least one.
        owner: what holds them, named in the error (``"kvoffload secondary tier"``).

    Raises:
        ConfigError: naming ``tiers.<position>.<kind>.<field>``, pydantic's reason and the
            value (passwords masked).
    """
    try:
        tiers = _Tiers(tiers=value).tiers  # type: ignore[arg-type]
    except ValidationError as exc:
        raise ConfigError(f"invalid {owner}: {describe(exc, (), None, mask_urls)}") from exc
    if not tiers:
        raise ConfigError(f"invalid {owner}: tiers: at least one tier is needed (got [])")
    return tiers
