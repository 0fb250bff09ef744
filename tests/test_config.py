from __future__ import annotations

import os

import pytest
import torch
from pydantic import ValidationError

from kvoffload.config import KVLayout, OffloadConfig
from kvoffload.errors import ConfigError, KvOffloadError, LayoutMismatchError

GIB = 1 << 30


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.upper().startswith("KVOFFLOAD_"):
            monkeypatch.delenv(name)


EXACTLY_ONE = (
    r"exactly one of num_cpu_blocks \(env KVOFFLOAD_NUM_CPU_BLOCKS\) "
    r"and cpu_bytes \(env KVOFFLOAD_CPU_BYTES\)"
)


def layout(**overrides: object) -> KVLayout:
    values: dict[str, object] = {
        "num_layers": 2,
        "num_kv_heads": 4,
        "head_size": 8,
        "dtype": "float16",
        "block_size": 16,
    }
    values.update(overrides)
    return KVLayout(**values)


# -- OffloadConfig ------------------------------------------------------------------------


def test_defaults_with_num_cpu_blocks() -> None:
    cfg = OffloadConfig(num_cpu_blocks=100)
    assert cfg.num_cpu_blocks == 100
    assert cfg.cpu_bytes is None
    assert cfg.block_size == 16
    assert cfg.store_mode == "eager"
    assert cfg.pin_memory == "auto"
    assert cfg.pin_chunk_bytes == GIB
    assert cfg.restore_evicted is False
    assert cfg.enable_events is False


def test_every_field_has_a_description() -> None:
    for name, info in OffloadConfig.model_fields.items():
        assert info.description, name
    for name, info in KVLayout.model_fields.items():
        assert info.description, name


BAD_OFFLOAD_VALUES = [
    ("block_size", 0),
    ("block_size", 65537),
    ("num_cpu_blocks", 0),
    ("num_cpu_blocks", (1 << 31) + 1),
    ("store_mode", "sometimes"),
    ("lazy_offload_blocks", 0),
    ("lazy_offload_blocks", (1 << 24) + 1),
    ("max_store_blocks_per_step", 0),
    ("max_store_blocks_per_step", (1 << 24) + 1),
    ("pin_memory", "maybe"),
    ("pin_chunk_bytes", 4096),
    ("pin_chunk_bytes", 512 * GIB),
    ("poll_interval_s", 0),
    ("poll_interval_s", 0.5),
    ("model_id", "m" * 1025),
    ("hash_salt", "s" * 1025),
    ("restore_evicted", "perhaps"),
    ("enable_events", "perhaps"),
]


@pytest.mark.parametrize(("field", "value"), BAD_OFFLOAD_VALUES)
def test_out_of_bounds_field_names_field_env_var_and_value(field: str, value: object) -> None:
    values: dict[str, object] = {"num_cpu_blocks": 8, field: value}
    with pytest.raises(ConfigError) as info:
        OffloadConfig(**values)
    msg = str(info.value)
    assert field in msg
    assert f"KVOFFLOAD_{field.upper()}" in msg
    assert repr(value)[:40] in msg
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value, KvOffloadError)


@pytest.mark.parametrize(("field", "value"), BAD_OFFLOAD_VALUES)
def test_out_of_bounds_env_var_is_reported(
    monkeypatch: pytest.MonkeyPatch, field: str, value: object
) -> None:
    if field != "num_cpu_blocks":
        monkeypatch.setenv("KVOFFLOAD_NUM_CPU_BLOCKS", "8")
    monkeypatch.setenv(f"KVOFFLOAD_{field.upper()}", str(value))
    with pytest.raises(ConfigError) as info:
        OffloadConfig()
    msg = str(info.value)
    assert field in msg
    assert f"KVOFFLOAD_{field.upper()}" in msg
    assert repr(str(value))[:40] in msg


