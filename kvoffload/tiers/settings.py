"""Settings of the secondary tiers: the entries of ``OffloadConfig.tiers``.

A tier is chosen by its ``kind``; pydantic picks the model from that field, so an error
names the tier's position, its kind and the field (``tiers.0.disk.capacity_bytes``). In
the environment the whole list is JSON::

    KVOFFLOAD_TIERS='[{"kind": "disk", "path": "/mnt/nvme/kv.bin", "capacity_bytes": "64GiB"}]'
"""

from __future__ import annotations

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
    field_serializer,
    model_validator,
)

__all__ = [
    "DiskTierSettings",
    "RedisTierSettings",
    "SecretUrl",
    "TierSettings",
    "TierSettingsList",
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


TierSettings = Annotated[DiskTierSettings | RedisTierSettings, Field(discriminator="kind")]
"""One entry of ``OffloadConfig.tiers``: a `DiskTierSettings` or a `RedisTierSettings`."""


def _check_tiers(
    tiers: tuple[DiskTierSettings | RedisTierSettings, ...],
) -> tuple[DiskTierSettings | RedisTierSettings, ...]:
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
