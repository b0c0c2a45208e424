"""Every invalid configuration value raises ConfigError naming its field, at construction."""

from __future__ import annotations

import math
from typing import Any

import attrs
import pytest

from statekv import CacheConfig, ConfigError, KVCacheManager, KVLayout, SpillMode, StateKVError
from statekv.config import DEFAULT_MAX_TTL_SECONDS, MAX_BLOCK_SIZE, MAX_PRIORITY_LEVELS

BASE: dict[str, Any] = {"block_size": 16, "gpu_blocks": 8}
LAYOUT: dict[str, Any] = {"num_layers": 2, "num_kv_heads": 4, "head_dim": 64}


def _cfg(**overrides: Any) -> CacheConfig:
    return CacheConfig(**{**BASE, **overrides})


def _layout(**overrides: Any) -> KVLayout:
    return KVLayout(**{**LAYOUT, **overrides})


INT_FIELDS_MIN = [
    # (field, smallest valid value)
    ("block_size", 1),
    ("gpu_blocks", 1),
    ("host_blocks", 0),
    ("disk_blocks", 0),
    ("reserved_host_blocks", 0),
    ("spill_min_reuse", 1),
    ("write_queue_depth", 1),
    ("priority_levels", 1),
]


def _valid_context(field: str) -> dict[str, Any]:
    """Other fields a value of `field` needs to be valid (a reserve needs a disk...)."""
    if field in ("disk_blocks", "reserved_host_blocks"):
        return {"host_blocks": 1, "disk_blocks": 1}
    return {}


@pytest.mark.parametrize(("field", "low"), INT_FIELDS_MIN)
@pytest.mark.parametrize("bad", ["bool_true", "bool_false", "float", "str", "none", "below"])
def test_bad_integer_field_raises_config_error_naming_it(field: str, low: int, bad: str) -> None:
    value: object = {
        "bool_true": True, "bool_false": False, "float": float(low + 1), "str": str(low + 1),
        "none": None, "below": low - 1,
    }[bad]
    with pytest.raises(ConfigError) as info:
        _cfg(**{**_valid_context(field), field: value})
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}:")


@pytest.mark.parametrize(("field", "low"), INT_FIELDS_MIN)
def test_smallest_valid_integer_field_is_accepted(field: str, low: int) -> None:
    cfg = _cfg(**{**_valid_context(field), field: low})
    assert getattr(cfg, field) == low


@pytest.mark.parametrize(
    ("field", "too_big", "largest"),
    [("block_size", MAX_BLOCK_SIZE + 1, MAX_BLOCK_SIZE),
     ("priority_levels", MAX_PRIORITY_LEVELS + 1, MAX_PRIORITY_LEVELS)],
)
def test_integer_field_above_its_bound_is_refused(field: str, too_big: int, largest: int) -> None:
    with pytest.raises(ConfigError) as info:
        _cfg(**{field: too_big})
    assert info.value.field == field
    assert getattr(_cfg(**{field: largest}), field) == largest


@pytest.mark.parametrize("value", ["bogus", "ALL", 3, None, 1.5, ["all"]])
def test_unknown_spill_mode_raises_config_error_naming_spill_mode(value: object) -> None:
    with pytest.raises(ConfigError) as info:
        _cfg(spill_mode=value)
    assert info.value.field == "spill_mode"


@pytest.mark.parametrize("mode", list(SpillMode))
def test_spill_mode_is_accepted_by_name_or_member(mode: SpillMode) -> None:
    assert _cfg(spill_mode=mode.value).spill_mode is mode
    assert _cfg(spill_mode=mode).spill_mode is mode


@pytest.mark.parametrize("field", ["protect_unexpired", "drop_on_pressure", "shared_tier"])
@pytest.mark.parametrize("value", [0, 1, "yes", None, 1.0])
def test_flag_that_is_not_a_bool_raises_config_error_naming_it(field: str, value: object) -> None:
    with pytest.raises(ConfigError) as info:
        _cfg(**{field: value})
    assert info.value.field == field


@pytest.mark.parametrize(
    "value", [math.nan, math.inf, -math.inf, -1.0, 0, 0.0, "60", True, None, 10**400],
)
def test_bad_max_ttl_raises_config_error_naming_max_ttl_seconds(value: object) -> None:
    with pytest.raises(ConfigError) as info:
        _cfg(max_ttl_seconds=value)
    assert info.value.field == "max_ttl_seconds"


