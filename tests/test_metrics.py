"""kvoffload.metrics: the Prometheus collector over KVOffloader.statistics()."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import re
import subprocess
import sys
from pathlib import Path

import anyio
import pytest
import torch

pytest.importorskip("prometheus_client", reason="needs the 'prometheus' extra")

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import kvoffload as kvoffload_package
from kvoffload import KVLayout, KVOffloader, MissReason, OffloadConfig
from kvoffload.groups import KVCacheGroup
from kvoffload.metrics import (
    METRICS,
    TIER_LABELS,
    TIER_TEXT_FIELDS,
    MetricSpec,
    OffloaderCollector,
    attribute_docs,
)
from kvoffload.offloader import OffloaderStatistics
from kvoffload.pool import PoolStatistics
from kvoffload.scheduler import SchedulerStatistics
from kvoffload.scheduler.groups import GroupStatistics
from kvoffload.testing import ControllableCopyEngine
from kvoffload.tiers.stats import TierManagerStatistics, TierStatistics
from kvoffload.transfer import PollerStatistics

DOCS = Path(__file__).resolve().parents[1] / "docs" / "metrics.md"
BS = 4

PARTS = {"pool": PoolStatistics, "scheduler": SchedulerStatistics, "poller": PollerStatistics}
TIER_DETAILS = {"slots": 9, "slots_used": 3, "direct_io": True, "path": "/x/tier.bin"}
"""A tier's own figures: numbers and booleans become samples, text does not."""


BY_REASON = frozenset({"lookup_misses", "miss_reason_tokens"})
"""Statistics fields counted per `MissReason`, exported with a ``reason`` label."""


def full_name(name: str, kind: str, namespace: str = "kvoffload") -> str:
    return f"{namespace}_{name}" + ("_total" if kind == "counter" else "")


def scrape(
    registry: CollectorRegistry,
) -> dict[str, tuple[str, list[tuple[dict[str, str], float]]]]:
    """Parse the exposition text: family name -> (type, [(labels, value)])."""
    text = generate_latest(registry).decode()
    out: dict[str, tuple[str, list[tuple[dict[str, str], float]]]] = {}
    for family in text_string_to_metric_families(text):
        samples = [
            (dict(s.labels), s.value) for s in family.samples if not s.name.endswith("_created")
        ]
        out[family.name] = (family.type, samples)
    return out


def fake_statistics(base: int, *, tiers: bool = True) -> OffloaderStatistics:
    """Statistics whose every numeric field has a distinct value (the latencies given);
    with ``tiers``, two tiers ``d`` (disk) and ``r`` (redis)."""
    values = iter(range(base, base + 1000))

    def value(name: str) -> object:
        if name in BY_REASON:  # a count per MissReason
            return {MissReason.EVICTED: next(values), MissReason.NEVER_STORED: next(values)}
        return next(values)

    def build(cls: type, **given: object) -> object:
        return cls(
            **{
                f.name: given[f.name] if f.name in given else value(f.name)
                for f in dataclasses.fields(cls)
            }
        )

    tier_stats = None
    if tiers:
        tier_stats = build(
            TierManagerStatistics,
            tiers=tuple(
                build(
                    TierStatistics,
                    name=name,
                    kind=kind,
                    last_error="put: boom",
                    details=TIER_DETAILS,
                )
                for name, kind in (("d", "disk"), ("r", "redis"))
            ),
        )
    return OffloaderStatistics(
        pool=build(PoolStatistics),  # type: ignore[arg-type]
        scheduler=build(SchedulerStatistics),  # type: ignore[arg-type]
        poller=build(PollerStatistics),  # type: ignore[arg-type]
        tiers=tier_stats,  # type: ignore[arg-type]
        groups={name: build(GroupStatistics) for name in ("full", "sliding")},  # type: ignore[misc]
    )


