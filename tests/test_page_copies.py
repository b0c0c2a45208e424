"""compute_waits="pages": a forward pass waits for the copies of its own pages, and only
for those.  And a spill write waits for the last copy into each of its host pages, and only
for those (TorchCopyEngine.fence_for_host_pages), whatever the mode.

The bookkeeping (io_actors.memory.page_copies) is checked against a model of the two CUDA
streams on any machine: the copy stream runs copies in enqueue order, so waiting on the
event after copy k covers every copy up to k, and a wait on the compute stream holds for all
later compute work.  The CUDA tests run the engine itself on a GPU machine.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, cast

import attrs
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from io_actors.actors import writer_pool
from io_actors.config import StateKVConfig
from io_actors.embed import BlockingCache
from io_actors.memory.page_copies import HostPageFills, PendingPageCopies
from io_actors.memory.pools import KVPools, TorchCopyEngine
from io_actors.storage.buffers import host_view
from io_actors.storage.slot_format import payload_checksum
from models.config import preset
from models.model import PagedDecoder
from models.serving_loop import ServeRequest, ServingLoop
from statekv.config import CacheConfig, KVLayout
from statekv.errors import ConfigError
from statekv.ids import PageId

PAGES = 12

# An operation: ("copy", pages) enqueues a batch of copies touching those pages (one event
# after it); ("pass", pages) is a forward pass over those pages.
_pages = st.frozensets(st.integers(0, PAGES - 1), max_size=PAGES)
_ops = st.lists(st.tuples(st.sampled_from(["copy", "pass"]), _pages), max_size=40)


@given(ops=_ops)
def test_a_pass_waits_for_the_latest_copy_of_its_pages_and_for_nothing_later(
    ops: list[tuple[str, frozenset[int]]],
) -> None:
    pending: PendingPageCopies[int] = PendingPageCopies()
    copies: list[frozenset[int]] = []  # copy k (1-based) touched copies[k - 1]
    waited = 0  # the compute stream is ordered after copies 1..waited
    for op, pages in ops:
        if op == "copy":
            copies.append(pages)
            pending.copied(sorted(pages), len(copies))
            continue
        event = pending.take(sorted(pages))
        needed = [k for k, touched in enumerate(copies, 1) if touched & pages and k > waited]
        # The one event waited for is the newest copy of one of the pass's pages not yet
        # covered: every copy of its pages is before the pass, and no later copy is waited.
        assert event == (max(needed) if needed else None)
        if event is not None:
            waited = max(waited, event)
        assert all(k <= waited for k, touched in enumerate(copies, 1) if touched & pages)
    assert pending.pending() == len({p for k, touched in enumerate(copies, 1) if k > waited
                                     for p in touched})


def test_pages_a_later_pass_names_again_need_no_second_wait() -> None:
    pending: PendingPageCopies[str] = PendingPageCopies()
    pending.copied([1, 2], "a")
    pending.copied([3], "b")
    assert pending.take([3]) == "b"         # covers "a" too: the copy stream is in order
    assert pending.take([1, 2]) is None
    pending.copied([2], "c")
    assert pending.pending() == 1
    assert pending.take([1]) is None
    assert pending.take([2, 5]) == "c"
    assert pending.pending() == 0


# ("copy", pages) fills those host pages; ("write", pages) is a spill write reading them;
# ("done", k) is the copy stream reaching its k-th fill (in order: k only moves forward).
_fill_ops = st.lists(st.one_of(
    st.tuples(st.sampled_from(["copy", "write"]), _pages),
    st.tuples(st.just("done"), st.integers(0, 40))), max_size=50)


@given(ops=_fill_ops)
def test_a_spill_write_waits_for_the_last_copy_into_its_pages_and_for_nothing_later(
    ops: list[tuple[str, Any]],
) -> None:
    """Unlike a pass's, a write's wait covers nothing for later writes: each asks again.
    A fill known complete needs no wait, and its event is no longer held."""
    completed = 0
    fills: HostPageFills[int] = HostPageFills(done=lambda k: k <= completed)
    copies: list[frozenset[int]] = []
    for op, arg in ops:
        if op == "done":
            completed = max(completed, min(arg, len(copies)))
            continue
        if op == "copy":
            copies.append(arg)
            fills.filled(sorted(arg), len(copies))
            continue
        into = [k for k, filled in enumerate(copies, 1) if filled & arg]
        needed = max(into) if into and max(into) > completed else None
        assert fills.newest(sorted(arg)) == needed
        assert fills.in_flight() == len(copies) - completed   # nothing completed is held


def test_a_page_filled_again_is_waited_for_at_its_last_fill() -> None:
    completed = 0
    fills: HostPageFills[int] = HostPageFills(done=lambda k: k <= completed)
    assert fills.newest([0, 1]) is None     # never filled by a copy: nothing to wait for
    fills.filled([1, 2], 1)
    fills.filled([3], 2)
    assert fills.newest([1]) == 1           # 2 came later, into another page
    assert fills.newest([1]) == 1           # a host thread's wait covers no one else
    fills.filled([1], 3)
    assert fills.newest([2, 1]) == 3
    assert fills.newest([2]) == 1
    completed = 1
    assert fills.newest([2]) is None        # its fill is done: no wait, no event kept
    assert fills.in_flight() == 2
    completed = 3
    assert fills.newest([1, 2, 3]) is None and fills.in_flight() == 0


def test_each_spill_write_is_fenced_on_exactly_its_own_host_pages(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The scheduler hands every WriteSlots batch the fence of its own host pages, never the
    fence of every copy (on the CPU both are done fences: this checks the wiring; the CUDA
    tests below check what the fence waits for)."""
    asked: list[list[int]] = []
    full: list[int] = []
    original = TorchCopyEngine.fence_for_host_pages
    original_full = TorchCopyEngine.fence

    def recorded(engine: TorchCopyEngine, pages: Any) -> Any:
        asked.append(list(pages))
        return original(engine, asked[-1])

    def recorded_full(engine: TorchCopyEngine) -> Any:
        full.append(1)
        return original_full(engine)

    monkeypatch.setattr(TorchCopyEngine, "fence_for_host_pages", recorded)
    monkeypatch.setattr(TorchCopyEngine, "fence", recorded_full)
    written: list[list[int]] = []
    execute = writer_pool.SlotWriter.execute

    def seen(self: Any, job: Any) -> Any:
        written.append([write.host_page for write in job.command.writes])
        return execute(self, job)

    monkeypatch.setattr(writer_pool.SlotWriter, "execute", seen)
    config = StateKVConfig(layout=_layout(), block_size=4, gpu=9, host=4, reserved_host=4,
                           disk=16, disk_dir=tmp_path, device="cpu", max_batch_blocks=2,
                           spill_mode="retained_only", retention_write_through=False,
                           persist=False)
    with BlockingCache(config) as cache:
        for i, (rid, blocks, ttl) in enumerate([("r1", 4, 3600.0), ("r2", 8, None),
                                               ("r3", 4, None)]):
            tokens = [1_000 * (i + 1) + t for t in range(blocks * 4 + 1)]
            cache.add_request(rid, tokens, ttl_seconds=ttl)
            cache.allocate_nowait(rid, len(tokens))
            cache.commit(rid, len(tokens))
            cache.release(rid)
        deadline = time.monotonic() + 30
        while cache.statistics().cache.spills_completed < 4:
            assert time.monotonic() < deadline, cache.statistics().cache
            time.sleep(0.01)
    assert sorted(map(sorted, written)) == sorted(map(sorted, asked)) and len(written) == 2
    assert not full  # no read in this run: nothing took the whole-stream fence


