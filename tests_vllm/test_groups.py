"""vLLM's KV cache groups → kvoffload's neutral `GroupDescription`, and the start-up refusal.

The spec objects are the ones vLLM 0.32 built on CPU for the tiny models of
``tests_vllm/models.py`` (recorded by ``test_hybrid_baseline.py``), constructed directly:
no engine starts here.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVQuantMode,
    MambaSpec,
    MLAAttentionSpec,
    SinkFullAttentionSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)

from kvoffload.errors import ConfigError
from kvoffload.integrations.vllm.groups import (
    GroupDescription,
    describe_groups,
    refusal,
    to_kv_cache_group,
)
from kvoffload.integrations.vllm.setup import (
    accepted_groups,
    layout_from_kv_cache_config,
    single_group_layout,
)

F32 = torch.float32
BF16 = torch.bfloat16


def attn(name: str) -> str:
    return f"model.layers.{name}.self_attn.attn"


def config(*groups: tuple[list[str], KVCacheSpec]) -> KVCacheConfig:
    """A KV cache config of these groups (no tensors: nothing is allocated here)."""
    return KVCacheConfig(
        num_blocks=256,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(names, spec) for names, spec in groups],
    )


def full(**kw: object) -> FullAttentionSpec:
    args: dict[str, object] = {
        "block_size": 32,
        "num_kv_heads": 1,
        "head_size": 32,
        "dtype": F32,
        **kw,
    }
    return FullAttentionSpec(**args)  # type: ignore[arg-type]


def sliding(window: int = 64) -> SlidingWindowSpec:
    return SlidingWindowSpec(
        block_size=32, num_kv_heads=1, head_size=32, dtype=F32, sliding_window=window
    )


def gdn_state(mode: str = "align") -> MambaSpec:
    """Qwen3-Next's gated delta net state as vLLM 0.32 sized it (block size raised to
    288 so that an attention page covers the state; the state padded to that page)."""
    return MambaSpec(
        block_size=288,
        shapes=((3, 384), (2, 64, 64)),
        dtypes=(BF16, F32),
        page_size_padded=36864,
        mamba_type=MambaAttentionBackendEnum.GDN_ATTN,
        mamba_cache_mode=mode,
    )


def mla() -> MLAAttentionSpec:
    """DeepSeek V3's latent: kv_lora_rank 512 + qk_rope_head_dim 64, bfloat16."""
    return MLAAttentionSpec(
        block_size=32,
        num_kv_heads=1,
        head_size=576,
        dtype=BF16,
        cache_dtype_str="auto",
        max_tp_shards=1,
    )


GEMMA3_HMA_GROUPS = [*(([attn(str(i))], sliding()) for i in range(3)), ([attn("3")], full())]
GEMMA3_HMA = config(*GEMMA3_HMA_GROUPS)
GEMMA3_NO_HMA = config(([attn(str(i)) for i in range(4)], full(sliding_window=64)))
GPT_OSS_HMA = config(
    (["model.layers.0.attn.attn"], sliding()), (["model.layers.1.attn.attn"], full())
)
LLAMA4_HMA = config(
    *(
        (
            [attn(str(i))],
            ChunkedLocalAttentionSpec(
                block_size=32, num_kv_heads=1, head_size=32, dtype=F32, attention_chunk_size=64
            ),
        )
        for i in range(3)
    ),
    ([attn("3")], full()),
)
LLAMA4_NO_HMA = config(([attn(str(i)) for i in range(4)], full(attention_chunk_size=64)))
QWEN3_NEXT_HMA = config(
    *(([f"model.layers.{i}.linear_attn"], gdn_state()) for i in range(3)),
    ([attn("3")], full(block_size=288, dtype=BF16)),
)
DEEPSEEK_V3 = config(([attn("0"), attn("1")], mla()))