def samples_of(
    spec_part: str, field: str, stats: OffloaderStatistics
) -> list[tuple[dict[str, str], float]]:
    """What a scrape must show for one metric, from the statistics alone."""
    if spec_part == "tier":
        assert stats.tiers is not None
        out = []
        for tier in stats.tiers.tiers:
            labels = {"tier": tier.name, "kind": tier.kind}
            if field == "details":
                out += [
                    ({**labels, "detail": k}, float(v))
                    for k, v in sorted(tier.details.items())
                    if not isinstance(v, str)
                ]
            else:
                out.append((labels, float(getattr(tier, field))))
        return out
    if spec_part == "group":
        groups = stats.groups or {}
        if field in BY_REASON:
            return [
                ({"group": n, "reason": r.value}, float(c))
                for n, g in groups.items()
                for r, c in sorted(getattr(g, field).items())
            ]
        return [({"group": n}, float(getattr(g, field))) for n, g in groups.items()]
    part = getattr(stats, spec_part)
    if field in BY_REASON:
        return [({"reason": r.value}, float(c)) for r, c in sorted(getattr(part, field).items())]
    return [({}, float(getattr(part, field)))]


@pytest.mark.anyio
async def test_a_multi_group_offloader_is_scraped_with_a_group_label() -> None:
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_size=4, dtype="float32", block_size=BS)
    groups = (
        KVCacheGroup.from_layout(layout, name="full"),
        KVCacheGroup.from_layout(layout, name="swa", kind="sliding_window", window=5),
    )
    kv = {g.name: [torch.zeros(layout.tensor_shape(4))] for g in groups}
    config = OffloadConfig(num_cpu_blocks=6, block_size=BS, checkpoint_tokens=BS)
    async with KVOffloader(config, kv, groups=groups) as off:
        registry = CollectorRegistry()
        registry.register(OffloaderCollector(off))
        families = scrape(registry)
    assert families["kvoffload_group_cpu_blocks"][1] == [
        ({"group": "full"}, 6.0),
        ({"group": "swa"}, 6.0),
    ]
    assert families["kvoffload_pool_blocks"][1] == [({}, 12.0)]


@pytest.mark.anyio
async def test_a_multi_group_offloader_with_tiers_has_one_tier_sample_per_group(
    tmp_path: Path,
) -> None:
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_size=4, dtype="float32", block_size=BS)
    groups = (
        KVCacheGroup.from_layout(layout, name="full"),
        KVCacheGroup.from_layout(layout, name="swa", kind="sliding_window", window=5),
    )
    kv = {g.name: [torch.zeros(layout.tensor_shape(4))] for g in groups}
    tier = {"kind": "disk", "name": "d", "path": str(tmp_path / "kv.bin"), "capacity_bytes": "2MiB"}
    config = OffloadConfig(num_cpu_blocks=6, block_size=BS, checkpoint_tokens=BS, tiers=[tier])
    async with KVOffloader(config, kv, groups=groups) as off:
        registry = CollectorRegistry()
        registry.register(OffloaderCollector(off))
        families = scrape(registry)
    assert families["kvoffload_tier_healthy"][1] == [
        ({"tier": "d.full", "kind": "disk"}, 1.0),
        ({"tier": "d.swa", "kind": "disk"}, 1.0),
    ]
    assert families["kvoffload_tiers_promotions_in_flight"][1] == [({}, 0.0)]


