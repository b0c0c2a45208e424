"""The Redis Cluster harness (bench/redis_cluster.py) as tests use it.

With ``CI`` set, a machine without Debian's redis-server fails the shared tier's tests
instead of skipping them: .ci/run installs it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.redis_cluster import LocalRedisCluster, find_redis_tools, free_ports

__all__ = ["LocalRedisCluster", "free_ports", "redis_tools", "running_cluster"]


def redis_tools() -> tuple[str, str]:
    """Paths of redis-server and redis-cli; fails (CI) or skips the calling test without them."""
    tools = find_redis_tools()
    if tools is not None:
        return tools
    if os.environ.get("CI"):
        pytest.fail("redis-server / redis-cli not found in CI (.ci/run should have installed "
                    "Debian's redis-server)", pytrace=False)
    pytest.skip("no redis-server on PATH: `apt-get install -y redis-server` (as .ci/run does) "
                "to run the shared tier's tests")


@contextlib.contextmanager
def running_cluster(directory: Path, *, masters: int = 3,
                    password: str | None = None) -> Iterator[LocalRedisCluster]:
    redis_tools()
    cluster = LocalRedisCluster(directory, masters=masters, password=password)
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()