def test_gemma3_with_the_hybrid_manager_is_three_window_groups_and_one_full() -> None:
    groups = describe_groups(GEMMA3_HMA)
    assert [g.kind for g in groups] == ["sliding_window"] * 3 + ["full"]
    assert [g.sliding_window for g in groups] == [64, 64, 64, None]
    assert [g.layer_names for g in groups] == [(attn(str(i)),) for i in range(4)]
    for g in groups:
        assert g.block_size == 32
        assert g.page_bytes == (8192,)  # 32 tokens x 1 head x (32 + 32) x 4 bytes
        assert g.content_bytes == (8192,)
        assert (g.page_format, g.dtype) == ("kv", "float32")
        assert (g.num_kv_heads, g.head_size, g.head_size_v) == (1, 32, 32)
    assert groups[0].name == "group 0"
    assert groups[0].spec == "SlidingWindowSpec with sliding_window=64"


def test_gpt_oss_alternates_a_window_group_and_a_full_group() -> None:
    groups = describe_groups(GPT_OSS_HMA)
    assert [(g.kind, g.sliding_window) for g in groups] == [("sliding_window", 64), ("full", None)]


def test_tokens_retained_below_the_window_widen_the_window() -> None:
    # vLLM keeps them for multi-token drafts: a hit must bring them back too, so the
    # group stores and loads a window that covers them (never fewer blocks than vLLM reads).
    spec = SlidingWindowSpec(
        block_size=32,
        num_kv_heads=1,
        head_size=32,
        dtype=F32,
        sliding_window=64,
        extra_retained_tokens=32,
    )
    (group,) = describe_groups(config(([attn("0")], spec)))
    assert (group.kind, group.sliding_window) == ("sliding_window", 96)
    (plain,) = describe_groups(config(([attn("0")], sliding(64))))
    assert plain.sliding_window == 64


def test_without_the_hybrid_manager_windows_arrive_on_one_full_group() -> None:
    (gemma,) = describe_groups(GEMMA3_NO_HMA)
    assert (gemma.kind, gemma.sliding_window, gemma.attention_chunk_size) == ("full", 64, None)
    assert len(gemma.layer_names) == 4
    assert gemma.bytes_per_block == 4 * 8192
    (llama,) = describe_groups(LLAMA4_NO_HMA)
    assert (llama.kind, llama.sliding_window, llama.attention_chunk_size) == ("full", None, 64)


def test_llama4_chunked_groups() -> None:
    groups = describe_groups(LLAMA4_HMA)
    assert [g.kind for g in groups] == ["chunked"] * 3 + ["full"]
    assert [g.attention_chunk_size for g in groups] == [64, 64, 64, None]


def test_qwen3_next_states_are_recurrent_with_padded_pages() -> None:
    groups = describe_groups(QWEN3_NEXT_HMA)
    assert [g.kind for g in groups] == ["recurrent"] * 3 + ["full"]
    state, attention = groups[0], groups[3]
    assert state.page_format == "state"
    assert state.block_size == 288  # tokens between snapshots
    assert state.page_bytes == (36864,)
    assert state.content_bytes == (3 * 384 * 2 + 2 * 64 * 64 * 4,)  # conv bf16 + ssm f32
    assert state.dtype == "int8"  # vLLM registers a state layer as raw bytes
    assert (state.num_kv_heads, state.head_size) == (None, None)
    assert (attention.page_format, attention.dtype, attention.page_bytes) == (
        "kv",
        "bfloat16",
        (288 * 64 * 2,),
    )


def test_a_state_without_prefix_caching_is_not_cacheable() -> None:
    (group,) = describe_groups(config((["model.layers.0.mixer"], gdn_state("none"))))
    assert (group.kind, group.prefix_cacheable) == ("none", False)


def test_mla_is_one_full_group_of_latent_pages() -> None:
    (group,) = describe_groups(DEEPSEEK_V3)
    assert (group.kind, group.page_format, group.dtype) == ("full", "mla", "bfloat16")
    assert group.page_bytes == (32 * 576 * 2,) * 2
    assert (group.head_size, group.head_size_v) == (576, 0)


def test_fp8_pages_keep_their_kv_format_and_dtype() -> None:
    spec = full(dtype=torch.uint8, kv_quant_mode=KVQuantMode.FP8_PER_TENSOR)
    (group,) = describe_groups(config(([attn("0")], spec)))
    assert (group.page_format, group.dtype, group.page_bytes) == ("kv", "uint8", (32 * 64,))


def test_per_token_head_scales_make_a_page_opaque() -> None:
    spec = full(dtype=torch.int8, kv_quant_mode=KVQuantMode.INT8_PER_TOKEN_HEAD)
    (group,) = describe_groups(config(([attn("0")], spec)))
    assert group.page_format == "opaque"