def test_every_statistics_field_is_exported_exactly_once() -> None:
    parts = {
        **PARTS,
        "tiers": TierManagerStatistics,
        "tier": TierStatistics,
        "group": GroupStatistics,
    }
    assert {f.name for f in dataclasses.fields(OffloaderStatistics)} == set(PARTS) | {
        "tiers",
        "groups",
    }
    exported = [(spec.part, spec.field) for spec in METRICS]
    assert len(exported) == len(set(exported))
    # Every field is a metric, except the list of tiers (each is part "tier"), a tier's
    # name and kind (its labels) and its free-text fields.
    not_metrics = {("tiers", "tiers")}
    not_metrics |= {("tier", name) for name in ("name", "kind", *TIER_TEXT_FIELDS)}
    assert TIER_LABELS == ("tier", "kind")
    expected = {(part, f.name) for part, cls in parts.items() for f in dataclasses.fields(cls)}
    assert not_metrics <= expected
    assert set(exported) == expected - not_metrics
    hints = {f.name: f.type for f in dataclasses.fields(TierStatistics)}
    assert {hints[name] for name in TIER_TEXT_FIELDS} == {"str"}  # text only, no numbers
    names = [spec.name for spec in METRICS]
    assert len(names) == len(set(names))
    for spec in METRICS:
        assert re.fullmatch(r"[a-z][a-z0-9_]*", spec.name), spec
        assert spec.documentation.endswith("."), spec


def doc_row(spec: MetricSpec) -> str:
    """The row of docs/metrics.md for one metric."""
    name = full_name(spec.name, spec.kind)
    return f"| `{name}` | {spec.kind} | `{spec.field}` | {spec.documentation} |"


def test_docs_list_every_metric_with_its_type_field_and_help() -> None:
    """docs/metrics.md's tables are METRICS, row for row, help text included."""
    text = DOCS.read_text()
    rows = [line for line in text.splitlines() if line.startswith("| `kvoffload_")]
    expected = [doc_row(spec) for spec in METRICS]
    assert rows == expected, "docs/metrics.md's rows should be:\n" + "\n".join(expected)


STATISTICS = {
    **PARTS,
    "tiers": TierManagerStatistics,
    "tier": TierStatistics,
    "group": GroupStatistics,
}


def griffe_attributes(cls: type) -> dict[str, str]:
    """The ``Attributes:`` of ``cls``'s docstring as the docs' own parser (griffe) reads it."""
    griffe = pytest.importorskip("griffe", reason="needs the docs tools (mkdocstrings)")
    assert cls.__doc__ is not None
    docstring = griffe.Docstring(inspect.cleandoc(cls.__doc__), parser="google")
    sections = [s for s in docstring.parse() if s.kind.value == "attributes"]
    assert len(sections) == 1, f"{cls.__name__}: expected one Attributes section"
    return {a.name: a.description for a in sections[0].value}


@pytest.mark.parametrize("part", sorted(STATISTICS))
def test_every_statistics_field_is_documented(part: str) -> None:
    cls = STATISTICS[part]
    documented = griffe_attributes(cls)
    assert list(documented) == [f.name for f in dataclasses.fields(cls)]
    assert set(attribute_docs(cls)) == set(documented)


def plain(text: str) -> str:
    """The help text a docstring entry makes: one line, no code backticks, a capital."""
    one = re.sub(r"``?([^`]*)``?", r"\1", " ".join(text.split()))
    return one if text.startswith("`") else one[:1].upper() + one[1:]


def test_help_texts_are_the_statistics_docstrings() -> None:
    for spec in METRICS:
        entry = griffe_attributes(STATISTICS[spec.part])[spec.field]
        assert spec.documentation == plain(entry), spec
        assert "`" not in spec.documentation, spec
        assert "\n" not in spec.documentation, spec


def test_only_numbers_and_booleans_are_exported() -> None:
    numeric = {"int", "float", "bool", "float | None"}
    for spec in METRICS:
        if (spec.part, spec.field) == ("tier", "details") or spec.field in BY_REASON:
            continue  # one sample per numeric entry
        field_type = {f.name: f.type for f in dataclasses.fields(STATISTICS[spec.part])}
        assert field_type[spec.field] in numeric, spec


class _Documented:
    """A class for the docstring reader.

    Attributes:
        plain: a text.
        wrapped (int): a ``code`` name and a `cross-ref` on
            two lines.
        code_first: ``x`` keeps its case.

    Note:
        not an attribute: ignored.
    """


class _Undocumented:
    """No attributes here."""


class _Malformed:
    """A class whose attributes cannot be read.

    Attributes:
        fine: a text.
      odd indentation
    """


