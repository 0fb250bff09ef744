"""Configuration: `OffloadConfig`.

This is the only module that reads the environment. Every other part receives an
``OffloadConfig`` object. The settings of the secondary tiers (``OffloadConfig.tiers``)
live in `kvoffload.tier_config`, the tensor geometry (`KVLayout`) in `kvoffload.layout`;
both are re-exported here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import (
    ByteSize,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, SettingsConfigDict, SettingsError

from kvoffload._validation import describe, frozen_setattr, not_bool, validate_or_refuse
from kvoffload.errors import ConfigError
from kvoffload.layout import DTypeName, KVLayout, LayoutKind
from kvoffload.pool.policies import POLICY_NAMES
from kvoffload.pool.policies.admission import parse_admission
from kvoffload.tier_config import (
    DiskTierSettings,
    RedisClusterTierSettings,
    RedisTierSettings,
    SecretUrl,
    TierSettings,
    TierSettingsList,
    mask_urls,
    redact_url,
)

__all__ = [
    "DTypeName",
    "DiskTierSettings",
    "KVLayout",
    "LayoutKind",
    "OffloadConfig",
    "RedisClusterTierSettings",
    "RedisTierSettings",
    "SecretUrl",
    "TierSettings",
    "TierSettingsList",
    "redact_url",
]

_GIB = 1 << 30

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self from Python 3.11


_EAGER_ONLY = {
    "restore_evicted": "it re-stores a live request's evicted blocks from its cursor, and a "
    "lazy store keeps no cursor",
    "store_admission": "it filters the blocks a request's store scan offers, and a lazy "
    "store scans the engine's eviction order",
    "hold_blocks_on_finish": "it pins a finished request's unstored blocks until its store "
    "scan reaches them, and a lazy store scans none; the engine's own cache keeps them",
}
"""The settings of eager stores that ``store_mode="lazy"`` refuses, and why."""


def _refused(exc: ValidationError) -> ConfigError:
    """The `ConfigError` of a refused `OffloadConfig`: each field (with its environment
    variable), the problem, the value (a URL's password masked)."""
    described = describe(exc, OffloadConfig.model_fields, "KVOFFLOAD_", mask_urls)
    return ConfigError(f"invalid OffloadConfig: {described}")


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
        "s3fifo, prefix-freq, or adaptive (weighs the others by their hits in its shadow pools; "
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
    max_retained_fraction: float = Field(
        default=0.1,
        gt=0.0,
        le=1.0,
        description="The share of the CPU pool KVOffloader.retain_prefix() may hold, all "
        "owners together (rounded down to whole blocks; at most the pool less one block).",
    )
    max_prefetch_fraction: float = Field(
        default=0.25,
        gt=0.0,
        le=1.0,
        description="The share of the CPU pool that prefetches from the secondary tiers "
        "(SessionHints.prefetch()) may take at once, all prefetches in flight together "
        "(rounded down to whole blocks; at most the pool less one block).",
    )

    checkpoint_tokens: int | None = Field(
        default=None,
        ge=1,
        le=1 << 24,
        description="Models with several KV cache groups: tokens between store points (a "
        "multiple of the LCM of the groups' block sizes); None: the smallest such multiple "
        "of at least 1024 tokens. Refused for one full-attention group.",
    )

    def __init__(self, **values: Any) -> None:
        try:
            super().__init__(**values)
        except ValidationError as exc:
            raise _refused(exc) from exc
        except SettingsError as exc:  # e.g. KVOFFLOAD_TIERS that is not JSON
            raise ConfigError(f"invalid OffloadConfig: {exc} (list fields take JSON)") from exc

    @classmethod
    def model_validate(cls, *args: Any, **kwargs: Any) -> Self:
        """`pydantic.BaseModel.model_validate`, refusing with a `ConfigError` as the
        constructor does."""
        return validate_or_refuse(
            lambda: super(OffloadConfig, cls).model_validate(*args, **kwargs), _refused
        )

    _no_bool = field_validator(
        "block_size",
        "num_cpu_blocks",
        "lazy_offload_blocks",
        "max_store_blocks_per_step",
        "hold_max_blocks",
        "hold_max_steps",
        "checkpoint_tokens",
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

    @model_validator(mode="after")
    def _lazy_takes_no_eager_setting(self) -> OffloadConfig:
        """Refuse the eager-only settings with ``store_mode="lazy"`` (never ignore them)."""
        if self.store_mode != "lazy":
            return self
        wrong = [
            f"{name}={getattr(self, name)!r} ({why})"
            for name, why in _EAGER_ONLY.items()
            if getattr(self, name) != type(self).model_fields[name].default
        ]
        if wrong:
            raise ValueError(
                "store_mode='lazy' stores the GPU blocks closest to eviction, not a request's "
                "blocks as they are computed, so it cannot honour: " + "; ".join(wrong)
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
