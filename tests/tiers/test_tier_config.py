"""OffloadConfig.tiers: the discriminated union, JSON in KVOFFLOAD_TIERS, named errors."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

from kvoffload.config import OffloadConfig
from kvoffload.errors import ConfigError
from kvoffload.tiers.build import build_tier
from kvoffload.tiers.settings import DiskTierSettings, RedisTierSettings

R: dict[str, object] = {"kind": "redis", "url": "redis://h"}


def test_default_is_no_tier() -> None:
    assert OffloadConfig(num_cpu_blocks=4).tiers == ()


def test_kinds_are_picked_by_kind(tmp_path: Path) -> None:
    cfg = OffloadConfig(
        num_cpu_blocks=4,
        tiers=[
            {"kind": "disk", "path": str(tmp_path / "kv"), "capacity_bytes": "2GiB"},
            {"kind": "redis", "url": "redis://127.0.0.1:6379/0", "ttl_s": 600},
        ],
    )
    disk, redis = cfg.tiers
    assert isinstance(disk, DiskTierSettings)
    assert disk.capacity_bytes == 2 << 30
    assert not disk.persist
    assert isinstance(redis, RedisTierSettings)
    assert redis.ttl_s == 600
    assert redis.key_prefix == "kvoffload:"


def test_tiers_from_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    tiers = [
        {"kind": "disk", "path": str(tmp_path / "kv"), "capacity_bytes": "1GiB", "persist": True}
    ]
    monkeypatch.setenv("KVOFFLOAD_TIERS", json.dumps(tiers))
    (tier,) = OffloadConfig(num_cpu_blocks=4).tiers
    assert isinstance(tier, DiskTierSettings)
    assert tier.persist


@pytest.mark.parametrize(
    ("tiers", "names"),
    [
        ([{"kind": "disk", "path": "/x", "capacity_bytes": 10}], ["tiers.0.disk.capacity_bytes"]),
        ([{"kind": "redis", "url": "redis://h", "ttl_s": 0}], ["tiers.0.redis.ttl_s"]),
        ([{"kind": "redis"}], ["tiers.0.redis.url"]),
        ([{"kind": "nfs"}], ["tiers.0", "'nfs'"]),
        (
            [
                {"kind": "redis", "url": "redis://h"},
                {"kind": "redis", "url": "redis://h", "max_in_flight": 0},
            ],
            ["tiers.1.redis.max_in_flight"],
        ),
        ([{"kind": "redis", "url": "redis://h", "retry_max_s": 0.1}], ["retry_max_s=0.1"]),
        ([{"kind": "redis", "url": "redis://h", "colour": 1}], ["tiers.0.redis.colour"]),
        (
            [{"kind": "disk", "path": "/a", "capacity_bytes": "1GiB"}] * 2,
            ["tiers[1] and tiers[0] share the path /a"],
        ),
        (
            [
                {"kind": "redis", "url": "redis://h", "name": "x"},
                {"kind": "redis", "url": "redis://h", "name": "x"},
            ],
            ["both named 'x'"],
        ),
    ],
)
def test_errors_name_the_tier_and_field(tiers: list[dict[str, object]], names: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        OffloadConfig(num_cpu_blocks=4, tiers=tiers)
    for name in names:
        assert name in str(info.value)


def test_env_error_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVOFFLOAD_TIERS", json.dumps([{"kind": "disk", "path": "/x"}]))
    with pytest.raises(
        ConfigError, match=r"tiers\.0\.disk\.capacity_bytes \(env KVOFFLOAD_TIERS\)"
    ):
        OffloadConfig(num_cpu_blocks=4)
    monkeypatch.setenv("KVOFFLOAD_TIERS", "not json")
    with pytest.raises(ConfigError, match="tiers"):
        OffloadConfig(num_cpu_blocks=4)


def test_redis_tier_without_the_extra_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    loaded = [m for m in sys.modules if m.startswith(("redis.", "kvoffload.tiers.redis"))]
    for name in [*loaded, "redis"]:
        if name in sys.modules:
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "redis", None)  # what an absent package looks like
    with pytest.raises(ImportError, match=r"pip install '\.\[redis\]'"):
        importlib.import_module("kvoffload.tiers.redis")
    settings = RedisTierSettings(url="redis://127.0.0.1:1/0")
    with pytest.raises(ConfigError, match=r"tiers\[0\] \('redis0'\).*pip install '\.\[redis\]'"):
        build_tier(settings, 0, namespace=b"\0" * 32, block_nbytes=1024)


@pytest.mark.parametrize("preallocate", [True, False])
def test_disk_preallocate_reaches_the_tier(tmp_path: Path, preallocate: bool) -> None:
    tier: dict[str, object] = {
        "kind": "disk",
        "path": str(tmp_path / "kv.bin"),
        "capacity_bytes": "1MiB",
    }
    if not preallocate:
        tier["preallocate"] = False
    cfg = OffloadConfig(block_size=4, num_cpu_blocks=4, tiers=[tier])
    settings = cfg.tiers[0]
    assert isinstance(settings, DiskTierSettings)
    assert settings.preallocate is preallocate
    built = build_tier(settings, 0, namespace=bytes(32), block_nbytes=4096)
    assert built.statistics()["preallocated"] is preallocate