def test_descriptions_are_frozen_plain_data() -> None:
    (group,) = describe_groups(DEEPSEEK_V3)
    assert dataclasses.is_dataclass(group)
    assert not hasattr(group, "__dict__")
    with pytest.raises(dataclasses.FrozenInstanceError):
        group.kind = "none"  # type: ignore[misc]
    for f in dataclasses.fields(GroupDescription):
        value = getattr(group, f.name)
        items = value if isinstance(value, tuple) else (value,)
        assert all(isinstance(v, (str, int, bool, type(None))) for v in items), f.name


# -- what the connector accepts, and the refusal ------------------------------------------


@pytest.mark.parametrize(
    "kv_config",
    [
        GEMMA3_NO_HMA,
        LLAMA4_NO_HMA,
        DEEPSEEK_V3,
        GEMMA3_HMA,
        GPT_OSS_HMA,
        LLAMA4_HMA,
        QWEN3_NEXT_HMA,
    ],
    ids=["gemma3-no-hma", "llama4-no-hma", "mla", "gemma3", "gpt-oss", "llama4", "qwen3-next"],
)
def test_every_family_of_models_py_is_accepted(kv_config: KVCacheConfig) -> None:
    assert refusal(describe_groups(kv_config)) is None
    assert accepted_groups(kv_config) == describe_groups(kv_config)


def test_fp8_and_uint8_pages_are_accepted() -> None:
    for dtype in (torch.uint8, torch.float8_e4m3fn):
        spec = full(dtype=dtype, kv_quant_mode=KVQuantMode.FP8_PER_TENSOR)
        layout, _, opaque = single_group_layout(config(([attn("0")], spec)))
        assert (layout.dtype, layout.bytes_per_layer_block, opaque) == (
            str(dtype).removeprefix("torch."),
            32 * 64,
            False,
        )


def test_groups_become_kvoffload_groups_with_their_kind_window_chunk_and_page() -> None:
    gemma = [to_kv_cache_group(g) for g in describe_groups(GEMMA3_HMA)]
    assert [(g.name, g.kind, g.window, g.block_size) for g in gemma] == [
        ("g0", "sliding_window", 64, 32),
        ("g1", "sliding_window", 64, 32),
        ("g2", "sliding_window", 64, 32),
        ("g3", "full", None, 32),
    ]
    assert {(g.num_layers, g.bytes_per_layer_block, g.dtype) for g in gemma} == {
        (1, 8192, "float32")
    }
    llama = [to_kv_cache_group(g) for g in describe_groups(LLAMA4_HMA)]
    assert [(g.kind, g.chunk) for g in llama] == [("chunked", 64)] * 3 + [("full", None)]
    qwen = [to_kv_cache_group(g) for g in describe_groups(QWEN3_NEXT_HMA)]
    assert [(g.kind, g.block_size, g.bytes_per_layer_block) for g in qwen] == [
        ("recurrent", 288, 36864)
    ] * 3 + [("full", 288, 36864)]
    assert qwen[0].dtype == "int8"
    # Hybrid manager off: the window stays on the description, the group is full.
    (promoted,) = [to_kv_cache_group(g) for g in describe_groups(GEMMA3_NO_HMA)]
    assert (promoted.kind, promoted.window, promoted.num_layers) == ("full", None, 4)
    (state,) = [
        to_kv_cache_group(g)
        for g in describe_groups(config((["model.layers.0.mixer"], gdn_state("none"))))
    ]
    assert not state.cacheable


def test_single_group_layouts_keep_kv_pages_and_make_mla_pages_opaque() -> None:
    layout, names, opaque = single_group_layout(GEMMA3_NO_HMA)
    assert (layout.dtype, layout.num_kv_heads, layout.head_size, opaque) == (
        "float32",
        1,
        32,
        False,
    )
    assert len(names) == 4
    layout, names, opaque = single_group_layout(DEEPSEEK_V3)
    assert opaque
    assert (layout.dtype, layout.bytes_per_layer_block, layout.block_size) == (
        "uint8",
        32 * 576 * 2,
        32,
    )
    assert names == [attn("0"), attn("1")]


