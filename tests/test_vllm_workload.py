"""The vLLM CPU recipe's workload (``scripts/vllm_workload.py``): it outgrows the KV cache
the recipe gives vLLM, and it reads what kvoffload served from vLLM's own counters.

The ``/metrics`` pages are written by ``prometheus_client``, the library vLLM exports its
metrics with, under vLLM's metric names and labels.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

ROOT = Path(__file__).resolve().parents[1]
SERVE = ROOT / "scripts" / "vllm_cpu_serve.sh"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "kvoffload_vllm_workload", ROOT / "scripts" / "vllm_workload.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


workload = _load()
SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")


class Vllm:
    """vLLM's prompt-token counters and cache info gauge in a registry of their own."""

    def __init__(self, *, block_size: int = 128, num_gpu_blocks: int = 16, engines: int = 1):
        self.registry = CollectorRegistry()
        labels = ["model_name", "engine"]
        self.by_source = Counter(
            "vllm:prompt_tokens_by_source",
            "Number of prompt tokens by source.",
            [*labels, "source"],
            registry=self.registry,
        )
        self.hits = Counter(
            "vllm:external_prefix_cache_hits", "hits", labels, registry=self.registry
        )
        self.queries = Counter(
            "vllm:external_prefix_cache_queries", "queries", labels, registry=self.registry
        )
        self.prefix_hits = Counter(  # vLLM's own prefix cache: not kvoffload's
            "vllm:prefix_cache_hits", "hits", labels, registry=self.registry
        )
        info = Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            ["block_size", "num_gpu_blocks", "num_gpu_blocks_override", "engine"],
            registry=self.registry,
        )
        for engine in range(engines):
            info.labels(str(block_size), str(num_gpu_blocks), str(num_gpu_blocks), str(engine)).set(
                1
            )
            for source in SOURCES:
                self.by_source.labels("m", str(engine), source)

    def serve(self, engine: int, *, external: int, local: int, computed: int) -> None:
        for source, n in zip(SOURCES, (computed, local, external), strict=True):
            self.by_source.labels("m", str(engine), source).inc(n)
        self.queries.labels("m", str(engine)).inc(external + computed)
        self.hits.labels("m", str(engine)).inc(external)
        self.prefix_hits.labels("m", str(engine)).inc(local)

    def page(self) -> str:
        return generate_latest(self.registry).decode()


def test_reads_vllms_prompt_token_counters_summed_over_engines() -> None:
    vllm = Vllm(engines=2)
    vllm.serve(0, external=640, local=0, computed=60)
    vllm.serve(1, external=128, local=256, computed=316)
    counters = workload.parse_counters(vllm.page())
    assert counters == workload.Counters(
        external_kv_transfer=768,
        local_cache_hit=256,
        local_compute=376,
        external_hits=768,
        external_queries=1144,
    )
    assert counters.prompt_tokens == 1400


def test_counters_vllm_does_not_export_count_as_zero() -> None:
    assert workload.parse_counters("") == workload.Counters()


def test_reads_vllms_cache_size_from_its_cache_config_info() -> None:
    page = Vllm(block_size=128, num_gpu_blocks=16).page()
    assert workload.parse_cache_size(page) == workload.CacheSize(128, 16)
    with pytest.raises(ValueError, match=r"no vllm:cache_config_info .*--disable-log-stats"):
        workload.parse_cache_size("")


def _serve_script_figures() -> dict[str, int]:
    text = "\n".join(
        line for line in SERVE.read_text().splitlines() if not line.lstrip().startswith("#")
    )
    figures = {}
    for flag in ("num-gpu-blocks-override", "prompts", "prompt-tokens", "repeat"):
        found = re.findall(rf"--{flag} (\d+)", text)
        assert len(found) == 1, f"--{flag} in {SERVE.name}: {found}"
        figures[flag] = int(found[0])
    return figures


def test_the_recipes_workload_outgrows_the_cache_it_gives_vllm() -> None:
    """The repeated prompts are out of vLLM's cache: only kvoffload can serve them
    (vLLM's CPU backend stores 128 tokens per block, the recipe leaves it so)."""
    figures = _serve_script_figures()
    workload.check_outgrows(
        workload.CacheSize(128, figures["num-gpu-blocks-override"]),
        prompts=figures["prompts"],
        prompt_tokens=figures["prompt-tokens"],
        repeat=figures["repeat"],
    )


