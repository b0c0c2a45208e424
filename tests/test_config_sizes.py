"""Sizes the user gives StateKVConfig are refused by the names the user gave them (`gpu`,
`host`, `reserved_host`, `disk`, never the core's `*_blocks`), and a size that cannot be
allocated here is a ConfigError at open, before anything is created: not a MemoryError, not
a process killed halfway through building the core."""

from __future__ import annotations

from pathlib import Path

import pytest

from io_actors.embed import BlockingCache
from statekv import ConfigError
from tests.io_helpers import small_config


@pytest.mark.parametrize(("field", "size"), [
    ("reserved_host", 10**9), ("disk", 10**12), ("host", 10**12), ("gpu", 10**12),
])
def test_a_size_too_large_for_this_machine_is_refused_naming_it(
    tmp_path: Path, field: str, size: int,
) -> None:
    config = small_config(tmp_path, **{field: size})
    with pytest.raises(ConfigError) as info:
        BlockingCache(config)
    assert info.value.field == field, info.value
    assert "_blocks" not in str(info.value)
    assert list(tmp_path.iterdir()) == []  # nothing created


def test_a_core_rule_broken_by_sizes_names_the_public_fields(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        small_config(None, disk=0, reserved_host=2)
    assert info.value.field == "reserved_host"
    assert "disk" in str(info.value) and "_blocks" not in str(info.value)
