"""The serving loop prefetches for requests in its waiting queue, and reports prefill rates."""

from __future__ import annotations

from pathlib import Path

import pytest

from io_actors.config import StateKVConfig
from io_actors.embed import BlockingCache
from models.config import preset
from models.model import PagedDecoder
from models.serving_loop import ServeRequest, ServingLoop
from statekv import UsageError
from tests.io_helpers import wait_quiet

PROMPT = tuple(range(13))  # three full blocks of 4


def _cache(tmp_path: Path, model: PagedDecoder) -> BlockingCache:
    return BlockingCache(StateKVConfig(
        layout=model.config.kv_layout(), block_size=4, gpu=24, host=6, reserved_host=2,
        disk=64, disk_dir=tmp_path, device="cpu", model_fingerprint=model.config.fingerprint(),
        # This test is about prefetch: every disk hit is read whatever the measured rates,
        # and the running request's GPU evictions spill host content before they take the
        # waiting request's prefetched pages.
        cost_aware_onboarding=False, reclaim_prefetched_first=False,
    ))


def _push_prompt_to_disk(loop: ServingLoop, cache: BlockingCache) -> None:
    loop.submit(ServeRequest(request_id="first", prompt=PROMPT, max_new_tokens=2))
    loop.drain()
    for i in range(8):
        fresh = (100 + i, *((13 * t + 7 * i) % 300 + 150 for t in range(59)))
        loop.submit(ServeRequest(request_id=f"churn{i}", prompt=fresh, max_new_tokens=1))
        loop.drain()
        wait_quiet(cache)
    cached = {b.state.name for b in cache.cached_blocks()}
    assert "ON_DISK" in cached


def test_a_waiting_request_prefetches_and_is_admitted_with_host_hits(tmp_path: Path) -> None:
    model = PagedDecoder(preset("tiny"), device="cpu")
    with _cache(tmp_path, model) as cache:
        loop = ServingLoop(model, cache, max_running=1, prefetch_ahead=2)
        _push_prompt_to_disk(loop, cache)
        # One long request runs; the next one waits in the queue and prefetches meanwhile.
        loop.submit(ServeRequest(request_id="long", prompt=tuple(range(460, 500)),
                                 max_new_tokens=30))
        loop.submit(ServeRequest(request_id="again", prompt=(*PROMPT, 7, 7),
                                 max_new_tokens=2))
        done = {r.request_id: r for r in loop.drain()}
        again = done["again"]
        stats = cache.statistics().cache
        assert stats.prefetches > 0 and stats.prefetch_hits > 0, stats
        assert again.host_tokens == 12 and again.disk_tokens == 0, again
        assert stats.prefetching_requests == 0 and stats.prefetched_blocks == 0
        # The loop reported its prefills: the prefill estimate exists.
        assert cache.cost_estimates()[1] is not None
        cache.check_invariants()


def test_a_waiting_request_cancelled_gives_its_prefetched_pages_back(tmp_path: Path) -> None:
    model = PagedDecoder(preset("tiny"), device="cpu")
    with _cache(tmp_path, model) as cache:
        loop = ServingLoop(model, cache, max_running=1, prefetch_ahead=1)
        _push_prompt_to_disk(loop, cache)
        loop.submit(ServeRequest(request_id="long", prompt=tuple(range(460, 500)),
                                 max_new_tokens=30))
        loop.submit(ServeRequest(request_id="again", prompt=PROMPT, max_new_tokens=2))
        loop.step()
        assert cache.statistics().cache.prefetching_requests == 1
        assert loop.cancel("again")
        assert cache.statistics().cache.prefetching_requests == 0
        loop.drain()
        wait_quiet(cache)
        stats = cache.statistics().cache
        assert stats.prefetched_blocks == 0 and stats.prefetch_reads_in_flight == 0
        cache.check_invariants()  # every host page and slot owned exactly once


def test_prefetch_ahead_must_be_a_count() -> None:
    model = PagedDecoder(preset("tiny"), device="cpu")
    for bad in (-1, 1.5, True):
        with pytest.raises(UsageError) as info:
            ServingLoop(model, None, prefetch_ahead=bad)  # type: ignore[arg-type]
        assert info.value.field == "prefetch_ahead"
