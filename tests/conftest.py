"""Fixtures shared by several test modules."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    # Imported where a test asks for a cluster: the module pulls in the redis client, which
    # the GPU machine's test runs (bench/on_gpu.sh tests) need not have.
    from tests.redis_cluster import LocalRedisCluster


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRedisCluster]:
    """One three-master cluster for the whole run; tests keep apart by key namespace."""
    from tests.redis_cluster import running_cluster

    with running_cluster(tmp_path_factory.mktemp("redis-cluster")) as cluster:
        yield cluster


@pytest.fixture
def own_redis_cluster(tmp_path: Path) -> Iterator[LocalRedisCluster]:
    """A cluster for one test that harms it (kills a master)."""
    from tests.redis_cluster import running_cluster

    with running_cluster(tmp_path / "redis-cluster") as cluster:
        yield cluster


@pytest.fixture(autouse=True)
def _library_log_levels_restored() -> Iterator[None]:
    """`statekv` commands run in-process set the package's logger levels (their one logging
    setup, --log-level): each test starts from the levels it found."""
    names = ("statekv", "io_actors", "models", "serve")
    levels = {name: logging.getLogger(name).level for name in names}
    yield
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)
