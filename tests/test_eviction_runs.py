"""One allocation evicts a run of GPU victims in one pass (Eviction.take_gpu_pages): the same
victims, pages, records, transitions, trace and counters as one take_gpu_page per page --
with a host tier, and with a disk tier whose spills, displacements and reads (a run of blocks
only on disk takes its pages in one call too) are in flight and land between calls."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from statekv import CacheConfig, KVCacheManager, OutOfBlocks, RingTrace
from statekv.eviction import Eviction
from statekv.ids import PageId
from tests.harness import Executor

BLOCK = 2
DOCS = [[d * 100 + i for i in range(40)] for d in range(3)]
"""Prompts are prefixes of these, so requests share blocks and come back to them."""


@contextmanager
def one_page_at_a_time() -> Iterator[None]:
    """take_gpu_pages as it was: a take_gpu_page call per page."""
    batched = Eviction.__dict__["take_gpu_pages"]

    def per_page(self: Eviction, count: int, now: float) -> list[PageId]:
        return [self.take_gpu_page(now) for _ in range(count)]

    Eviction.take_gpu_pages = per_page  # type: ignore[method-assign]
    try:
        yield
    finally:
        Eviction.take_gpu_pages = batched  # type: ignore[method-assign]


Op = tuple[int, int, int, int, int]
ops = st.lists(st.tuples(st.integers(0, 5), st.integers(0, 2), st.integers(1, 40),
                         st.integers(0, 2), st.integers(0, 4)), max_size=40)
churn = st.lists(st.tuples(st.integers(0, 2), st.integers(0, 2), st.integers(4, 40),
                           st.integers(0, 2), st.integers(0, 2)), min_size=10, max_size=40)
"""Fewer requests at once and longer programs: content goes down to disk and comes back."""


def run(config: CacheConfig, program: list[Op]) -> list[Any]:
    """Serve `program` and return everything observable after each step.

    Odd request slots ask for a TTL.  With a disk tier, the transfers each step starts are
    executed as the actors would, and `priority` 2 lands them all before the step (else they
    stay in flight)."""
    trace = RingTrace(10_000)
    cache = KVCacheManager(config, trace=trace)
    executor = Executor(cache)
    seen: list[Any] = []
    now = 0.0
    for step, (slot, doc, length, priority, extra) in enumerate(program):
        rid = f"r{slot}"
        now += 1.0
        executor.now = now
        if config.disk_blocks:
            if priority == 2:
                executor.drain()
            seen.append(executor.pump())
        if cache.has_request(rid):
            cache.release(rid, now=now)
            seen.append(("released", rid))
            continue
        # Room for the prompt and `extra` appended tokens in the whole GPU pool.
        prompt = DOCS[doc][:min(length, config.gpu_blocks * BLOCK - extra)]
        try:
            # Odd slots ask for a TTL that outlives some steps (retention, its expiry).
            ttl = 5.0 if slot % 2 else None
            match = cache.add_request(rid, prompt, now=now, priority=priority, ttl_seconds=ttl)
        except OutOfBlocks:
            seen.append(("no room to match", rid))
            continue
        seen.append(match)
        if extra:
            cache.append_tokens(rid, [step + 1000 + i for i in range(extra)])
        total = cache.request_status(rid).num_tokens
        try:
            cache.allocate_nowait(rid, total, now=now)
        except OutOfBlocks:
            seen.append(("no room to allocate", rid))
            continue
        if not cache.is_ready(rid):
            seen.append(executor.pump())
            executor.drain()  # its reads land before its forward pass
        cache.commit(rid, total, now=now)
        seen.append(cache.block_table(rid))
        seen.append(cache.statistics())
    if config.disk_blocks:
        seen.append(executor.pump())
        executor.drain()
        seen.append(executor.log)
    seen.append(cache.cached_blocks())
    seen.append(list(trace.records()))
    cache.check_invariants()
    return seen


@settings(max_examples=150, deadline=None)
@given(gpu=st.integers(4, 16), host=st.sampled_from([0, 0, 2]), program=ops)
def test_one_allocation_evicts_a_run_as_page_by_page_eviction_would(
        gpu: int, host: int, program: list[Op]) -> None:
    config = CacheConfig(block_size=BLOCK, gpu_blocks=gpu, host_blocks=host, priority_levels=3)
    batched = run(config, program)
    with one_page_at_a_time():
        assert run(config, program) == batched


@settings(max_examples=300, deadline=None)
@given(gpu=st.integers(4, 12), host=st.integers(1, 6), disk=st.integers(2, 12),
       spill=st.sampled_from(["all", "retained_only", "reused"]), program=churn)
def test_a_run_of_victims_spilling_to_disk_goes_down_as_page_by_page_eviction_would(
        gpu: int, host: int, disk: int, spill: str, program: list[Op]) -> None:
    """GPU victims copied to host push host victims to disk (or drop them), displacing disk
    content, while earlier writes and reads are still in flight."""
    config = CacheConfig(block_size=BLOCK, gpu_blocks=gpu, host_blocks=host,
                         disk_blocks=disk, priority_levels=3, spill_mode=spill,
                         max_batch_blocks=3)
    batched = run(config, program)
    with one_page_at_a_time():
        assert run(config, program) == batched


def test_a_run_of_victims_crosses_priority_levels_in_eviction_order() -> None:
    """Cached content at two priority levels, then one allocation that needs it all."""
    config = CacheConfig(block_size=BLOCK, gpu_blocks=8, priority_levels=2)
    serve_then_release = [(0, 0, 9, 1, 0)] * 2 + [(1, 1, 9, 0, 0)] * 2
    program: list[Op] = [*serve_then_release, (2, 2, 15, 0, 0)]
    batched = run(config, program)
    with one_page_at_a_time():
        assert run(config, program) == batched
    # r1 took 4 empty pages and evicted one of r0's blocks; r2 takes the last empty page
    # and evicts r1's 4 blocks (priority 0) and then r0's 3 left (priority 1).
    assert batched[-3].gpu_evictions == 1 + 7
