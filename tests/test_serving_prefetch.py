"""The serving loop prefetches for requests in its waiting queue, and reports prefill rates."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path

import attrs
import pytest

from io_actors.config import StateKVConfig
from io_actors.embed import BlockingCache
from models.config import preset
from models.model import PagedDecoder
from models.serving_loop import RequestResult, ServeRequest, ServingLoop
from statekv import UsageError
from statekv.manager import PrefetchStarted
from tests.harness import count_encodings
from tests.io_helpers import wait_quiet

PROMPT = tuple(range(13))  # three full blocks of 4


def serving_config(tmp_path: Path, model: PagedDecoder, *, disk: bool = True
                   ) -> StateKVConfig:
    """The small serving setup of these tests (and test_serving_breakdown's): blocks of 4
    tokens, 24 GPU pages and, with `disk`, 6 host pages (2 reserved) and 64 disk slots in
    `tmp_path`; without it, the GPU tier alone."""
    return StateKVConfig(
        layout=model.config.kv_layout(), block_size=4, gpu=24,
        host=6 if disk else 0, reserved_host=2 if disk else 0, disk=64 if disk else 0,
        disk_dir=tmp_path, device="cpu", model_fingerprint=model.config.fingerprint(),
        # These tests are about prefetch and disk reads: every disk hit is read whatever the
        # measured rates, and a running request's GPU evictions spill host content before
        # they take a waiting request's prefetched pages.
        cost_aware_onboarding=False, reclaim_prefetched_first=False,
    )


def _cache(tmp_path: Path, model: PagedDecoder) -> BlockingCache:
    return BlockingCache(serving_config(tmp_path, model))


def _until(done: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "prefetch reads did not land"
        time.sleep(0.001)


def push_prompt_to_disk(loop: ServingLoop, cache: BlockingCache, *, min_on_disk: int = 1
                        ) -> None:
    """Serve PROMPT, then eight fresh prompts that push its blocks out to the disk tier;
    asserts that at least `min_on_disk` cached blocks are ON_DISK afterwards."""
    loop.submit(ServeRequest(request_id="first", prompt=PROMPT, max_new_tokens=2))
    loop.drain()
    for i in range(8):
        fresh = (100 + i, *((13 * t + 7 * i) % 300 + 150 for t in range(59)))
        loop.submit(ServeRequest(request_id=f"churn{i}", prompt=fresh, max_new_tokens=1))
        loop.drain()
        wait_quiet(cache)
    on_disk = sum(1 for b in cache.cached_blocks() if b.state.name == "ON_DISK")
    assert on_disk >= min_on_disk


def test_a_waiting_request_prefetches_and_is_admitted_with_host_hits(tmp_path: Path) -> None:
    model = PagedDecoder(preset("tiny"), device="cpu")
    with _cache(tmp_path, model) as cache:
        loop = ServingLoop(model, cache, max_running=1, prefetch_ahead=2)
        push_prompt_to_disk(loop, cache)
        # One long request runs; the next one waits in the queue and prefetches meanwhile.
        # "long" is admitted first and its prefill's evictions spill before "again" arrives:
        # were they still in flight, host pressure would find no host content it could take
        # and reclaim the prefetched pages instead (as designed), which only thread timing
        # on a loaded machine would decide.
        loop.submit(ServeRequest(request_id="long", prompt=tuple(range(460, 500)),
                                 max_new_tokens=30))
        finished: list[RequestResult] = loop.step()
        wait_quiet(cache)
        loop.submit(ServeRequest(request_id="again", prompt=(*PROMPT, 7, 7),
                                 max_new_tokens=2))
        # The reads land while "long" runs -- made certain here, not left to thread timing on
        # a loaded machine: each step's prefetch reads land before the next step.
        while not loop.idle:
            finished += loop.step()
            _until(lambda: cache.statistics().cache.prefetch_reads_in_flight == 0)
            wait_quiet(cache)  # spills land too: the pages they free are what prefetch takes
        done = {r.request_id: r for r in finished}
        again = done["again"]
        stats = cache.statistics().cache
        assert stats.prefetches > 0 and stats.prefetch_hits > 0, stats
        assert again.host_tokens == 12 and again.disk_tokens == 0, again
        assert stats.prefetching_requests == 0 and stats.prefetched_blocks == 0
        # The loop reported its prefills: the prefill estimate exists.
        assert cache.cost_estimates()[1] is not None
        cache.check_invariants()


def test_a_prefetched_request_is_encoded_and_keyed_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The loop asks for a queued request's disk blocks every step and then admits it: the
    cache checks and encodes its prompt once, at the first prefetch."""
    model = PagedDecoder(preset("tiny"), device="cpu")
    with _cache(tmp_path, model) as cache:
        loop = ServingLoop(model, cache, max_running=1, prefetch_ahead=2)
        push_prompt_to_disk(loop, cache)
        prompt = (*PROMPT, 7, 7)
        encoded = count_encodings(monkeypatch)
        loop.submit(ServeRequest(request_id="long", prompt=tuple(range(460, 500)),
                                 max_new_tokens=8))
        loop.submit(ServeRequest(request_id="again", prompt=prompt, max_new_tokens=2))
        done = {r.request_id: r for r in loop.drain(timeout=60)}
        assert "again" in done and cache.statistics().cache.prefetches > 0
        assert encoded.count(prompt) == 1, encoded
        cache.check_invariants()


def test_a_waiting_request_cancelled_gives_its_prefetched_pages_back(tmp_path: Path) -> None:
    model = PagedDecoder(preset("tiny"), device="cpu")
    with _cache(tmp_path, model) as cache:
        loop = ServingLoop(model, cache, max_running=1, prefetch_ahead=1)
        push_prompt_to_disk(loop, cache)
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


class CountingCache(BlockingCache):
    """The real cache, with every prefetch call recorded: (request, whether a prefetch could
    start as the call was made, the blocks it left unfetched); and every call of
    prefetch_reads_pending and prefetch, in order."""

    def __init__(self, config: StateKVConfig) -> None:
        super().__init__(config)
        self.asks: list[tuple[str, bool, int]] = []
        self.calls: list[tuple[str, str, int]] = []

    def prefetch_reads_pending(self, request_id: str) -> int:
        pending = super().prefetch_reads_pending(request_id)
        self.calls.append(("pending", request_id, pending))
        return pending

    def prefetch(self, request_id: str, token_ids: Sequence[int], *,
                 cache_salt: str | None = None, lora_id: int | None = None
                 ) -> PrefetchStarted:
        could = self.prefetch_could_start()
        got = super().prefetch(request_id, token_ids, cache_salt=cache_salt, lora_id=lora_id)
        self.asks.append((request_id, could, got.unfetched_tokens))
        self.calls.append(("ask", request_id, got.started_tokens))
        return got


def test_a_stalled_prefetch_is_asked_again_only_when_a_host_page_could_be_had(
        tmp_path: Path) -> None:
    """A queued request whose prefetch found too few host pages is asked again only once
    one could be had: not at every step, where each ask walks the whole prompt's chain
    under the cache's lock and starts nothing.  Admitted, it reads the rest and runs."""
    model = PagedDecoder(preset("tiny"), device="cpu")
    # Two host pages (and two reserved): PROMPT's three disk blocks cannot all be prefetched.
    config = attrs.evolve(serving_config(tmp_path, model), host=2)
    cache = CountingCache(config)
    with cache:
        loop = ServingLoop(model, cache, max_running=1, prefetch_ahead=2)
        push_prompt_to_disk(loop, cache, min_on_disk=3)
        loop.submit(ServeRequest(request_id="long", prompt=tuple(range(460, 500)),
                                 max_new_tokens=30))
        loop.step()
        wait_quiet(cache)
        cache.asks.clear()
        loop.submit(ServeRequest(request_id="again", prompt=(*PROMPT, 7, 7),
                                 max_new_tokens=2))
        steps = 0
        finished: list[RequestResult] = []
        while not loop.idle:
            finished += loop.step()
            steps += 1
            wait_quiet(cache)
        asks = [(could, unfetched) for rid, could, unfetched in cache.asks if rid == "again"]
        assert asks and asks[0][1] > 0, asks  # the first ask stalled
        # Every ask after the first came when a page could be had; the waiting steps
        # (the long request's decode) did not each ask again.
        assert all(could for could, _ in asks[1:]), asks
        assert len(asks) < steps - 10, (asks, steps)
        # Once its reads were seen landed, the loop looks again only after another ask: the
        # cache starts a request's reads only at its own asks.
        looked_after_landing = []
        landed = False
        for kind, rid, n in cache.calls:
            if rid != "again":
                continue
            if kind == "ask":
                landed = False
            elif landed:
                looked_after_landing.append(n)
            else:
                landed = n == 0
        assert not looked_after_landing, cache.calls
        assert any(kind == "pending" for kind, rid, _ in cache.calls if rid == "again")
        again = {r.request_id: r for r in finished}["again"]
        assert again.host_tokens + again.disk_tokens == 12, again
        cache.check_invariants()


def test_prefetch_ahead_must_be_a_count() -> None:
    model = PagedDecoder(preset("tiny"), device="cpu")
    for bad in (-1, 1.5, True):
        with pytest.raises(UsageError) as info:
            ServingLoop(model, None, prefetch_ahead=bad)  # type: ignore[arg-type]
        assert info.value.field == "prefetch_ahead"