def _layout() -> KVLayout:
    return KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype="float32")


def test_compute_waits_takes_all_or_pages_and_names_the_field() -> None:
    pools = KVPools(CacheConfig(block_size=4, gpu_blocks=4, host_blocks=2, layout=_layout()),
                    "cpu")
    for mode in ("all", "pages"):
        engine = TorchCopyEngine(pools, compute_waits=mode)
        engine.copy_pages([(PageId(0), PageId(1))], to_gpu=False)
        engine.wait_for_pages([PageId(0)])  # the CPU's copies are done: nothing to wait for
        stats = engine.statistics()
        assert (stats.compute_waits, stats.page_waits) == (mode, 0)
    for bad in ("some", "", None, True):
        with pytest.raises(ConfigError) as info:
            TorchCopyEngine(pools, compute_waits=bad)  # type: ignore[arg-type]
        assert info.value.field == "compute_waits"
        with pytest.raises(ConfigError) as info:
            StateKVConfig(layout=_layout(), gpu=4, compute_waits=bad)  # type: ignore[arg-type]
        assert info.value.field == "compute_waits"


def test_copy_kernel_takes_auto_on_or_off_and_names_the_field(tmp_path: Path) -> None:
    for bad in ("yes", "", None, True):
        with pytest.raises(ConfigError) as info:
            StateKVConfig(layout=_layout(), gpu=4, copy_kernel=bad)  # type: ignore[arg-type]
        assert info.value.field == "copy_kernel"
    # "on" where the kernels cannot run is refused at open, naming the field the user set,
    # before the disk tier's directory gets a file.
    config = StateKVConfig(layout=_layout(), block_size=4, gpu=4, host=4, reserved_host=2,
                           disk=8, disk_dir=tmp_path / "tier", device="cpu",
                           copy_kernel="on", model_fingerprint="copy-kernel")
    with pytest.raises(ConfigError) as info:
        BlockingCache(config)
    assert info.value.field == "copy_kernel" and '"on" needs a CUDA device' in str(info.value)
    assert not (tmp_path / "tier").exists() or not any((tmp_path / "tier").iterdir())
    for mode in ("auto", "off"):
        with BlockingCache(attrs.evolve(config, copy_kernel=mode)) as cache:
            cache.add_request("r", list(range(9)))