def test_env_vars_are_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVOFFLOAD_NUM_CPU_BLOCKS", "123")
    monkeypatch.setenv("KVOFFLOAD_BLOCK_SIZE", "32")
    monkeypatch.setenv("KVOFFLOAD_STORE_MODE", "lazy")
    monkeypatch.setenv("KVOFFLOAD_PIN_MEMORY", "never")
    monkeypatch.setenv("KVOFFLOAD_PIN_CHUNK_BYTES", "2GiB")
    monkeypatch.setenv("KVOFFLOAD_ENABLE_EVENTS", "true")
    monkeypatch.setenv("KVOFFLOAD_MODEL_ID", "llama@abc123")
    cfg = OffloadConfig()
    assert cfg.num_cpu_blocks == 123
    assert cfg.block_size == 32
    assert cfg.store_mode == "lazy"
    assert cfg.pin_memory == "never"
    assert cfg.pin_chunk_bytes == 2 * GIB
    assert cfg.enable_events is True
    assert cfg.model_id == "llama@abc123"


def test_keyword_overrides_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVOFFLOAD_NUM_CPU_BLOCKS", "123")
    assert OffloadConfig(num_cpu_blocks=5).num_cpu_blocks == 5


def test_neither_size_is_an_error() -> None:
    with pytest.raises(ConfigError, match=EXACTLY_ONE):
        OffloadConfig()


def test_both_sizes_is_an_error() -> None:
    with pytest.raises(ConfigError, match=EXACTLY_ONE) as info:
        OffloadConfig(num_cpu_blocks=4, cpu_bytes="1GiB")
    assert "num_cpu_blocks=4" in str(info.value)


def test_both_sizes_from_env_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVOFFLOAD_NUM_CPU_BLOCKS", "4")
    monkeypatch.setenv("KVOFFLOAD_CPU_BYTES", "1GiB")
    with pytest.raises(ConfigError, match="exactly one"):
        OffloadConfig()


