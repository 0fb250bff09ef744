"""Configuration: `OffloadConfig` and the settings of its secondary tiers.

This is the only module that reads the environment. Every other part receives an
``OffloadConfig`` object. A tier is chosen by its ``kind``; pydantic picks the model from
that field, so an error names the tier's position, its kind and the field
(``tiers.0.disk.capacity_bytes``). In the environment the whole list is JSON::

    KVOFFLOAD_TIERS='[{"kind": "disk", "path": "/mnt/nvme/kv.bin", "capacity_bytes": "64GiB"}]'

The tensor geometry, `KVLayout`, lives in `kvoffload.layout` and is re-exported here.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal
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
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, SettingsConfigDict, SettingsError

from kvoffload._validation import describe, frozen_setattr, not_bool
from kvoffload.errors import ConfigError
from kvoffload.layout import DTypeName, KVLayout, LayoutKind
from kvoffload.pool.policies import POLICY_NAMES
from kvoffload.pool.policies.admission import parse_admission

__all__ = [
    "DTypeName",
    "DiskTierSettings",
    "KVLayout",
    "LayoutKind",
    "OffloadConfig",
    "RedisTierSettings",
    "SecretUrl",
    "TierSettings",
    "TierSettingsList",
    "redact_url",
]

_GIB = 1 << 30

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


def _masked(value: object) -> object:
    """``value`` with the password of every URL in it masked (`redact_url`), for errors."""
    if isinstance(value, str):
        return redact_url(value) if "://" in value else value
    if isinstance(value, Mapping):
        return {k: _masked(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_masked(v) for v in value)
    return value


class OffloadConfig(BaseSettings):
    """Settings of one offloader. Frozen; reads ``KVOFFLOAD_<FIELD>`` environment variables.

    Exactly one of ``num_cpu_blocks`` and ``cpu_bytes`` sizes the CPU pool.

    Raises:
        ConfigError: a field is out of bounds or two fields disagree; the message names
            the field, its environment variable and the value.
    """

    # The chained ValidationError shows no input (a tier URL may hold a password); the
    # ConfigError's own message shows it with passwords masked.
    model_config = SettingsConfigDict(
        env_prefix="KVOFFLOAD_", extra="forbid", frozen=True, hide_input_in_errors=True
    )

    block_size: int = Field(
        default=16, ge=1, le=65536, description="Tokens per KV block (must equal the layout's)."
    )
    num_cpu_blocks: int | None = Field(
        default=None, ge=1, le=1 << 31, description="CPU pool size in blocks."
    )
    cpu_bytes: ByteSize | None = Field(
        default=None,
        ge=1,
        description="CPU pool size in bytes (e.g. '8GiB'); turned into whole blocks of the layout.",
    )
    store_mode: Literal["eager", "lazy"] = Field(
        default="eager",
        description="eager: store every newly computed full block; lazy: store the GPU blocks "
        "closest to eviction only.",
    )
    lazy_offload_blocks: int = Field(
        default=256,
        ge=1,
        le=1 << 24,
        description="Lazy mode: how many GPU blocks closest to eviction to keep stored.",
    )
    restore_evicted: bool = Field(
        default=False,
        description="Re-store CPU blocks evicted below a live request's cursor while its GPU "
        "copy still exists (costs a rescan; off keeps the O(1) cursor).",
    )
    max_store_blocks_per_step: int = Field(
        default=4096, ge=1, le=1 << 24, description="Most blocks one plan_stores() schedules."
    )
    pin_memory: Literal["auto", "always", "never"] = Field(
        default="auto",
        description="Pin the host buffer: auto pins when CUDA is available and falls back to "
        "pageable memory with one warning; always fails if pinning fails; never skips it.",
    )
    pin_chunk_bytes: ByteSize = Field(
        default=ByteSize(_GIB),
        ge=1 << 20,
        le=256 * _GIB,
        description="Largest single host-memory registration when pinning.",
    )
    poll_interval_s: float = Field(
        default=0.0002,
        gt=0,
        le=0.1,
        description="Completion poller sleep between event queries while transfers are in flight.",
    )
    model_id: str = Field(
        default="", max_length=1024, description="Model name and revision, mixed into block hashes."
    )
    hash_salt: str = Field(
        default="",
        max_length=1024,
        description="Extra namespace for block hashes (cache isolation).",
    )
    enable_events: bool = Field(
        default=False, description="Record BlockStored/BlockRemoved events for KV-aware routers."
    )
    eviction_policy: str = Field(
        default="lru",
        min_length=1,
        max_length=64,
        description="Which free CPU block is reused first: lru (default, fastest), arc, "
        "s3fifo, prefix-freq, or adaptive (follows whichever of them fits the traffic; "
        "see docs/policies.md).",
    )
    store_admission: str = Field(
        default="always",
        min_length=1,
        max_length=64,
        description="Which computed blocks are stored (eager mode): always, seen_twice, or "
        "seen:N[:WINDOW] (the N-th offer of a hash within the last WINDOW offers).",
    )

    @field_validator("eviction_policy")
    @classmethod
    def _known_policy(cls, value: str) -> str:
        name = value.strip().lower()
        if name not in POLICY_NAMES:
            raise ValueError(f"unknown eviction policy; known: {', '.join(POLICY_NAMES)}")
        return name

    @field_validator("store_admission")
    @classmethod
    def _known_admission(cls, value: str) -> str:
        parse_admission(value)
        return value.strip().lower()

    tiers: TierSettingsList = Field(
        default=(),
        max_length=8,
        description="Secondary tiers below the CPU pool (disk, redis), fastest first; JSON "
        "in the environment.",
    )
    hold_blocks_on_finish: bool = Field(
        default=False,
        description="Eager mode: a request finished with computed blocks still unstored (deferred "
        "for lack of space) keeps those GPU blocks pinned until a later step stores them.",
    )
    hold_max_blocks: int = Field(
        default=1024,
        ge=1,
        le=1 << 24,
        description="Most GPU blocks all finished requests together may hold "
        "(hold_blocks_on_finish).",
    )
    hold_max_steps: int = Field(
        default=32,
        ge=1,
        le=1 << 20,
        description="plan_stores() calls after which a finished request's unstored blocks are "
        "given up and its GPU blocks released (hold_blocks_on_finish).",
    )

    def __init__(self, **values: Any) -> None:
        try:
            super().__init__(**values)
        except ValidationError as exc:
            fields = type(self).model_fields
            raise ConfigError(
                f"invalid OffloadConfig: {describe(exc, fields, 'KVOFFLOAD_', _masked)}"
            ) from exc
        except SettingsError as exc:  # e.g. KVOFFLOAD_TIERS that is not JSON
            raise ConfigError(f"invalid OffloadConfig: {exc} (list fields take JSON)") from exc

    _no_bool = field_validator(
        "block_size",
        "num_cpu_blocks",
        "lazy_offload_blocks",
        "max_store_blocks_per_step",
        "hold_max_blocks",
        "hold_max_steps",
        mode="before",
    )(not_bool)

    def __setattr__(self, name: str, value: object) -> None:
        frozen_setattr(self, name, value)

    @model_validator(mode="after")
    def _exactly_one_size(self) -> OffloadConfig:
        if (self.num_cpu_blocks is None) == (self.cpu_bytes is None):
            raise ValueError(
                "exactly one of num_cpu_blocks (env KVOFFLOAD_NUM_CPU_BLOCKS) and cpu_bytes "
                f"(env KVOFFLOAD_CPU_BYTES) must be set (got num_cpu_blocks="
                f"{self.num_cpu_blocks!r}, cpu_bytes={self.cpu_bytes!r})"
            )
        return self

    def resolve_num_cpu_blocks(self, layout: KVLayout) -> int:
        """CPU blocks for ``layout``: ``num_cpu_blocks``, or ``cpu_bytes`` in whole blocks.

        Raises:
            ConfigError: ``cpu_bytes`` holds less than one block, or ``block_size``
                differs from the layout's.
        """
        if layout.block_size != self.block_size:
            raise ConfigError(
                f"block_size={self.block_size} does not match the layout's block_size="
                f"{layout.block_size}"
            )
        if self.num_cpu_blocks is not None:
            return self.num_cpu_blocks
        cpu_bytes = int(self.cpu_bytes or 0)
        n = cpu_bytes // layout.bytes_per_block
        if n < 1:
            raise ConfigError(
                f"cpu_bytes={cpu_bytes} holds no block of {layout.bytes_per_block} bytes"
            )
        return n