class _Announced:
    """The cache, recording the pages announced before each pass and checking each pass's
    pages were announced (for their request) by the time it runs.  It says it orders passes
    by page (as under compute_waits="pages" on a GPU) unless told otherwise."""

    def __init__(self, cache: BlockingCache, *, by_page: bool = True) -> None:
        self._cache = cache
        self.announced: list[list[int]] = []
        self.seen: set[int] = set()
        self.orders_passes_by_page = by_page

    def order_forward_after_copies(self, gpu_pages: Any) -> None:
        pages = list(gpu_pages)
        self.announced.append(pages)
        self.seen.update(pages)
        self._cache.order_forward_after_copies(pages)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cache, name)


@pytest.mark.parametrize("compute_waits", ["all", "pages"])
def test_the_serving_loop_announces_each_pass_pages_once_per_request(
    tmp_path: Any, compute_waits: str,
) -> None:
    _serve_announced(tmp_path, compute_waits, by_page=True)


def test_a_cache_that_waits_for_every_copy_is_not_told_the_pages(tmp_path: Any) -> None:
    """Where every pass already waits for every copy, the loop does not gather its pages:
    that is a walk of every running request's table a step, for nothing."""
    announced = _serve_announced(tmp_path, "all", by_page=False)
    assert announced == []


def _serve_announced(tmp_path: Any, compute_waits: str, *, by_page: bool) -> list[list[int]]:
    model_config = preset("tiny", num_layers=1)
    model = PagedDecoder(model_config, device="cpu")
    config = StateKVConfig(layout=model_config.kv_layout(), block_size=4, gpu=40, host=8,
                           disk=64, disk_dir=tmp_path, device="cpu",
                           model_fingerprint=model_config.fingerprint(),
                           compute_waits=compute_waits)
    passes: list[tuple[list[int], set[int]]] = []
    with BlockingCache(config) as cache:
        assert not cache.orders_passes_by_page  # a CPU device: every copy is done at once
        announced = _Announced(cache, by_page=by_page)
        forward = model.forward

        def checked_forward(pool: torch.Tensor, chunks: Any, **kwargs: Any) -> Any:
            pages = [p for chunk in chunks for p in chunk.block_table]
            passes.append((pages, set(announced.seen)))
            return forward(pool, chunks, **kwargs)

        model.forward = checked_forward  # type: ignore[method-assign]
        loop = ServingLoop(model, cast(BlockingCache, announced), max_step_tokens=24,
                           prefill_chunk=8, max_running=3)
        prompts = [[7 + i] * 10 + list(range(3 * i, 3 * i + 9)) for i in range(5)]
        for i, prompt in enumerate(prompts):
            loop.submit(ServeRequest(request_id=f"r{i}", prompt=tuple(prompt), max_new_tokens=6))
        results = loop.drain()
    assert len(results) == 5 and all(r.finish_reason == "length" for r in results)
    assert passes
    if by_page:
        for pages, seen in passes:
            assert set(pages) <= seen  # every page of every pass announced before it ran
        # Per new page, not per page of every pass: far fewer than the passes' pages in all.
        total = sum(len(pages) for pages in announced.announced)
        assert total < sum(len(pages) for pages, _seen in passes)
    return announced.announced


