"""A bad ``kv_connector_extra_config`` stops vLLM's start-up before any connector exists.

vLLM asks the connector class for its KV cache layout in the engine core (the scheduler
process) before it profiles the model, allocates the KV cache or builds a connector in
any process; kvoffload checks the settings there, so a misspelt key is the first error.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from engine_runs import kvoffload_config, new_llm
from harness import vllm_config
from models import QWEN3_NEXT, write_model

from kvoffload.errors import ConfigError
from kvoffload.integrations.vllm import KVOffloadConnector


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            {"cpu_byte": "1GiB"},
            r"unknown key 'cpu_byte' \(did you mean 'cpu_bytes'\?\); valid keys: block_size, "
            r"(\w+, )*cpu_bytes, .*num_cpu_blocks",
        ),
        ({"cpu_bytes": "lots"}, r"kv_connector_extra_config: .*cpu_bytes.*'lots'"),
        ({"num_cpu_blocks": 8, "store_mode": "sometimes"}, "store_mode"),
        ({"num_cpu_blocks": 8, "block_size": 32}, "block_size=32"),
    ],
)
def test_the_layout_query_checks_the_settings(
    model_dir: Path, extra: dict[str, Any], message: str
) -> None:
    config = vllm_config(model_dir, extra, num_gpu_blocks=16)
    with pytest.raises(ConfigError, match=message):
        KVOffloadConnector.get_required_kvcache_layout(config)


def test_good_settings_need_no_layout(model_dir: Path) -> None:
    config = vllm_config(model_dir, {"cpu_bytes": "1MiB"}, num_gpu_blocks=16)
    assert KVOffloadConnector.get_required_kvcache_layout(config) is None


def test_a_misspelt_key_stops_the_engine_before_any_connector_is_built(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    built: list[object] = []
    original = KVOffloadConnector.__init__

    def recording_init(self: KVOffloadConnector, *args: Any, **kwargs: Any) -> None:
        built.append(kwargs.get("role", args[1] if len(args) > 1 else None))
        original(self, *args, **kwargs)

    monkeypatch.setattr(KVOffloadConnector, "__init__", recording_init)
    with pytest.raises(ConfigError, match=r"unknown key 'num_cpu_blokcs'.*valid keys"):
        new_llm(model_dir, kvoffload_config({"num_cpu_blokcs": 64}))
    assert built == []  # neither a worker nor the scheduler got as far as a connector


def test_a_recurrent_hybrid_passes_the_layout_query_with_the_hybrid_manager_on(
    tmp_path: Path,
) -> None:
    qwen3_next = write_model(tmp_path / "qwen3-next", QWEN3_NEXT)
    config = vllm_config(qwen3_next, {"num_cpu_blocks": 8}, num_gpu_blocks=16)
    assert not config.scheduler_config.disable_hybrid_kv_cache_manager
    assert KVOffloadConnector.get_required_kvcache_layout(config) is None


def test_a_recurrent_hybrid_is_refused_by_the_layout_query_with_the_hybrid_manager_off(
    tmp_path: Path,
) -> None:
    # Without it, vLLM loads the model and then fails with "Failed to promote local KV
    # cache specs to one unified type".
    qwen3_next = write_model(tmp_path / "qwen3-next", QWEN3_NEXT)
    config = vllm_config(qwen3_next, {"num_cpu_blocks": 8}, num_gpu_blocks=16)
    config.scheduler_config.disable_hybrid_kv_cache_manager = True
    with pytest.raises(
        ConfigError,
        match=r"cannot offload Qwen3NextForCausalLM with vLLM's hybrid KV cache manager off",
    ):
        KVOffloadConnector.get_required_kvcache_layout(config)
