"""The connector's ``kv_connector_extra_config``: every key a StateKVConfig field or the
connector's own, every error naming the key the user set (no vLLM needed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from io_actors.vllm.settings import connector_config, write_through_policy
from statekv.config import KVLayout
from statekv.errors import ConfigError

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype="float32")


def make(extra: dict[str, object]) -> object:
    return connector_config(extra, layout=LAYOUT, block_size=32, gpu_blocks=17, rank=0,
                            default_fingerprint="vllm:test")


@pytest.mark.parametrize(("extra", "field"), [
    ({"host": 8, "dsik": 4}, "kv_connector_extra_config.dsik"),
    ({}, "kv_connector_extra_config.host"),
    ({"host": -1}, "kv_connector_extra_config.host"),
    ({"host": 8, "disk": 8}, "kv_connector_extra_config.disk_dir"),
    ({"host": 8, "disk_mac_key": "zz"}, "kv_connector_extra_config.disk_mac_key"),
    ({"host": 8, "writers": 0}, "kv_connector_extra_config.writers"),
])
def test_a_bad_extra_config_names_the_key(extra: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        make(extra)
    assert info.value.field == field, info.value


def test_a_good_extra_config_builds_the_tiers(tmp_path: Path) -> None:
    config = make({"host": "1 MiB", "disk": 64, "disk_dir": str(tmp_path),
                   "write_through": "retained"})
    core = config.core_config()  # type: ignore[attr-defined]
    assert core.disk_blocks == 64 and core.reserved_host_blocks == 8
    assert core.model_fingerprint == "vllm:test"
    assert not any(tmp_path.iterdir())          # building a config touches no disk


def test_write_through_is_the_connectors_own_key() -> None:
    assert write_through_policy({}) == "all"
    assert write_through_policy({"write_through": "none"}) == "none"
    with pytest.raises(ConfigError) as info:
        write_through_policy({"write_through": "sometimes"})
    assert info.value.field == "kv_connector_extra_config.write_through"