def test_attribute_docs_reads_google_style_entries() -> None:
    assert attribute_docs(_Documented) == {
        "plain": "A text.",
        "wrapped": "A code name and a cross-ref on two lines.",
        "code_first": "x keeps its case.",
    }
    assert {k: plain(v) for k, v in griffe_attributes(_Documented).items()} == attribute_docs(
        _Documented
    )


def test_attribute_docs_refuses_what_it_cannot_read() -> None:
    with pytest.raises(ValueError, match="_Undocumented's docstring has no 'Attributes:'"):
        attribute_docs(_Undocumented)
    with pytest.raises(ValueError, match="cannot read 'odd indentation'"):
        attribute_docs(_Malformed)


def test_the_collector_imports_without_docstrings() -> None:
    """Under ``python -OO`` there are no docstrings: the help texts fall back to names."""
    code = (
        "from kvoffload.metrics import METRICS\n"
        "print(sorted({s.documentation == f'{s.part} {s.field}' for s in METRICS}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-OO", "-c", code], check=True, capture_output=True, text=True
    )
    assert out.stdout.split() == ["[True]"]


def test_collect_reports_each_field_of_the_statistics() -> None:
    stats = fake_statistics(7)
    registry = CollectorRegistry()
    registry.register(OffloaderCollector(lambda: stats))
    families = scrape(registry)
    assert len(families) == len(METRICS)
    for spec in METRICS:
        kind, samples = families[f"kvoffload_{spec.name}"]
        assert kind == spec.kind
        assert samples == samples_of(spec.part, spec.field, stats), spec
    text = generate_latest(registry).decode()
    assert "# TYPE kvoffload_scheduler_stored_blocks_total counter" in text
    assert "# TYPE kvoffload_pool_free_blocks gauge" in text
    assert "# TYPE kvoffload_tier_written_blocks_total counter" in text
    assert "# TYPE kvoffload_tier_healthy gauge" in text


def test_tier_metrics_carry_tier_and_kind_labels() -> None:
    stats = fake_statistics(3)
    assert stats.tiers is not None
    d, r = stats.tiers.tiers
    registry = CollectorRegistry()
    registry.register(OffloaderCollector({"0": lambda: stats}))
    families = scrape(registry)
    assert families["kvoffload_tier_failed_checks"] == (
        "counter",
        [
            ({"engine": "0", "tier": "d", "kind": "disk"}, float(d.failed_checks)),
            ({"engine": "0", "tier": "r", "kind": "redis"}, float(r.failed_checks)),
        ],
    )
    assert families["kvoffload_tiers_promotions"] == (
        "counter",
        [({"engine": "0"}, float(stats.tiers.promotions))],
    )
    details = {
        s[0]["detail"]: s[1] for s in families["kvoffload_tier_detail"][1] if s[0]["tier"] == "d"
    }
    assert details == {"slots": 9.0, "slots_used": 3.0, "direct_io": 1.0}  # no text
    text = generate_latest(registry).decode()
    assert "boom" not in text
    assert "/x/tier.bin" not in text


def test_without_tiers_the_tier_families_have_no_samples() -> None:
    stats = fake_statistics(5, tiers=False)
    registry = CollectorRegistry()
    registry.register(OffloaderCollector(lambda: stats))
    families = scrape(registry)
    assert len(families) == len(METRICS)
    for spec in METRICS:
        if spec.part in {"tier", "tiers"}:
            assert families[f"kvoffload_{spec.name}"] == (spec.kind, []), spec
    assert families["kvoffload_pool_evictions"] == ("counter", [({}, float(stats.pool.evictions))])


@pytest.mark.parametrize("label", ["tier", "kind", "detail", "group"])
def test_the_tier_labels_cannot_name_the_sources(label: str) -> None:
    with pytest.raises(ValueError, match="taken by the tier or group metrics"):
        OffloaderCollector({"0": lambda: fake_statistics(0)}, label=label)