SINK = config(
    (
        [attn("0")],
        SinkFullAttentionSpec(block_size=32, num_kv_heads=1, head_size=32, dtype=F32, sink_len=4),
    )
)
PER_TOKEN_HEAD = config(
    ([attn("0")], full(dtype=torch.int8, kv_quant_mode=KVQuantMode.INT8_PER_TOKEN_HEAD))
)
NOT_CACHEABLE = config((["model.layers.0.mixer"], gdn_state("none")))


@pytest.mark.parametrize(
    ("kv_config", "message"),
    [
        (
            SINK,
            r"^group 0: SinkFullAttentionSpec \(1 layer, e\.g\. model\.layers\.0\.self_attn"
            r"\.attn\): kind full: kvoffload does not know which blocks a hit needs from a "
            r"SinkFullAttentionSpec group",
        ),
        (PER_TOKEN_HEAD, r"^group 0: FullAttentionSpec .*: kind full: packed or per-token-head"),
        (NOT_CACHEABLE, r"^group 0: MambaSpec with mamba_cache_mode=none .*: kind none: .*nothing"),
        (config(), r"no KV cache groups"),
        (
            config(*GEMMA3_HMA_GROUPS[:3], ([attn("3")], SINK.kv_cache_groups[0].kv_cache_spec)),
            r"^group 3: SinkFullAttentionSpec .*kind full",
        ),
    ],
    ids=["sink", "per-token-head", "not-cacheable", "no-groups", "gemma3-with-a-sink-group"],
)
def test_the_refusal_names_the_group_its_kind_and_why(
    kv_config: KVCacheConfig, message: str
) -> None:
    reason = refusal(describe_groups(kv_config))
    assert reason is not None
    assert re.search(message, reason), reason


@pytest.mark.parametrize(
    ("kv_config", "message"),
    [
        (SINK, "cannot offload this model's KV cache: group 0: SinkFullAttentionSpec .*kind full"),
        (PER_TOKEN_HEAD, "group 0: FullAttentionSpec .*per-token-head"),
    ],
    ids=["sink", "per-token-head"],
)
def test_the_connector_refuses_at_start_up_with_that_message(
    kv_config: KVCacheConfig, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        accepted_groups(kv_config)
    with pytest.raises(ConfigError, match=message):
        layout_from_kv_cache_config(kv_config)


def test_the_single_group_layout_takes_one_full_group_only() -> None:
    layout, names = layout_from_kv_cache_config(config(([attn("0"), attn("1")], full())))
    assert names == [attn("0"), attn("1")]
    assert (layout.num_layers, layout.bytes_per_layer_block) == (2, 8192)
    layout, _ = layout_from_kv_cache_config(LLAMA4_NO_HMA)
    assert layout.num_layers == 4
    with pytest.raises(ConfigError, match=r"expected one full-attention group, got 4"):
        layout_from_kv_cache_config(GEMMA3_HMA)


def test_layers_of_one_kind_with_different_pages_are_refused() -> None:
    # vLLM wraps them in UniformTypeKVCacheSpecs (e.g. two head sizes, all full attention).
    wide = full(head_size=64)
    specs = {attn("0"): full(), attn("1"): wide}
    uniform = UniformTypeKVCacheSpecs(block_size=32, kv_cache_specs=specs)
    (group,) = describe_groups(config(([attn("0"), attn("1")], uniform)))
    assert group.kind == "full"
    assert group.page_bytes == (8192, 16384)
    assert group.uniform_page_bytes is None
    assert group.bytes_per_block == 8192 + 16384
    assert group.spec == "UniformTypeKVCacheSpecs of FullAttentionSpec"
    reason = refusal([group])
    assert reason is not None
    assert "kind full: its layers have pages of different sizes [8192, 16384]" in reason


def test_k_and_v_of_two_head_sizes_are_moved_as_opaque_pages() -> None:
    spec = full(head_size=64, head_size_v=32)
    layout, _, opaque = single_group_layout(config(([attn("0")], spec)))
    assert opaque
    assert (layout.dtype, layout.bytes_per_layer_block) == ("uint8", spec.page_size_bytes)
    assert spec.page_size_bytes == 32 * (64 + 32) * 4
