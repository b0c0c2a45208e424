"""Closing a cache gives its pools' memory back at once, not at the garbage collector's next
full pass: a cache opened next in the same process must find the room the closed one had."""

from __future__ import annotations

import gc
import mmap
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from io_actors.config import StateKVConfig
from io_actors.embed import BlockingCache
from io_actors.memory.pools import TorchCopyEngine
from io_actors.storage import buffers
from statekv.config import KVLayout
from statekv.errors import UsageError
from statekv.ids import PageId
from tests.io_helpers import (
    MemmoveGather,
    doc_evicted_to_host,
    serve,
    small_config,
    wait_quiet,
    wait_ready,
)


@pytest.fixture
def no_collector() -> Iterator[None]:
    """The cyclic collector off: only reference counting frees anything."""
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


class _RecordedMappings:
    """Stands in for the mmap module inside io_actors.storage.buffers: every anonymous
    mapping made for a host buffer is watched through a weak reference."""

    PAGESIZE = mmap.PAGESIZE

    def __init__(self) -> None:
        self.made: list[weakref.ref[mmap.mmap]] = []

    def mmap(self, *args: Any, **kwargs: Any) -> mmap.mmap:
        mapping = mmap.mmap(*args, **kwargs)
        self.made.append(weakref.ref(mapping))
        return mapping

    def alive(self) -> int:
        return sum(ref() is not None for ref in self.made)


def _spill_and_onboard(cache: BlockingCache) -> None:
    """Pages used by every actor: the serving thread's, the writers', the readers'."""
    prompt = list(range(1, 14))
    serve(cache, "first", prompt)
    for i in range(4):
        serve(cache, f"churn{i}", [1000 * (i + 1) + t for t in range(29)])
    wait_quiet(cache)
    cache.add_request("again", prompt)
    wait_ready(cache, "again")
    cache.release("again")


@pytest.mark.usefixtures("no_collector")
def test_close_gives_the_pools_memory_back_while_the_cache_object_lives(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    mappings = _RecordedMappings()
    monkeypatch.setattr(buffers, "mmap", mappings)
    config = small_config(tmp_path)
    on_cuda = config.device == "cuda"
    cache = BlockingCache(config)
    gpu_pool = weakref.ref(cache.kv_pool)
    pool_bytes = cache.kv_pool.numel() * cache.kv_pool.element_size()
    _spill_and_onboard(cache)
    if not on_cuda:
        assert mappings.alive() >= 1  # the host pool (unpinned here) and staging buffers
    allocated = torch.cuda.memory_allocated() if on_cuda else 0
    cache.close()

    pool = gpu_pool()
    holders = [type(r).__name__ for r in gc.get_referrers(pool)] if pool is not None else []
    del pool
    assert not holders, f"the GPU pool outlived close(), held by {holders}"
    if on_cuda:
        # Other allocations of the process (kernels' tables made once) may stay.
        assert allocated - torch.cuda.memory_allocated() >= pool_bytes
    else:
        assert mappings.alive() == 0, "a host buffer outlived close()"
    with pytest.raises(UsageError, match="kv_pool: the cache is closed"):
        _ = cache.kv_pool
    with pytest.raises(UsageError, match="given back when the cache closed"):
        cache._pools.host_page(PageId(0))  # what a worker would call


@pytest.mark.usefixtures("no_collector")
def test_close_gives_the_copy_engines_scratch_back(tmp_path: Path) -> None:
    # An admission that recalls host blocks into the GPU pages it evicts makes the copy
    # engine stash those pages in its scratch (up to 16 MiB of device memory on a GPU).
    device = small_config(tmp_path).device
    bs = 4
    config = StateKVConfig(layout=KVLayout(num_layers=2, num_kv_heads=2, head_dim=16,
                                           dtype="float32"),
                           block_size=bs, gpu=6, host=6, device=device,
                           model_fingerprint="scratch-at-close")
    cache = BlockingCache(config)
    engine = cache._scheduler._copies
    assert isinstance(engine, TorchCopyEngine)
    if not engine.statistics().asynchronous:
        # A CPU device copies run by run; the passes (and their scratch) run there only
        # through a stand-in for the kernel (which memmoves: host addresses only).
        engine._gatherer = MemmoveGather()  # type: ignore[assignment]
    doc = doc_evicted_to_host(cache, bs)
    assert cache.add_request("again", doc).host_tokens == 4 * bs
    wait_ready(cache, "again")
    cache.release("again")
    assert engine._scratch is not None
    scratch = weakref.ref(engine._scratch)
    cache.close()
    assert scratch() is None, "the copy engine's scratch outlived close()"