def test_unknown_latency_has_no_sample() -> None:
    stats = fake_statistics(1)
    stats = dataclasses.replace(
        stats,
        poller=dataclasses.replace(
            stats.poller, observe_latency_median_s=None, observe_latency_p99_s=None
        ),
    )
    registry = CollectorRegistry()
    registry.register(OffloaderCollector(lambda: stats))
    families = scrape(registry)
    assert families["kvoffload_poller_observe_latency_median_seconds"] == ("gauge", [])
    assert families["kvoffload_poller_observe_latency_p99_seconds"] == ("gauge", [])
    assert families["kvoffload_poller_polls"][1] == [({}, float(stats.poller.polls))]


def test_a_label_tells_several_offloaders_apart() -> None:
    a, b = fake_statistics(10), fake_statistics(500)
    registry = CollectorRegistry()
    registry.register(OffloaderCollector({"a": lambda: a, "b": lambda: b}, label="gpu"))
    families = scrape(registry)
    assert families["kvoffload_pool_evictions"] == (
        "counter",
        [({"gpu": "a"}, float(a.pool.evictions)), ({"gpu": "b"}, float(b.pool.evictions))],
    )
    assert families["kvoffload_scheduler_live_requests"] == (
        "gauge",
        [
            ({"gpu": "a"}, float(a.scheduler.live_requests)),
            ({"gpu": "b"}, float(b.scheduler.live_requests)),
        ],
    )


def test_namespace_prefixes_every_name() -> None:
    registry = CollectorRegistry()
    registry.register(OffloaderCollector(lambda: fake_statistics(0), namespace="kv"))
    names = set(scrape(registry))
    assert names == {f"kv_{spec.name}" for spec in METRICS}


def test_a_registry_refuses_a_second_collector_of_the_same_names() -> None:
    registry = CollectorRegistry()
    registry.register(OffloaderCollector(lambda: fake_statistics(0)))
    with pytest.raises(ValueError, match="Duplicated"):
        registry.register(OffloaderCollector(lambda: fake_statistics(0)))


@pytest.mark.parametrize("label", ["", "1engine", "engine-id", "__reserved", "naïve"])
def test_bad_label_names_are_refused(label: str) -> None:
    with pytest.raises(ValueError, match="label name"):
        OffloaderCollector({"0": lambda: fake_statistics(0)}, label=label)


@pytest.mark.parametrize("namespace", ["", "kv-offload", "9kv"])
def test_bad_namespaces_are_refused(namespace: str) -> None:
    with pytest.raises(ValueError, match="namespace"):
        OffloaderCollector(lambda: fake_statistics(0), namespace=namespace)


def test_an_empty_mapping_is_refused() -> None:
    with pytest.raises(ValueError, match="empty"):
        OffloaderCollector({})


def test_registration_does_not_read_statistics() -> None:
    reads = 0

    def source() -> OffloaderStatistics:
        nonlocal reads
        reads += 1
        return fake_statistics(0)

    registry = CollectorRegistry()
    registry.register(OffloaderCollector(source))
    assert reads == 0
    generate_latest(registry)
    assert reads == 1  # one snapshot per scrape, not one per metric


