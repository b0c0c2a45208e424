"""Prefetch and cost-aware onboarding through the real actors (CPU pools, POSIX slot files)."""

from __future__ import annotations

import time
from pathlib import Path

from io_actors.embed import BlockingCache
from tests.io_helpers import check_pages, compute, serve, small_config, wait_quiet, wait_ready


def churn(cache: BlockingCache, rounds: int, start: int = 1000) -> None:
    for i in range(rounds):
        serve(cache, f"churn{start + i}", [start * 10 + i * 100 + t for t in range(17)])
        wait_quiet(cache)


def wait_prefetched(cache: BlockingCache, blocks: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        stats = cache.statistics().cache
        if stats.prefetch_reads_in_flight == 0 and stats.prefetched_blocks == blocks:
            return
        assert time.monotonic() < deadline, f"prefetch did not land: {stats}"
        time.sleep(0.001)


def test_a_prefetched_request_is_admitted_with_host_hits_and_identical_kv(
    tmp_path: Path,
) -> None:
    prompt = list(range(13))  # three full blocks of 4 and one token
    with BlockingCache(small_config(tmp_path, host=4)) as cache:
        serve(cache, "first", prompt)
        churn(cache, 6)
        # Host pages come back as the spills that made room land: the serving loop asks
        # again each step, and each call starts what it can.
        fetched = 0
        for _ in range(20):
            got = cache.prefetch("q", prompt)
            fetched = got.started_tokens + got.shared_tokens
            if fetched == 12:
                break
            wait_quiet(cache)
        assert fetched == 12
        wait_prefetched(cache, 3)
        match = cache.add_request("q", prompt)
        assert (match.host_tokens, match.disk_tokens) == (12, 0) and match.ready, match
        check_pages(cache, "q", prompt, 3)
        compute(cache, "q", prompt)
        cache.release("q")
        stats = cache.statistics().cache
        assert stats.prefetch_hits == 3 and stats.prefetch_failures == 0
        assert stats.bytes_read == 3 * cache.config.block_bytes
        # The reader measured its reads: the disk rate estimate exists.
        disk_rate, _ = cache.cost_estimates()
        assert disk_rate is not None and disk_rate > 0
        cache.check_invariants()


def test_a_queued_request_that_leaves_gives_its_pages_back(tmp_path: Path) -> None:
    prompt = list(range(13))
    with BlockingCache(small_config(tmp_path, host=4)) as cache:
        serve(cache, "first", prompt)
        churn(cache, 6)
        assert cache.prefetch("q", prompt).started_tokens > 0
        cache.release("q")  # possibly while the reads are in flight
        deadline = time.monotonic() + 10
        while cache.statistics().cache.prefetch_reads_in_flight:
            assert time.monotonic() < deadline
            time.sleep(0.001)
        stats = cache.statistics().cache
        assert stats.prefetched_blocks == 0
        assert stats.prefetches_cancelled == stats.prefetches_completed > 0
        cache.check_invariants()  # host pages and slots: each owned exactly once
        # The content is still on disk and is read back as usual.
        match = cache.add_request("again", prompt)
        assert match.disk_tokens == 12
        wait_ready(cache, "again")
        check_pages(cache, "again", prompt, 3)


def test_a_measured_disk_slower_than_the_reported_prefill_is_not_read(tmp_path: Path) -> None:
    prompt = list(range(13))
    with BlockingCache(small_config(tmp_path)) as cache:
        serve(cache, "first", prompt)
        churn(cache, 6)
        serve(cache, "read-once", prompt)  # an onboard: the readers measure the disk
        assert cache.cost_estimates()[0] is not None
        churn(cache, 6, start=2000)
        # A model that prefills far faster than any disk: recomputing wins.
        cache.report_prefill(13, 13e-12, context_tokens=13)
        match = cache.add_request("again", prompt)
        assert match.skipped_disk_tokens == 12 and match.matched_tokens == 0, match
        assert match.ready
        stats = cache.statistics().cache
        assert stats.onboards_skipped_as_too_slow == 3
        assert stats.onboard_tokens_skipped_as_too_slow == 12
        cache.release("again")
        cache.check_invariants()


def test_synchronous_io_prefetches_inside_the_call(tmp_path: Path) -> None:
    """The naive design the benchmarks compare with: the prefetch read runs inside the call,
    and its rate is reported to the core under the same lock."""
    prompt = list(range(13))
    with BlockingCache(small_config(tmp_path, host=4), synchronous_io=True) as cache:
        serve(cache, "first", prompt)
        churn(cache, 6)
        fetched = 0
        for _ in range(10):
            got = cache.prefetch("q", prompt)
            fetched = got.started_tokens + got.shared_tokens
            if fetched == 12:
                break
        assert fetched == 12
        assert cache.statistics().cache.prefetched_blocks == 3  # landed already
        assert cache.cost_estimates()[0] is not None
        match = cache.add_request("q", prompt)
        assert match.host_tokens == 12 and match.ready
        check_pages(cache, "q", prompt, 3)
