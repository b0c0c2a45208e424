"""README, "Sharing KV across replicas": with ``publish_on="release"`` (the default) a second
replica is served a prompt the first has just answered -- while the first is still running
and has evicted nothing -- byte for byte; with ``publish_on="eviction"`` it is not, until the
first replica lets the content go.  Against a real Redis Cluster."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest

from io_actors.embed import BlockingCache
from tests.io_helpers import BLOCK_SIZE, check_pages, compute, small_config, wait_ready
from tests.redis_cluster import LocalRedisCluster

PROMPT = [(17 * i + 3) % 89 for i in range(3 * BLOCK_SIZE + 1)]


def _published(cache: BlockingCache, want: int, timeout: float = 10.0) -> int:
    deadline = time.monotonic() + timeout
    while True:
        stats = cache.statistics().publisher
        assert stats is not None
        if stats.published >= want or time.monotonic() > deadline:
            return stats.published
        time.sleep(0.01)


@pytest.mark.parametrize("publish_on", ["release", "eviction"])
def test_a_second_replica_is_served_what_the_first_has_just_answered(
    redis_cluster: LocalRedisCluster, tmp_path: Path, publish_on: str,
) -> None:
    common = dict(model_fingerprint="model-a", remote_url=redis_cluster.url,
                  remote_namespace=f"p{uuid.uuid4().hex[:12]}", remote_timeout_s=1.0,
                  gpu=16, host=4, publish_on=publish_on)
    with BlockingCache(small_config(tmp_path / "a", **common)) as a, \
            BlockingCache(small_config(tmp_path / "b", **common)) as b:
        a.add_request("answered", PROMPT, ttl_seconds=600.0)
        compute(a, "answered", PROMPT)
        a.release("answered")
        stats = a.statistics().cache
        assert stats.gpu_evictions == 0          # nothing left A's GPU
        if publish_on == "release":
            assert stats.publishes_offered == 3
            assert _published(a, 3) == 3
        else:
            assert stats.publishes_offered == 0
        match = b.add_request("asked", PROMPT)
        if publish_on == "eviction":
            assert match.remote_tokens == 0
            b.release("asked")
            return
        assert match.remote_tokens == 3 * BLOCK_SIZE
        wait_ready(b, "asked")
        check_pages(b, "asked", PROMPT, 3)       # the bytes A computed
        assert b.statistics().cache.fetches_completed == 3
        b.release("asked")
        # Offered once while it stays cached: A serving it again publishes nothing more.
        a.add_request("again", PROMPT)
        compute(a, "again", PROMPT)
        a.release("again")
        assert a.statistics().cache.publishes_offered == 3


def test_publish_on_is_checked_and_named(tmp_path: Path) -> None:
    from statekv.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        small_config(tmp_path, publish_on="commit").core_config()
    assert info.value.field == "publish_on"