@pytest.mark.anyio
async def test_a_live_offloader_scrapes_to_its_statistics() -> None:
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_size=8, dtype="float32", block_size=BS)
    kv = [torch.randn(layout.tensor_shape(16)) for _ in range(layout.num_layers)]
    registry = CollectorRegistry()
    cfg = OffloadConfig(block_size=BS, num_cpu_blocks=8, pin_memory="never")
    async with KVOffloader(cfg, kv, layout=layout) as off:
        registry.register(OffloaderCollector({"0": off}))
        tokens = list(range(3 * BS))
        hashes = off.hash_prompt(tokens)
        assert off.lookup("a", hashes, len(tokens)) == 0
        off.update("a", [0, 1, 2], hashes, len(tokens))
        for task in off.store():
            await task
        off.finish("a")
        assert off.lookup("b", hashes, len(tokens) + 1) == len(tokens)
        load = off.load("b", [3, 4, 5, 6], len(tokens))
        assert load is not None
        await load
        off.finish("b")
        await off.drain()
        families = scrape(registry)
        stats = off.statistics()
    assert stats.scheduler.stored_blocks == 3
    assert stats.scheduler.loaded_blocks == 3
    label = {"engine": "0"}
    assert families["kvoffload_scheduler_stored_blocks"] == ("counter", [(label, 3.0)])
    assert families["kvoffload_scheduler_loaded_blocks"] == ("counter", [(label, 3.0)])
    assert families["kvoffload_scheduler_hit_tokens"] == ("counter", [(label, 12.0)])
    assert families["kvoffload_scheduler_stored_bytes"] == (
        "counter",
        [(label, float(3 * layout.bytes_per_block))],
    )
    assert families["kvoffload_pool_cached_blocks"] == ("gauge", [(label, 3.0)])
    assert families["kvoffload_pool_blocks"] == ("gauge", [(label, 8.0)])
    assert families["kvoffload_scheduler_in_flight_transfers"] == ("gauge", [(label, 0.0)])
    assert families["kvoffload_poller_completed"] == ("counter", [(label, 2.0)])


@pytest.mark.anyio
async def test_a_live_offloader_with_a_disk_tier_scrapes_its_tier(tmp_path: Path) -> None:
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_size=8, dtype="float32", block_size=BS)
    kv = [torch.randn(layout.tensor_shape(16)) for _ in range(layout.num_layers)]
    tier = {
        "kind": "disk",
        "name": "d0",
        "path": str(tmp_path / "t.bin"),
        "capacity_bytes": 1 << 20,
    }
    cfg = OffloadConfig(block_size=BS, num_cpu_blocks=8, pin_memory="never", tiers=[tier])
    registry = CollectorRegistry()
    async with KVOffloader(cfg, kv, layout=layout) as off:
        registry.register(OffloaderCollector(off))
        tokens = list(range(3 * BS))
        hashes = off.hash_prompt(tokens)
        off.lookup("a", hashes, len(tokens))
        off.update("a", [0, 1, 2], hashes, len(tokens))
        for task in off.store():
            await task
        off.finish("a")
        await off.drain()
        with anyio.fail_after(10):
            while (off.statistics().tiers or pytest.fail("no tiers")).tiers[0].blocks_written < 3:
                await anyio.sleep(0.01)
        families = scrape(registry)
        tier_stats = off.statistics().tiers
    assert tier_stats is not None
    label = {"tier": "d0", "kind": "disk"}
    assert families["kvoffload_tier_written_blocks"] == ("counter", [(label, 3.0)])
    assert families["kvoffload_tier_written_bytes"] == (
        "counter",
        [(label, float(3 * layout.bytes_per_block))],
    )
    assert families["kvoffload_tier_healthy"] == ("gauge", [(label, 1.0)])
    assert families["kvoffload_tier_failed_checks"] == ("counter", [(label, 0.0)])
    details = {s[0]["detail"]: s[1] for s in families["kvoffload_tier_detail"][1]}
    assert details["slots_used"] == 3.0
    assert families["kvoffload_tiers_promotions"] == (
        "counter",
        [({}, float(tier_stats.promotions))],
    )


def test_import_without_the_extra_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(sys.modules):
        if name == "prometheus_client" or name.startswith("prometheus_client."):
            monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    monkeypatch.delitem(sys.modules, "kvoffload.metrics")
    with pytest.raises(ImportError, match=re.escape("pip install '.[prometheus]'")):
        importlib.import_module("kvoffload.metrics")


