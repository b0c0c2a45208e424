"""A dispatch's copies as one engine call (TorchCopyEngine.copy_runs), in order.

An admission that recalls host blocks into the GPU pages it evicts alternates directions at
every block: a copy out of a page, then one into it.  The scheduler hands all of a
dispatch's copies to the engine at once; the engine must leave every page as the copies one
by one would, in command order -- a host page freed by a recall and refilled by the next
eviction, a page filled twice -- and, with cupy, give each host page the checksum of the
bytes its last copy brought.  These are checked against copies applied one at a time, on
the CPU machine and (STATEKV_TEST_DEVICE=cuda) with the CUDA engine, its gather kernel and
its checksum kernel.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from io_actors.config import StateKVConfig
from io_actors.embed import BlockingCache
from io_actors.memory import batched_dma
from io_actors.memory import pools as pools_module
from io_actors.memory.pools import KVPools, TorchCopyEngine, _checksum_order, _RunPlan
from io_actors.storage.buffers import host_view
from io_actors.storage.interfaces import CopyRun
from io_actors.storage.slot_format import payload_checksum
from statekv.config import CacheConfig, KVLayout
from statekv.errors import ConfigError, UsageError
from statekv.ids import PageId
from tests.io_helpers import MemmoveGather, check_pages, doc_evicted_to_host, wait_ready

DEVICE = os.environ.get("STATEKV_TEST_DEVICE", "cpu")
GPU_PAGES = 6
HOST_PAGES = 5
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype="float32")

_run = st.tuples(
    st.booleans(),
    st.lists(st.tuples(st.integers(0, GPU_PAGES - 1), st.integers(0, HOST_PAGES - 1)),
             min_size=1, max_size=5),
)
# A run as (to_gpu, [(gpu page, host page), ...]); turned into (source, destination) pairs.
_programs = st.lists(st.lists(_run, min_size=1, max_size=6), min_size=1, max_size=3)


def _pairs(to_gpu: bool, pages: list[tuple[int, int]]) -> list[tuple[PageId, PageId]]:
    return [(PageId(h), PageId(g)) if to_gpu else (PageId(g), PageId(h)) for g, h in pages]


def _pools() -> KVPools:
    return KVPools(CacheConfig(block_size=4, gpu_blocks=GPU_PAGES, host_blocks=HOST_PAGES,
                               layout=LAYOUT), DEVICE)


def _fill_distinct(pools: KVPools) -> None:
    for page in range(GPU_PAGES):
        pools.gpu_page(PageId(page)).fill_(page + 1)
    for page in range(HOST_PAGES):
        pools.host_page(PageId(page)).fill_(100 + page)


def _checked_gather(engine: TorchCopyEngine) -> MemmoveGather:
    """`engine` with its batches checked and counted: through its own kernel on a GPU, by
    memmoves on the CPU (where the engine has none, and its passes then go by address)."""
    if engine._gatherer is None and torch.device(DEVICE).type == "cuda":
        pytest.skip("the kernel path needs cupy on CUDA")
    gather = MemmoveGather(engine._gatherer)
    engine._gatherer = gather  # type: ignore[assignment]
    return gather


def _have_batched_memcpy() -> bool:
    version = batched_dma.driver_version()
    return version is not None and version >= 12080


def _engines(pools: KVPools) -> list[TorchCopyEngine]:
    engines = [TorchCopyEngine(pools)]
    if engines[0].gather_kernel_available:
        engines += [TorchCopyEngine(pools, gather_kernel=True),
                    TorchCopyEngine(pools, gather_kernel=False)]
        # The real kernel with a scratch of two pages: larger stashes run in segments.
        segmented = TorchCopyEngine(pools, gather_kernel=True)
        segmented._scratch_pages = 2
        engines.append(segmented)
        if _have_batched_memcpy():
            # The same batches as the driver's batched memcpy, segmented too.
            engines.append(TorchCopyEngine(pools, gather_kernel=True, batch_dma=True))
            segmented = TorchCopyEngine(pools, gather_kernel=True, batch_dma=True)
            segmented._scratch_pages = 2
            engines.append(segmented)
    else:
        # The kernel's path on the CPU machine: a call's passes by address, the GPU
        # engine's scratch and address arithmetic included, through a memmove stand-in.
        addressed = TorchCopyEngine(pools)
        addressed._gatherer = MemmoveGather()  # type: ignore[assignment]
        engines.append(addressed)
        # And with a scratch of two pages: a call's stash larger than that runs in segments.
        segmented = TorchCopyEngine(pools)
        segmented._gatherer = MemmoveGather()  # type: ignore[assignment]
        segmented._scratch_pages = 2
        engines.append(segmented)
    return engines


@settings(max_examples=60, deadline=None)
@given(program=_programs)
def test_copy_runs_leave_every_page_as_one_copy_at_a_time_would(
    program: list[list[tuple[bool, list[tuple[int, int]]]]],
) -> None:
    pools = _pools()
    for engine in _engines(pools):
        _fill_distinct(pools)
        gpu = pools.gpu.reshape(GPU_PAGES, -1).view(torch.uint8).cpu().clone()
        host = pools.host.reshape(HOST_PAGES, -1).view(torch.uint8).clone()
        filled: dict[int, int] = {}  # host page -> the GPU page its last copy came from
        for call in program:
            for to_gpu, pages in call:
                for g, h in pages:  # the reference: one copy at a time, in order
                    if to_gpu:
                        gpu[g] = host[h]
                    else:
                        host[h] = gpu[g]
                        filled[h] = g
            engine.copy_runs([(to_gpu, _pairs(to_gpu, pages)) for to_gpu, pages in call])
        engine.fence().wait()
        assert torch.equal(pools.gpu.reshape(GPU_PAGES, -1).view(torch.uint8).cpu(), gpu)
        assert torch.equal(pools.host.reshape(HOST_PAGES, -1).view(torch.uint8), host)
        checksums = pools.host_checksums
        if checksums is not None:
            # Each host page a GPU page filled: the checksum of the bytes it holds now.
            for h in filled:
                assert checksums.of(PageId(h)) == payload_checksum(
                    host_view(pools.host_page(PageId(h))))


def test_a_bad_pair_in_a_later_run_refuses_the_whole_call_before_any_copy() -> None:
    pools = _pools()
    _fill_distinct(pools)
    before = pools.gpu.cpu().clone(), pools.host.clone()
    engine = TorchCopyEngine(pools)
    with pytest.raises(UsageError, match="pairs"):
        engine.copy_runs([(False, [(PageId(0), PageId(0))]),
                          (True, [(PageId(1), PageId(GPU_PAGES))])])
    engine.fence().wait()
    assert torch.equal(pools.gpu.cpu(), before[0]) and torch.equal(pools.host, before[1])
    stats = engine.statistics()
    assert stats.copies_to_host == 0 and stats.copies_to_gpu == 0


def _plan(to_gpu: bool, pages: list[tuple[int, int]]) -> _RunPlan:
    return _RunPlan(to_gpu=to_gpu, pairs=_pairs(to_gpu, pages), runs=[], use_kernel=False)


def test_each_host_page_is_checksummed_once_from_its_last_fill_and_after_a_write_into_it() -> None:
    early, late = _checksum_order([
        _plan(False, [(0, 0), (1, 1)]),  # GPU 0 -> host 0, GPU 1 -> host 1
        _plan(True, [(2, 1)]),           # host 1 -> GPU 2 (a recall into an evicted page)
        _plan(False, [(2, 3), (3, 0)]),  # GPU 2 -> host 3: after that write; host 0 again
    ])
    # Host 0's first fill is not checksummed at all (its bytes do not last); GPU 2 is read
    # right after the run that copies it out, not ahead of the call.
    assert sorted(early) == [(1, 1), (3, 0)]
    assert late == {2: [(2, 3)]}


@given(call=st.lists(_run, min_size=1, max_size=8))
def test_every_checksum_reads_the_bytes_its_host_page_ends_with(
    call: list[tuple[bool, list[tuple[int, int]]]],
) -> None:
    """Where _checksum_order puts each checksum, the GPU page it reads holds what the host
    page holds once the call's copies are done (contents as labels, copies applied in
    order): early ones read the pages as they are at the call's start, late ones right
    after their run."""
    planned = [_plan(to_gpu, pages) for to_gpu, pages in call]
    early, late = _checksum_order(planned)
    gpu: list[object] = [("gpu", g) for g in range(GPU_PAGES)]
    host: list[object] = [("host", h) for h in range(HOST_PAGES)]
    at_start = list(gpu)
    read: dict[int, object] = {h: at_start[g] for g, h in early}
    filled: set[int] = set()
    for k, (to_gpu, pages) in enumerate(call):
        for g, h in pages:
            if to_gpu:
                gpu[g] = host[h]
            else:
                host[h] = gpu[g]
                filled.add(h)
        for g, h in late.get(k, []):
            assert h not in read  # one checksum per host page
            read[h] = gpu[g]
    assert set(read) == filled
    assert all(read[h] == host[h] for h in filled)


def test_an_admission_that_recalls_into_the_pages_it_evicts_makes_one_engine_call(
    tmp_path: object, monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[list[bool]] = []
    real = TorchCopyEngine.copy_runs
    serving_thread = threading.get_ident()

    def counted(self: TorchCopyEngine, runs: Any) -> None:
        if threading.get_ident() == serving_thread:
            calls.append([to_gpu for to_gpu, _pairs in runs])
        real(self, runs)

    monkeypatch.setattr(pools_module.TorchCopyEngine, "copy_runs", counted)
    bs = 4
    config = StateKVConfig(layout=LAYOUT, block_size=bs, gpu=6, host=6,
                           device=DEVICE, model_fingerprint="copy-runs")
    with BlockingCache(config) as cache:
        doc = doc_evicted_to_host(cache, bs)  # the GPU is full of other's cached blocks
        calls.clear()
        match = cache.add_request("again", doc)
        wait_ready(cache, "again")
        assert match.host_tokens == 4 * bs
        # Four recalls into pages of four evicted blocks: out, in, out, in ... -- one call.
        assert len(calls) == 1 and calls[0].count(True) >= 2 and calls[0].count(False) >= 2
        check_pages(cache, "again", doc, 4)
        cache.release("again")
        cache.check_invariants()


class _Chain:
    """An admission's chain over `pools` (filled distinct): evict GPU k to host k, then
    recall host k+1 into GPU k (the page just evicted), for four pages -- eight one-page
    runs -- with the pages the copies one at a time would leave."""

    def __init__(self, pools: KVPools) -> None:
        _fill_distinct(pools)
        self.pools = pools
        self.gpu = self._gpu_bytes().clone()
        self.host = self._host_bytes().clone()
        self.runs: list[CopyRun] = []
        for k in range(4):
            self.runs += [(False, _pairs(False, [(k, k)])), (True, _pairs(True, [(k, k + 1)]))]
            self.host[k] = self.gpu[k]
            self.gpu[k] = self.host[k + 1]

    def _gpu_bytes(self) -> torch.Tensor:
        return self.pools.gpu.reshape(self.pools.gpu_pages, -1).view(torch.uint8).cpu()

    def _host_bytes(self) -> torch.Tensor:
        return self.pools.host.reshape(self.pools.host_pages, -1).view(torch.uint8)

    def run_and_check(self, engine: TorchCopyEngine) -> None:
        engine.copy_runs(self.runs)
        engine.fence().wait()
        assert torch.equal(self._gpu_bytes(), self.gpu)
        assert torch.equal(self._host_bytes(), self.host)


def test_an_alternating_chain_runs_as_a_stash_and_a_move_batch_on_the_kernel_path() -> None:
    # Each run a DMA before; two batches by address here.
    pools = _pools()
    chain = _Chain(pools)
    engine = TorchCopyEngine(pools)
    gather = _checked_gather(engine)
    chain.run_and_check(engine)
    assert gather.batches == 2
    # With room for two stashed pages only, the same call runs in order as segments.
    chain = _Chain(pools)
    small = TorchCopyEngine(pools)
    gather = _checked_gather(small)
    small._scratch_pages = 2
    chain.run_and_check(small)
    assert gather.batches > 2


@pytest.mark.skipif(DEVICE != "cuda", reason="the engine chooses only where copies are DMAs")
@pytest.mark.parametrize(("block_size", "kernels"), [(512, 2), (768, 0), (1024, 0)])
def test_auto_takes_the_kernels_for_a_chain_of_pages_under_the_measured_crossover(
    block_size: int, kernels: int,
) -> None:
    # 512 bytes of KV a token: 256 KiB pages (the passes measured faster than DMAs on an
    # H100), 384 and 512 KiB ones (slower: each page of the chain is moved twice, via the
    # scratch).
    pools = KVPools(CacheConfig(block_size=block_size, gpu_blocks=GPU_PAGES,
                                host_blocks=HOST_PAGES, layout=LAYOUT), DEVICE)
    assert pools.block_nbytes == block_size * 512
    engine = TorchCopyEngine(pools)
    if not engine.gather_kernel_available:
        pytest.skip("the kernel path needs cupy on CUDA")
    _Chain(pools).run_and_check(engine)
    assert engine.statistics().kernel_batches == kernels


def test_batched_dma_where_it_cannot_run_is_a_config_error_naming_it() -> None:
    pools = _pools()
    if DEVICE == "cuda" and _have_batched_memcpy():
        engine = TorchCopyEngine(pools, gather_kernel=True, batch_dma=True)
        assert isinstance(engine._gatherer, batched_dma.BatchedDMA)
        engine.release()
        assert engine._gatherer is None
    else:
        with pytest.raises(ConfigError) as info:
            TorchCopyEngine(pools, batch_dma=True)
        assert info.value.field == "batch_dma"
    with pytest.raises(ConfigError) as info:
        TorchCopyEngine(pools, batch_dma="yes")  # type: ignore[arg-type]
    assert info.value.field == "batch_dma"


@pytest.mark.skipif(DEVICE != "cuda", reason="the driver's batched memcpy runs on CUDA only")
def test_a_chain_through_the_drivers_batched_memcpy_leaves_every_page_as_one_at_a_time() -> None:
    if not _have_batched_memcpy():
        pytest.skip("the driver predates cuMemcpyBatchAsync (CUDA 12.8)")
    pools = _pools()
    engine = TorchCopyEngine(pools, gather_kernel=True, batch_dma=True)
    _Chain(pools).run_and_check(engine)
    assert engine.statistics().kernel_batches == 2