@pytest.mark.parametrize("value", [1, 0.5, 3600, DEFAULT_MAX_TTL_SECONDS])
def test_positive_finite_max_ttl_is_accepted(value: float) -> None:
    assert _cfg(max_ttl_seconds=value).max_ttl_seconds == value


@pytest.mark.parametrize("value", [None, 3, b"weights", "\ud800"])
def test_bad_model_fingerprint_raises_config_error_naming_it(value: object) -> None:
    with pytest.raises(ConfigError) as info:
        _cfg(model_fingerprint=value)
    assert info.value.field == "model_fingerprint"


@pytest.mark.parametrize("value", [None, {"num_layers": 1}, "layout"])
def test_layout_that_is_not_a_kv_layout_raises_config_error_naming_layout(value: object) -> None:
    with pytest.raises(ConfigError) as info:
        _cfg(layout=value)
    assert info.value.field == "layout"


def test_disk_tier_without_host_tier_is_refused_naming_disk_blocks() -> None:
    with pytest.raises(ConfigError) as info:
        _cfg(disk_blocks=4)
    assert info.value.field == "disk_blocks"


def test_disk_tier_with_only_reserved_host_pages_is_refused() -> None:
    """Reserved pages are handed out only by spills, which come from host_blocks' pages:
    with no host_blocks nothing would ever reach the disk."""
    with pytest.raises(ConfigError) as info:
        _cfg(host_blocks=0, reserved_host_blocks=2, disk_blocks=4)
    assert info.value.field == "disk_blocks"


def test_reserved_host_blocks_without_disk_is_refused_naming_reserved_host_blocks() -> None:
    with pytest.raises(ConfigError) as info:
        _cfg(host_blocks=4, reserved_host_blocks=1)
    assert info.value.field == "reserved_host_blocks"


def test_full_three_tier_config_is_accepted() -> None:
    cfg = _cfg(host_blocks=4, reserved_host_blocks=2, disk_blocks=64, protect_unexpired=True,
               drop_on_pressure=True, spill_mode="reused", spill_min_reuse=3,
               model_fingerprint="llama-3-8b@abc")
    assert cfg.spill_mode is SpillMode.REUSED
    KVCacheManager(cfg).check_invariants()


@pytest.mark.parametrize("field", ["num_layers", "num_kv_heads", "head_dim"])
@pytest.mark.parametrize("value", [0, -1, True, 2.0, "8", None, 4097])
def test_bad_layout_dimension_raises_config_error_naming_it(field: str, value: object) -> None:
    with pytest.raises(ConfigError) as info:
        _layout(**{field: value})
    assert info.value.field == field


@pytest.mark.parametrize("value", ["float64", "int8", "", None, 2])
def test_unknown_dtype_raises_config_error_naming_dtype(value: object) -> None:
    with pytest.raises(ConfigError) as info:
        _layout(dtype=value)
    assert info.value.field == "dtype"


@pytest.mark.parametrize(
    ("dtype", "itemsize"),
    [("float32", 4), ("float16", 2), ("bfloat16", 2), ("float8_e4m3fn", 1), ("uint8", 1)],
)
def test_block_bytes_is_layers_times_k_and_v_times_tokens_heads_dim_itemsize(
    dtype: str, itemsize: int,
) -> None:
    layout = _layout(dtype=dtype)
    assert layout.block_bytes(16) == 2 * 2 * 16 * 4 * 64 * itemsize
    assert _cfg(layout=layout).block_bytes == layout.block_bytes(16)


def test_config_errors_are_value_errors_of_statekv() -> None:
    assert issubclass(ConfigError, ValueError)
    assert issubclass(ConfigError, StateKVError)


def test_config_is_frozen() -> None:
    cfg = _cfg()
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        cfg.gpu_blocks = 0  # type: ignore[misc]
    layout = _layout()
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        layout.head_dim = 0  # type: ignore[misc]


def test_config_fields_are_keyword_only() -> None:
    with pytest.raises(TypeError):
        CacheConfig(16, 8)  # type: ignore[call-arg]