def test_only_the_metrics_module_imports_prometheus_client() -> None:
    """``import kvoffload`` never needs the extra: no other module imports it, but the
    vLLM connector's statistics (vLLM itself depends on prometheus_client, and nothing
    but vLLM imports that module)."""
    package = Path(kvoffload_package.__file__).parent
    importers = []
    for path in sorted(package.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
            if any(
                n.split(".")[0] == "prometheus_client" or n == "kvoffload.metrics" for n in names
            ):
                importers.append(path.relative_to(package).as_posix())
    assert sorted(set(importers)) == ["integrations/vllm/stats.py", "metrics.py"]


@pytest.mark.anyio
async def test_the_documented_hit_rate_is_the_fraction_of_prompt_tokens_loaded() -> None:
    """The PromQL of docs/metrics.md against a tally kept here: hit_tokens counted every
    lookup, so an engine that looks a request up, releases it (it does not fit) and looks
    it up again counted the hit each time, and the old query reported far more than was
    loaded."""
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_size=4, dtype="float32", block_size=BS)
    kv = [torch.randn(layout.tensor_shape(32))]
    engine = ControllableCopyEngine()
    cfg = OffloadConfig(block_size=BS, num_cpu_blocks=16, pin_memory="never")
    registry = CollectorRegistry()
    loaded = prompt = offered = 0
    async with KVOffloader(cfg, kv, layout=layout, copy_engine=engine) as off:
        registry.register(OffloaderCollector(off))
        shared = list(range(3 * BS))

        def look(rid: str, toks: list[int]) -> int:
            nonlocal offered
            hit = off.lookup(rid, off.hash_prompt(toks), len(toks))
            offered += hit
            return hit

        async def load(rid: str, table: list[int], n: int, *, ok: bool = True) -> None:
            task = off.load(rid, table, n)
            assert task is not None
            engine.complete(task) if ok else engine.fail(task)
            await off.drain()

        # "a" computes and stores the shared prefix.
        a = [*shared, 99]
        assert look("a", a) == 0
        prompt += len(a)
        off.update("a", [0, 1, 2, 3], off.hash_prompt(a), len(a))
        [store] = off.store()
        engine.complete(store)
        await off.drain()
        off.finish("a")
        # "b" is looked up and released three times (no room yet), then loads 2 of 3 blocks.
        b = [*shared, 7, 8]
        for _ in range(3):
            assert look("b", b) == 12
            off.release("b")
        assert look("b", b) == 12
        prompt += len(b)
        await load("b", [4, 5, 6, 7], 8)
        loaded += 8
        off.finish("b")
        # "d" loads its hit, is preempted and re-admitted: a second admission, loaded again.
        d = [*shared, 1, 2, 3]
        for _ in range(2):
            assert look("d", d) == 12
            prompt += len(d)
            await load("d", [8, 9, 10, 11], 12)
            loaded += 12
            off.preempt("d")
        off.finish("d")
        # "e" misses; "c"'s load fails (recomputed, so not served).
        e = [500 + i for i in range(9)]
        assert look("e", e) == 0
        prompt += len(e)
        off.finish("e")
        c = [*shared, 5]
        assert look("c", c) == 12
        prompt += len(c)
        await load("c", [12, 13, 14, 15], 12, ok=False)
        off.finish("c")
        families = scrape(registry)
        stats = off.statistics().scheduler

    def value(name: str) -> float:
        [(_, v)] = families[name][1]
        return v

    assert (stats.loaded_tokens, stats.prompt_tokens, stats.hit_tokens) == (
        loaded,
        prompt,
        offered,
    )
    assert value("kvoffload_scheduler_loaded_tokens") == loaded == 32
    assert value("kvoffload_scheduler_prompt_tokens") == prompt == 13 + 14 + 2 * 15 + 9 + 13
    assert value("kvoffload_scheduler_hit_tokens") == offered == 4 * 12 + 2 * 12 + 12
    # The query docs/metrics.md gives, over counters that started at 0:
    query = re.search(r"rate\((\w+)\[5m\]\) / rate\((\w+)\[5m\]\)", DOCS.read_text())
    assert query is not None
    numerator, denominator = query.groups()
    rate = value(numerator.removesuffix("_total")) / value(denominator.removesuffix("_total"))
    assert rate == loaded / prompt