def _cuda_pools(gpu_blocks: int = 8) -> KVPools:
    return KVPools(CacheConfig(block_size=16, gpu_blocks=gpu_blocks, host_blocks=gpu_blocks,
                               layout=KVLayout(num_layers=32, num_kv_heads=8, head_dim=128,
                                               dtype="bfloat16")), "cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_a_pass_over_a_page_waits_for_the_copy_out_of_it() -> None:
    pools = _cuda_pools()
    engine = TorchCopyEngine(pools, compute_waits="pages")
    page = pools.gpu_page(PageId(0))
    page.fill_(9)
    # Copies of other pages first, so the copy stream is still busy when the pass is queued.
    engine.copy_pages([(PageId(i), PageId(i)) for i in range(1, 8)], to_gpu=False)
    engine.copy_pages([(PageId(0), PageId(0))], to_gpu=False)
    engine.wait_for_pages([PageId(0)])
    page.fill_(1)                         # the pass writes the page the copy reads
    engine.fence().wait()
    assert bool((pools.host_page(PageId(0)) == 9).all())
    assert engine.statistics().page_waits == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_a_pass_over_a_page_sees_the_copy_into_it() -> None:
    pools = _cuda_pools()
    engine = TorchCopyEngine(pools, compute_waits="pages")
    # Copies out of other pages first (into host pages 0-6, not the source below: a copy
    # into it would land first, in stream order), so the copy stream is still busy.
    pools.host_page(PageId(7)).fill_(5)
    engine.copy_pages([(PageId(i), PageId(i)) for i in range(7)], to_gpu=False)
    engine.copy_pages([(PageId(7), PageId(7))], to_gpu=True)
    engine.wait_for_pages([PageId(7)])
    total = pools.gpu_page(PageId(7)).to(torch.int64).sum()  # on the compute stream
    assert int(total) == 5 * pools.block_nbytes


def _warm(engine: TorchCopyEngine, pools: KVPools) -> None:
    """A first spill compiles the host checksum kernel (0.7 s on an H200): long enough for any
    copy queued after it to be over before a test looks.  A cache does this when it opens."""
    engine.copy_pages([(PageId(0), PageId(0))], to_gpu=False)
    engine.fence().wait()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_a_pass_over_other_pages_does_not_wait_for_a_copy() -> None:
    """The point of the mode: a long spill of pages the pass does not use leaves it alone."""
    pools = _cuda_pools(gpu_blocks=256)   # 256 x 2 MiB: a copy of about 10 ms
    engine = TorchCopyEngine(pools, compute_waits="pages")
    # The checksum kernel compiled first, and the pass's own kernel loaded: CUDA loads a
    # kernel's module at its first launch (lazy loading), which may synchronize the whole
    # context, copy stream included.
    _warm(engine, pools)
    pools.gpu_page(PageId(255)).add_(1)
    torch.cuda.synchronize()
    engine.copy_pages([(PageId(i), PageId(i)) for i in range(255)], to_gpu=False)
    spill_done = torch.cuda.Event()  # type: ignore[no-untyped-call]
    spill_done.record(engine._stream)  # a test may look inside
    engine.wait_for_pages([PageId(255)])
    pools.gpu_page(PageId(255)).add_(1)
    pass_done = torch.cuda.Event()  # type: ignore[no-untyped-call]
    pass_done.record()
    start = time.perf_counter()
    pass_done.synchronize()
    assert not spill_done.query(), (  # type: ignore[no-untyped-call]
        "the pass waited for the spill of pages it does not use")
    assert time.perf_counter() - start < 0.5
    spill_done.synchronize()




@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("compute_waits", ["all", "pages"])
def test_cuda_a_spill_write_does_not_wait_for_copies_into_other_pages(
    compute_waits: str,
) -> None:
    """Another request's eviction to host, queued after the copy that filled the spilled
    page: the write's fence is past once its own page's copy is, with the eviction running."""
    pools = _cuda_pools(gpu_blocks=256)   # 255 x 2 MiB: a copy of about 10 ms
    engine = TorchCopyEngine(pools, compute_waits=compute_waits)
    _warm(engine, pools)
    pools.gpu_page(PageId(0)).fill_(9)
    engine.copy_pages([(PageId(0), PageId(0))], to_gpu=False)
    engine.copy_pages([(PageId(i), PageId(i)) for i in range(1, 256)], to_gpu=False)
    eviction_done = torch.cuda.Event()  # type: ignore[no-untyped-call]
    eviction_done.record(engine._stream)  # a test may look inside
    engine.fence_for_host_pages([PageId(0)]).wait()
    assert not eviction_done.query(), (  # type: ignore[no-untyped-call]
        "the write waited for the copies into pages it does not read")
    host = pools.host_page(PageId(0))
    assert bool((host == 9).all())
    checksums = pools.host_checksums
    if checksums is not None:   # written by the kernel in the same batch as the copy
        assert checksums.of(PageId(0)) == payload_checksum(host_view(host))
    eviction_done.synchronize()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_a_spill_write_waits_for_the_last_copy_into_its_page() -> None:
    """A page filled, then other pages, then the same page again (freed and reused): the
    write's fence is the second fill's, behind the long copy in between."""
    pools = _cuda_pools(gpu_blocks=256)
    engine = TorchCopyEngine(pools)
    _warm(engine, pools)
    pools.gpu_page(PageId(0)).fill_(3)
    engine.copy_pages([(PageId(0), PageId(0))], to_gpu=False)
    engine.copy_pages([(PageId(i), PageId(i)) for i in range(1, 255)], to_gpu=False)
    pools.gpu_page(PageId(255)).fill_(7)   # on the compute stream: the copy waits for it
    engine.copy_pages([(PageId(255), PageId(0))], to_gpu=False)
    engine.fence_for_host_pages([PageId(3), PageId(0)]).wait()
    host = pools.host_page(PageId(0))
    assert bool((host == 7).all())
    checksums = pools.host_checksums
    if checksums is not None:
        assert checksums.of(PageId(0)) == payload_checksum(host_view(host))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tokens_through_disk_are_identical_with_page_waits() -> None:
    """The serving loop over the real cache on a GPU, steps waiting only for their own pages'
    copies: every block reused through host and disk gives the tokens an unlimited GPU pool
    gives (as tests/test_serving_identity.py on the CPU)."""
    from models.chat_run import Budgets, identical_outputs, run_workload, token_match_rate
    from models.workloads import ChatWorkload, ChatWorkloadConfig
    from tests.io_helpers import wait_quiet

    model = PagedDecoder(preset("tiny"), device="cuda")

    def chat() -> ChatWorkload:
        return ChatWorkload(ChatWorkloadConfig(
            num_users=10, num_rounds=3, system_prompt_tokens=64, question_tokens=20,
            answer_tokens=10, arrival_rate=100.0, vocab_size=model.config.vocab_size, seed=3,
            ttl_seconds=300.0, retained_fraction=0.5))

    tight = Budgets(block_size=16, gpu_blocks=24, host_blocks=4, reserved_host_blocks=8,
                    disk_blocks=2048)
    roomy = Budgets(block_size=16, gpu_blocks=1024, host_blocks=0, reserved_host_blocks=0,
                    disk_blocks=0)
    quiet = run_workload(model, chat(), tight, device="cuda", cost_aware_onboarding=False,
                         after_step=wait_quiet, compute_waits="pages")
    reference = run_workload(model, chat(), roomy, device="cuda")
    assert quiet.cache.cache.onboards_completed > 0 and quiet.cache.cache.spills_completed > 0
    assert identical_outputs(quiet, reference) == (30, 30)
    # Without waiting between steps: copies race the passes, which wait for their own pages.
    racing = run_workload(model, chat(), tight, device="cuda", cost_aware_onboarding=False,
                          compute_waits="pages")
    recompute = run_workload(model, chat(), roomy, device="cuda", salt_every_request=True)
    assert racing.cache.cache.io_errors == 0
    assert token_match_rate(racing, recompute) >= 0.9
