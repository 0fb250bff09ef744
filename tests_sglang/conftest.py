"""Fixtures of the SGLang HiCache backend's tests: SGLang's real host KV pools (MHA and
MLA, both layouts) on CPU, and the backend built through SGLang's own backend factory."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

# SGLang's modules warn on import about what a CPU machine lacks (CUDA kernels, torch.jit):
# import them once here with those warnings silenced; the tests then run with every
# warning an error.
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import sglang.srt.managers.cache_controller  # noqa: F401
    from sglang.srt.mem_cache.device_pool_info import (
        KVBufferLayout,
        KVBuffers,
        MHABufferInfo,
        MLABufferInfo,
    )
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
    from sglang.srt.mem_cache.storage import StorageBackendFactory

LAYERS, HEADS, HEAD_DIM, PAGE = 2, 2, 8, 4
LORA, ROPE = 8, 4
HOST_TOKENS = 256  # 64 pages
DEVICE_TOKENS = 64


def _ptrs(tensors: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.uint64)


def make_pool(kind: str, layout: str) -> Any:
    """SGLang's own host pool (``MHATokenToKVPoolHost`` or ``MLATokenToKVPoolHost``) on CPU."""
    cpu = torch.device("cpu")
    if kind == "mha":
        k = tuple(torch.zeros(DEVICE_TOKENS, HEADS, HEAD_DIM) for _ in range(LAYERS))
        v = tuple(torch.zeros(DEVICE_TOKENS, HEADS, HEAD_DIM) for _ in range(LAYERS))
        info = MHABufferInfo(
            buffers=KVBuffers(
                k=k, v=v, k_data_ptrs=_ptrs(k), v_data_ptrs=_ptrs(v), layout=KVBufferLayout.NHD
            ),
            page_size=PAGE,
            head_num=HEADS,
            head_dim=HEAD_DIM,
            v_head_dim=HEAD_DIM,
            dtype=torch.float32,
            device=cpu,
        )
        return MHATokenToKVPoolHost(
            info,
            2.0,
            0,
            PAGE,
            layout,
            pin_memory=False,
            device="cpu",
            device_capacity_tokens=DEVICE_TOKENS,
            start_layer=0,
            end_layer=LAYERS,
            host_token_capacity=HOST_TOKENS,
        )
    rows = tuple(torch.zeros(DEVICE_TOKENS, 1, LORA + ROPE) for _ in range(LAYERS))
    minfo = MLABufferInfo(
        buffers=rows,
        data_ptrs=_ptrs(rows),
        layer_indices=tuple(range(LAYERS)),
        device_layer_num=LAYERS,
        page_size=PAGE,
        kv_lora_rank=LORA,
        qk_rope_head_dim=ROPE,
        kv_cache_dim=LORA + ROPE,
        dtype=torch.float32,
        device=cpu,
    )
    return MLATokenToKVPoolHost(
        minfo,
        2.0,
        0,
        PAGE,
        layout,
        pin_memory=False,
        device="cpu",
        device_capacity_tokens=DEVICE_TOKENS,
        start_layer=0,
        end_layer=LAYERS,
        target_layer_num=LAYERS,
        host_token_capacity=HOST_TOKENS,
    )


def storage_config(extra: dict[str, Any], *, mla: bool = False, **kw: Any) -> HiCacheStorageConfig:
    """SGLang's storage config as its cache controller builds it for one rank."""
    fields: dict[str, Any] = {
        "tp_rank": 0,
        "tp_size": 1,
        "pp_rank": 0,
        "pp_size": 1,
        "attn_cp_rank": 0,
        "attn_cp_size": 1,
        "is_mla_model": mla,
        "enable_storage_metrics": False,
        "is_page_first_layout": False,
        "model_name": "test/tiny-model",
    }
    fields.update(kw)
    return HiCacheStorageConfig(extra_config=extra, **fields)


def extra_config(tiers: list[dict[str, Any]], **more: Any) -> dict[str, Any]:
    """The dynamic backend's extra config, as in docs/sglang.md."""
    return {
        "backend_name": "kvoffload",
        "module_path": "kvoffload.integrations.sglang",
        "class_name": "KvOffloadHiCacheStorage",
        "interface_v1": 1,
        "tiers": tiers,
        **more,
    }


def disk_tier(path: Path, capacity_bytes: int = 1 << 20) -> dict[str, Any]:
    return {"kind": "disk", "path": str(path), "capacity_bytes": capacity_bytes}


Factory = Callable[..., HiCacheStorage]


@pytest.fixture
def backend_factory() -> Iterator[Factory]:
    """Builds backends as SGLang's cache controller does (the factory, then
    ``register_mem_pool_host``) and closes them at the end."""
    made: list[HiCacheStorage] = []

    def make(pool: Any, extra: dict[str, Any], **kw: Any) -> HiCacheStorage:
        cfg = storage_config(extra, mla=isinstance(pool, MLATokenToKVPoolHost), **kw)
        backend = StorageBackendFactory.create_backend("dynamic", cfg, pool)
        made.append(backend)
        backend.register_mem_pool_host(pool)
        return backend

    yield make
    for backend in made:
        backend.close()  # type: ignore[attr-defined]
