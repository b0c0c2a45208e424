"""KV computed with other weights is never served: a cache whose content outlives its
process (persist=True, or a shared tier) must say which weights it serves.

README: "model_fingerprint: KV computed with other weights is never reused".  With an empty
fingerprint two processes with other weights and the same layout would key the same prompt
identically, and the second would be served the first's KV from disk after a restart.
"""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest

from io_actors.config import StateKVConfig
from io_actors.embed import BlockingCache
from statekv import ConfigError
from tests.io_helpers import check_pages, compute, small_config, wait_ready
from tests.test_io_actors import churn


def test_a_persistent_disk_tier_without_a_fingerprint_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        small_config(tmp_path, model_fingerprint="")
    assert info.value.field == "model_fingerprint"
    assert "persist" in str(info.value)
    assert list(tmp_path.iterdir()) == []  # refused before anything was created


def test_without_persistence_or_a_disk_tier_no_fingerprint_is_needed(tmp_path: Path) -> None:
    assert not small_config(tmp_path, model_fingerprint="", persist=False).persist
    no_disk = small_config(None, model_fingerprint="", disk=0, reserved_host=0)
    assert no_disk.core_config().disk_blocks == 0


def test_a_shared_tier_without_a_fingerprint_is_refused() -> None:
    with pytest.raises(ConfigError) as info:
        small_config(None, model_fingerprint="", disk=0, reserved_host=0,
                     remote_url="redis://127.0.0.1:1")
    assert info.value.field == "model_fingerprint"
    assert "remote_url" in str(info.value)


def test_a_restart_with_other_weights_is_served_nothing_of_the_first(tmp_path: Path) -> None:
    prompt = list(range(13))
    first: StateKVConfig = small_config(tmp_path, model_fingerprint="weights-a")
    with BlockingCache(first) as cache:
        cache.add_request("p", prompt, ttl_seconds=600)
        compute(cache, "p", prompt)
        cache.release("p")
        churn(cache, 6)  # the prompt goes to disk
    with BlockingCache(attrs.evolve(first, model_fingerprint="weights-b")) as other:
        match = other.add_request("q", prompt)
        assert match.matched_tokens == 0
        other.release("q")
    with BlockingCache(first) as same:  # the same weights find it again
        match = same.add_request("r", prompt)
        assert match.disk_tokens == 12
        wait_ready(same, "r")
        check_pages(same, "r", prompt, 3)
        same.release("r")