@pytest.mark.parametrize(
    ("text", "nbytes"),
    [("1GiB", GIB), ("1.5GiB", 3 * GIB // 2), ("64MiB", 64 << 20), ("1000000", 10**6)],
)
def test_cpu_bytes_parses_units(text: str, nbytes: int) -> None:
    assert OffloadConfig(cpu_bytes=text).cpu_bytes == nbytes


@pytest.mark.parametrize("text", ["lots", "-1GiB", "0", "1 parsec"])
def test_cpu_bytes_bad_values(text: str) -> None:
    with pytest.raises(ConfigError, match="cpu_bytes") as info:
        OffloadConfig(cpu_bytes=text)
    assert "KVOFFLOAD_CPU_BYTES" in str(info.value)


def test_cpu_bytes_resolves_to_whole_blocks() -> None:
    lay = layout()
    per_block = lay.bytes_per_block  # 2 * 16 * 4 * 8 * 2 bytes * 2 layers
    assert per_block == 4096
    assert OffloadConfig(cpu_bytes="1GiB").resolve_num_cpu_blocks(lay) == GIB // 4096
    # a remainder is dropped, never rounded up
    cfg = OffloadConfig(cpu_bytes=3 * per_block + per_block - 1)
    assert cfg.resolve_num_cpu_blocks(lay) == 3


def test_cpu_bytes_env_resolves(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVOFFLOAD_CPU_BYTES", "1MiB")
    assert OffloadConfig().resolve_num_cpu_blocks(layout()) == (1 << 20) // 4096


def test_num_cpu_blocks_resolves_as_given() -> None:
    assert OffloadConfig(num_cpu_blocks=7).resolve_num_cpu_blocks(layout()) == 7


def test_cpu_bytes_below_one_block() -> None:
    with pytest.raises(ConfigError, match=r"cpu_bytes=4095 holds no block of 4096 bytes"):
        OffloadConfig(cpu_bytes=4095).resolve_num_cpu_blocks(layout())


def test_block_size_must_match_layout() -> None:
    with pytest.raises(ConfigError, match=r"block_size=16 does not match .*block_size=32"):
        OffloadConfig(num_cpu_blocks=4).resolve_num_cpu_blocks(layout(block_size=32))


def test_offload_config_is_frozen() -> None:
    cfg = OffloadConfig(num_cpu_blocks=4)
    with pytest.raises(ConfigError, match="frozen: cannot set num_cpu_blocks=5"):
        cfg.num_cpu_blocks = 5  # type: ignore[misc]
    assert cfg.num_cpu_blocks == 4


def test_extra_fields_forbidden() -> None:
    with pytest.raises(ConfigError, match="num_gpu_blocks") as info:
        OffloadConfig(num_cpu_blocks=4, num_gpu_blocks=4)
    assert "Extra inputs are not permitted" in str(info.value)


def test_config_error_chains_the_validation_error() -> None:
    with pytest.raises(ConfigError) as info:
        OffloadConfig(num_cpu_blocks=0)
    assert isinstance(info.value.__cause__, ValidationError)


# -- KVLayout -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("num_layers", 0),
        ("num_layers", 4097),
        ("num_kv_heads", 0),
        ("num_kv_heads", 4097),
        ("head_size", 0),
        ("head_size", 65537),
        ("block_size", 0),
        ("block_size", 65537),
        ("dtype", "float64"),
        ("kind", "heads_first"),
    ],
)
def test_layout_field_out_of_bounds(field: str, value: object) -> None:
    with pytest.raises(ConfigError) as info:
        layout(**{field: value})
    msg = str(info.value)
    assert msg.startswith("invalid KVLayout")
    assert field in msg
    assert repr(value) in msg


def test_layout_is_frozen_and_strict() -> None:
    lay = layout()
    with pytest.raises(ConfigError, match="frozen"):
        lay.num_layers = 3  # type: ignore[misc]
    with pytest.raises(ConfigError, match="Extra inputs"):
        layout(num_heads=3)


@pytest.mark.parametrize("field", ["num_layers", "num_kv_heads", "head_size", "block_size"])
@pytest.mark.parametrize("value", [True, "4", 4.0])
def test_layout_counts_are_not_coerced(field: str, value: object) -> None:
    """As `KVCacheGroup`: a bool, a string or a float is refused where an int is meant."""
    with pytest.raises(ConfigError, match=rf"invalid KVLayout: {field}: .*\(got {value!r}\)"):
        layout(**{field: value})


@pytest.mark.parametrize(
    ("dtype", "size"),
    [
        ("float32", 4),
        ("float16", 2),
        ("bfloat16", 2),
        ("float8_e4m3fn", 1),
        ("float8_e5m2", 1),
        ("int8", 1),
        ("uint8", 1),
    ],
)
def test_layout_sizes(dtype: str, size: int) -> None:
    lay = layout(dtype=dtype)
    assert lay.torch_dtype == getattr(torch, dtype)
    assert lay.element_size == size
    assert lay.block_shape == (2, 16, 4, 8)
    assert lay.bytes_per_layer_block == 2 * 16 * 4 * 8 * size
    assert lay.bytes_per_block == 2 * lay.bytes_per_layer_block


def test_tensor_shape_by_kind() -> None:
    assert layout().tensor_shape(10) == (10, 2, 16, 4, 8)
    assert layout(kind="kv_first").tensor_shape(10) == (2, 10, 16, 4, 8)


def kv(
    kind: str = "blocks_first", *, blocks: int = 6, layers: int = 2, **kw: object
) -> list[torch.Tensor]:
    dtype = kw.get("dtype", torch.float16)
    assert isinstance(dtype, torch.dtype)
    shape = (blocks, 2, 16, 4, 8) if kind == "blocks_first" else (2, blocks, 16, 4, 8)
    return [torch.zeros(shape, dtype=dtype) for _ in range(layers)]


@pytest.mark.parametrize("kind", ["blocks_first", "kv_first"])
def test_from_tensors_infers_each_kind(kind: str) -> None:
    tensors = kv(kind)
    lay = KVLayout.from_tensors(tensors)
    assert lay == layout(kind=kind)
    assert lay.num_gpu_blocks(tensors) == 6
    assert KVLayout.from_tensors(tensors, kind=kind, block_size=16) == lay  # type: ignore[arg-type]


def test_from_tensors_other_dtype() -> None:
    lay = KVLayout.from_tensors(kv(dtype=torch.bfloat16))
    assert lay.dtype == "bfloat16"


def test_from_tensors_ambiguous_needs_kind() -> None:
    tensors = [torch.zeros(2, 2, 16, 4, 8, dtype=torch.float16) for _ in range(2)]
    with pytest.raises(LayoutMismatchError, match="ambiguous"):
        KVLayout.from_tensors(tensors)
    assert KVLayout.from_tensors(tensors, kind="kv_first").kind == "kv_first"
    lay = KVLayout.from_tensors(tensors, kind="blocks_first")
    assert lay.num_gpu_blocks(tensors) == 2


def test_from_tensors_without_kv_dimension() -> None:
    with pytest.raises(LayoutMismatchError, match="no K/V dimension"):
        KVLayout.from_tensors([torch.zeros(3, 3, 16, 4, 8, dtype=torch.float16)])


def test_from_tensors_kind_disagrees() -> None:
    with pytest.raises(LayoutMismatchError, match="is not a kv_first layout"):
        KVLayout.from_tensors(kv("blocks_first"), kind="kv_first")
    with pytest.raises(LayoutMismatchError, match="is not a blocks_first layout"):
        KVLayout.from_tensors(kv("kv_first"), kind="blocks_first")


def test_from_tensors_block_size_disagrees() -> None:
    with pytest.raises(LayoutMismatchError, match="block dimension 16 != block_size 32"):
        KVLayout.from_tensors(kv(), block_size=32)


def test_from_tensors_empty_and_wrong_rank() -> None:
    with pytest.raises(LayoutMismatchError, match="no KV tensors"):
        KVLayout.from_tensors([])
    with pytest.raises(LayoutMismatchError, match="5-d"):
        KVLayout.from_tensors([torch.zeros(6, 2, 16, 32, dtype=torch.float16)])


def test_from_tensors_unsupported_dtype_is_a_layout_mismatch() -> None:
    with pytest.raises(LayoutMismatchError, match="dtype") as info:
        KVLayout.from_tensors(kv(dtype=torch.float64))
    assert isinstance(info.value.__cause__, ConfigError)


def test_from_tensors_layers_disagree() -> None:
    tensors = kv(layers=3)
    tensors[2] = torch.zeros(7, 2, 16, 4, 8, dtype=torch.float16)
    with pytest.raises(LayoutMismatchError, match=r"layer 2: shape \(7, 2, 16, 4, 8\)"):
        KVLayout.from_tensors(tensors)
    tensors[2] = torch.zeros(6, 2, 16, 4, 8, dtype=torch.float32)
    with pytest.raises(LayoutMismatchError, match=r"layer 2: dtype torch\.float32"):
        KVLayout.from_tensors(tensors)


def test_from_tensors_rejects_non_contiguous() -> None:
    tensors = kv()
    tensors[1] = torch.zeros(6, 2, 16, 8, 4, dtype=torch.float16).transpose(3, 4)
    assert tensors[1].shape == tensors[0].shape
    with pytest.raises(LayoutMismatchError, match="layer 1: tensor is not contiguous"):
        KVLayout.from_tensors(tensors)


def test_num_gpu_blocks_checks_layer_count() -> None:
    lay = layout(num_layers=3)
    with pytest.raises(LayoutMismatchError, match="expected 3 layer tensors, got 2"):
        lay.num_gpu_blocks(kv())


def test_num_gpu_blocks_checks_shape_dtype_and_kind() -> None:
    with pytest.raises(LayoutMismatchError, match="does not match kv_first layout"):
        layout(kind="kv_first").num_gpu_blocks(kv("blocks_first"))
    with pytest.raises(LayoutMismatchError, match=r"dtype torch\.float16 != layout dtype bfloat16"):
        layout(dtype="bfloat16").num_gpu_blocks(kv())
    with pytest.raises(LayoutMismatchError, match="does not match blocks_first layout"):
        layout(head_size=16).num_gpu_blocks(kv())
    with pytest.raises(LayoutMismatchError, match="5-d"):
        layout(num_layers=1).num_gpu_blocks([torch.zeros(4, dtype=torch.float16)])


def test_num_gpu_blocks_checks_device() -> None:
    tensors = kv()
    tensors[1] = torch.empty(tensors[0].shape, dtype=torch.float16, device="meta")
    with pytest.raises(LayoutMismatchError, match="layer 1: device meta differs"):
        layout().num_gpu_blocks(tensors)


@pytest.mark.parametrize("kind", ["blocks_first", "kv_first"])
def test_num_gpu_blocks_counts_blocks(kind: str) -> None:
    assert layout(kind=kind).num_gpu_blocks(kv(kind, blocks=11)) == 11


def test_layout_mismatch_is_a_value_error() -> None:
    assert issubclass(LayoutMismatchError, ValueError)
    assert issubclass(LayoutMismatchError, KvOffloadError)


def test_unknown_field_names_no_environment_variable() -> None:
    with pytest.raises(ConfigError, match=r"bogus: Extra inputs are not permitted") as info:
        OffloadConfig(num_cpu_blocks=1, bogus=1)
    assert "KVOFFLOAD_BOGUS" not in str(info.value)


@pytest.mark.parametrize(
    ("setting", "value"),
    [("restore_evicted", True), ("store_admission", "seen_twice"), ("hold_blocks_on_finish", True)],
)
def test_lazy_stores_refuse_the_eager_only_settings_naming_them(
    setting: str, value: object
) -> None:
    """A lazy store keeps no request cursor and scans the engine's eviction order: a
    setting of eager stores is refused with it, never silently ignored."""
    with pytest.raises(ConfigError, match=rf"store_mode='lazy'.*{setting}={value!r}"):
        OffloadConfig(num_cpu_blocks=4, store_mode="lazy", **{setting: value})
    OffloadConfig(num_cpu_blocks=4, store_mode="eager", **{setting: value})  # honoured there


@pytest.mark.parametrize(
    ("model", "values", "message"),
    [
        (
            OffloadConfig,
            {"num_cpu_blocks": 64, "max_store_blocks_per_step": None},
            r"invalid OffloadConfig: max_store_blocks_per_step \(env "
            r"KVOFFLOAD_MAX_STORE_BLOCKS_PER_STEP\): .* \(got None\)",
        ),
        (OffloadConfig, {"block_size": 4}, "exactly one of num_cpu_blocks"),
        (KVLayout, {"num_layers": 0}, r"invalid KVLayout: num_layers: .* \(got 0\)"),
    ],
)
def test_model_validate_refuses_with_the_constructors_config_error(
    model: type[OffloadConfig] | type[KVLayout], values: dict[str, object], message: str
) -> None:
    """``model_validate()`` of a dict raised pydantic's ValidationError (around the
    constructor's ConfigError): the configs refuse with the one ConfigError, the
    constructor's, whichever way they are made."""
    with pytest.raises(ConfigError, match=message) as built:
        model(**values)
    with pytest.raises(ConfigError, match=message) as validated:
        model.model_validate(values)
    assert str(validated.value) == str(built.value)
    with pytest.raises(ConfigError, match=f"invalid {model.__name__}: Input should be"):
        model.model_validate("not a mapping")
