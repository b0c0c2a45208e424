"""A clean close keeps the retention promise: released content whose TTL runs is written to
disk before the cache closes, wherever it was (GPU or host), so the next process finds it --
byte for byte.  Best-effort content still on GPU or host is not written at close."""

from __future__ import annotations

from pathlib import Path

from io_actors.embed import BlockingCache
from tests.io_helpers import check_pages, compute, small_config

BS = 4


def _wait(cache: BlockingCache, rid: str) -> None:
    for _ in range(10_000):
        if cache.is_ready(rid):
            return
        cache.wait_ready(rid, timeout=0.01)
    raise AssertionError(f"{rid} never became ready")


def test_retained_content_on_gpu_and_host_at_a_clean_close_is_found_after_a_restart(
        tmp_path: Path) -> None:
    config = small_config(tmp_path, gpu=8, host=2, reserved_host=1, disk=32)
    kept = [list(range(100 + 10 * i, 100 + 10 * i + 2 * BS + 1)) for i in range(3)]
    loose = list(range(500, 500 + 2 * BS + 1))
    with BlockingCache(config) as cache:
        for i, tokens in enumerate(kept):
            cache.add_request(f"k{i}", tokens, ttl_seconds=3600)
            compute(cache, f"k{i}", tokens)
            cache.release(f"k{i}")          # the oldest go to host, the newest stay on GPU
        cache.add_request("b", loose)
        compute(cache, "b", loose)
        cache.release("b")
    report = cache.close_report
    assert report is not None and report.retained_not_written == 0
    with BlockingCache(config) as cache:
        for i, tokens in enumerate(kept):
            match = cache.add_request(f"r{i}", tokens)
            assert match.disk_tokens == 2 * BS, (i, match)
            _wait(cache, f"r{i}")
            check_pages(cache, f"r{i}", tokens, 2)
            cache.release(f"r{i}")
        assert cache.add_request("rb", loose).matched_tokens == 0   # best-effort: not kept


def test_a_close_that_cannot_write_every_retained_block_says_how_many(tmp_path: Path) -> None:
    # Two slots, protect_unexpired: the disk holds two retained blocks and refuses the rest.
    config = small_config(tmp_path, gpu=8, host=2, reserved_host=1, disk=2,
                          protect_unexpired=True)
    kept = [list(range(100 + 10 * i, 100 + 10 * i + 2 * BS + 1)) for i in range(2)]
    with BlockingCache(config) as cache:
        for i, tokens in enumerate(kept):
            cache.add_request(f"k{i}", tokens, ttl_seconds=3600)
            compute(cache, f"k{i}", tokens)
            cache.release(f"k{i}")
    report = cache.close_report
    assert report is not None and report.retained_not_written == 2
