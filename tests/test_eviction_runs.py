"""One allocation evicts a run of GPU victims in one pass (Eviction.take_gpu_pages): the same
victims, pages, records, transitions, trace and counters as one take_gpu_page per page."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from statekv import CacheConfig, KVCacheManager, OutOfBlocks, RingTrace
from statekv.eviction import Eviction
from statekv.ids import PageId

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


def run(config: CacheConfig, program: list[Op]) -> list[Any]:
    """Serve `program` and return everything observable after each step."""
    trace = RingTrace(10_000)
    cache = KVCacheManager(config, trace=trace)
    seen: list[Any] = []
    now = 0.0
    for step, (slot, doc, length, priority, extra) in enumerate(program):
        rid = f"r{slot}"
        now += 1.0
        if cache.has_request(rid):
            cache.release(rid, now=now)
            seen.append(("released", rid))
            continue
        # Room for the prompt and `extra` appended tokens in the whole GPU pool.
        prompt = DOCS[doc][:min(length, config.gpu_blocks * BLOCK - extra)]
        try:
            match = cache.add_request(rid, prompt, now=now, priority=priority)
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
        cache.commit(rid, total, now=now)
        seen.append(cache.block_table(rid))
        seen.append(cache.statistics())
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