def test_a_workload_that_fits_vllms_cache_is_refused() -> None:
    # What the recipe sent before: two prompts of about 260 tokens, with the 8192 blocks
    # VLLM_CPU_KVCACHE_SPACE=1 gives the tiny model.
    with pytest.raises(ValueError, match=r"fits vLLM's own KV cache \(8192 blocks of 128"):
        workload.check_outgrows(
            workload.CacheSize(128, 8192), prompts=2, prompt_tokens=260, repeat=1
        )
    # One block short of pushing the repeated prompts out.
    with pytest.raises(ValueError, match="fits"):
        workload.check_outgrows(workload.CacheSize(128, 17), prompts=6, prompt_tokens=700, repeat=3)
    workload.check_outgrows(workload.CacheSize(128, 16), prompts=6, prompt_tokens=700, repeat=3)
    with pytest.raises(ValueError, match="shorter than one block"):
        workload.check_outgrows(workload.CacheSize(128, 4), prompts=9, prompt_tokens=100, repeat=1)
    with pytest.raises(ValueError, match="repeat=0"):
        workload.check_outgrows(workload.CacheSize(128, 4), prompts=9, prompt_tokens=700, repeat=0)


def test_prompts_are_distinct_from_their_first_token() -> None:
    prompts = workload.make_prompts(8, 700)
    assert {len(p) for p in prompts} == {700}
    assert len({p[0] for p in prompts}) == 8
    assert all(2 <= t < 502 for p in prompts for t in p)


class FakeServer:
    """A server whose counters move as a vLLM with kvoffload's would, one step late: the
    counters of a request show at the second scrape after it was answered."""

    def __init__(self, vllm: Vllm, *, serve: bool = True) -> None:
        self.vllm = vllm
        self.cached: list[tuple[int, ...]] = []  # what kvoffload holds
        self.serve = serve
        self.block = 128
        self.pending: list[tuple[int, int]] = []
        self.scrapes = 0

    def metrics(self) -> str:
        self.scrapes += 1
        if self.pending and self.scrapes % 2 == 0:
            external, computed = self.pending.pop()
            self.vllm.serve(0, external=external, local=0, computed=computed)
        return self.vllm.page()

    def complete(self, prompt: list[int], max_tokens: int) -> int:
        key = tuple(prompt)
        hit = (len(prompt) // self.block) * self.block if self.serve and key in self.cached else 0
        self.cached.append(key)
        self.pending.append((hit, len(prompt) - hit))
        return len(prompt)


def test_prints_where_each_prompts_tokens_came_from(capsys: pytest.CaptureFixture[str]) -> None:
    server = FakeServer(Vllm(num_gpu_blocks=16))
    assert workload.run(server, prompts=8, prompt_tokens=700, repeat=3, max_tokens=4) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == (
        "vLLM's own KV cache: 16 blocks of 128 tokens; workload: 8 prompts of 700 tokens "
        "(5 full blocks each), then the first 3 again"
    )
    assert lines[1] == (
        "prompt 0: 700 prompt tokens: 0 loaded by kvoffload, 0 from vLLM's prefix cache, "
        "700 computed"
    )
    assert lines[9] == (
        "prompt 0 again: 700 prompt tokens: 640 loaded by kvoffload, "
        "0 from vLLM's prefix cache, 60 computed"
    )
    assert lines[-2:] == [
        'first pass: vllm:prompt_tokens_by_source_total{source="external_kv_transfer"} +0, '
        "vllm:external_prefix_cache_hits_total +0 (of +5600 queried)",
        "repeated prompts: "
        'vllm:prompt_tokens_by_source_total{source="external_kv_transfer"} +1920, '
        "vllm:external_prefix_cache_hits_total +1920 (of +2100 queried)",
    ]


def test_fails_when_kvoffload_served_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    server = FakeServer(Vllm(num_gpu_blocks=16), serve=False)
    assert workload.run(server, prompts=8, prompt_tokens=700, repeat=3, max_tokens=4) == 1
    assert "kvoffload served no prompt token" in capsys.readouterr().err


def test_refuses_to_send_a_workload_that_fits(capsys: pytest.CaptureFixture[str]) -> None:
    server = FakeServer(Vllm(num_gpu_blocks=8192))
    assert workload.run(server, prompts=8, prompt_tokens=700, repeat=3, max_tokens=4) == 1
    assert "fits vLLM's own KV cache" in capsys.readouterr().err
    assert server.cached == []
