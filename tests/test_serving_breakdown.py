"""Where a request's time to first token goes, and reads overlapping with compute.

A real disk tier (POSIX slot files) under fault injection: every read sleeps in a SLOW fault
whose sleep waits for the test to let it go, so a read is in flight for as long as a test
needs it to be, whatever the machine's speed.  No timed assertion: the checks are about
which steps ran while a read was held, and about the order of what the loop recorded.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from bench.serving import breakdown_line, breakdown_summary, residency_line, residency_summary
from io_actors.embed import BlockingCache
from io_actors.storage.faults import Fault, FaultPlan, FaultRule, FaultyStore, Op
from io_actors.storage.posix import PosixSlotStore
from models.config import preset
from models.model import PagedDecoder
from models.serving_loop import RequestResult, ServeRequest, ServingLoop
from tests.test_serving_prefetch import PROMPT, push_prompt_to_disk, serving_config

DISK_TOKENS = 12
ROUNDING = 1e-9
"""Parts are differences of one clock's readings: they add up to the TTFT up to float
rounding, never more."""


class HeldReads:
    """The sleep of a SLOW read fault: while held, every read waits in it until released."""

    def __init__(self) -> None:
        self._free = threading.Event()
        self._free.set()
        self._lock = threading.Lock()
        self.waiting = 0
        """Reads inside the sleep now."""

    def hold(self) -> None:
        self._free.clear()

    def release(self) -> None:
        self._free.set()

    def __call__(self, _seconds: float) -> None:
        with self._lock:
            self.waiting += 1
        try:
            assert self._free.wait(60), "a held read was never released"
        finally:
            with self._lock:
                self.waiting -= 1


def _until(done: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, what
        time.sleep(0.001)


def _until_spilled(cache: BlockingCache) -> None:
    """Until no spill is queued or writing (reads may be held)."""
    def spilled() -> bool:
        stats = cache.statistics()
        return stats.cache.writes_in_flight == 0 and stats.spill_backlog == 0
    _until(spilled, "a spill never landed")


@contextmanager
def _disk_cache(tmp_path: Path, model: PagedDecoder, held: HeldReads
                ) -> Iterator[BlockingCache]:
    config = serving_config(tmp_path, model)
    rank_dir = config.rank_directory()
    assert rank_dir is not None
    plan = FaultPlan(rules=(FaultRule(op=Op.READ, fault=Fault.SLOW, nth=1, onward=True),))
    store = FaultyStore(PosixSlotStore(rank_dir, config.core_config()), plan, sleep=held)
    try:
        with BlockingCache(config, store=store) as cache:
            try:
                yield cache
            finally:
                held.release()  # before the close, which waits for reads in flight
    finally:
        store.close()


def _requests(salted: bool) -> list[ServeRequest]:
    """A request whose prefix is on disk (when cached), and one with a fresh prompt that
    decodes for a while; `salted`: nothing is reused, as in the recompute-only baseline."""
    return [
        ServeRequest(request_id="disk-hit", prompt=(*PROMPT, 7, 7), max_new_tokens=2,
                     cache_salt="disk-hit" if salted else None),
        ServeRequest(request_id="fresh", prompt=tuple(range(460, 480)), max_new_tokens=6,
                     cache_salt="fresh" if salted else None),
    ]


def _check_parts(results: list[RequestResult]) -> None:
    for result in results:
        parts = result.breakdown()
        assert parts is not None and result.ttft is not None, result
        assert parts.ttft_s == result.ttft
        for name, value in parts.parts().items():
            assert value >= -ROUNDING, (result.request_id, name, parts)
        measured = parts.queue_s + parts.prefetch_s + parts.parked_s + parts.prefill_s
        assert measured <= result.ttft + ROUNDING, parts
        assert abs(sum(parts.parts().values()) - result.ttft) <= ROUNDING, parts
        assert parts.prefill_s > 0  # every request computed at least its last token


def test_a_request_parked_on_a_slow_read_holds_back_no_other_request(tmp_path: Path) -> None:
    model = PagedDecoder(preset("tiny"), device="cpu")
    held = HeldReads()
    with _disk_cache(tmp_path, model, held) as cache:
        loop = ServingLoop(model, cache, max_running=4)
        push_prompt_to_disk(loop, cache, min_on_disk=DISK_TOKENS // 4)
        held.hold()
        for req in _requests(salted=False):
            loop.submit(req)
        finished: dict[str, RequestResult] = {}
        steps = 0
        while "fresh" not in finished:
            steps += 1
            assert steps < 50, "the fresh request never finished"
            finished.update((r.request_id, r) for r in loop.step())
            # The disk-hit request stays parked: its read cannot land while held.
            assert loop.statistics().parked_now == 1
        _until(lambda: held.waiting > 0, "the parked request's read never reached the disk")
        fresh = finished["fresh"]
        # Its prefill and all six decode steps ran while the other's read was held: one step
        # each, none skipped for the parked request.
        assert len(fresh.output) == 6 and steps == 6, (steps, fresh)
        assert "disk-hit" not in finished and held.waiting > 0
        held.release()
        done = {r.request_id: r for r in loop.drain(timeout=60)}
        hit = done["disk-hit"]
        assert hit.disk_tokens == DISK_TOKENS and not hit.fell_back, hit
        assert hit.recomputed_tokens == len(PROMPT) + 2 - DISK_TOKENS, hit
        hit_parts, fresh_parts = hit.breakdown(), fresh.breakdown()
        assert hit_parts is not None and fresh_parts is not None
        assert hit_parts.parked_s > 0 and fresh_parts.parked_s == 0
        _check_parts([fresh, hit])
        cache.check_invariants()


def test_a_queued_request_prefetches_at_once_and_the_disk_reads_while_it_waits(
        tmp_path: Path) -> None:
    model = PagedDecoder(preset("tiny"), device="cpu")
    held = HeldReads()
    with _disk_cache(tmp_path, model, held) as cache:
        loop = ServingLoop(model, cache, max_running=1, prefetch_ahead=2)
        push_prompt_to_disk(loop, cache, min_on_disk=DISK_TOKENS // 4)
        # "long" runs first and each of its steps' evictions spill before the next step:
        # with spills still in flight, host pressure finds only the prefetched pages to take
        # and reclaims them (as designed), which only thread timing on a loaded machine
        # would decide (it did, once in a CI run).
        loop.submit(ServeRequest(request_id="long", prompt=tuple(range(460, 500)),
                                 max_new_tokens=12))
        finished = loop.step()
        _until_spilled(cache)
        before = loop.statistics()
        held.hold()
        loop.submit(ServeRequest(request_id="again", prompt=(*PROMPT, 7, 7),
                                 max_new_tokens=2))
        finished += loop.step()
        # The step that first saw it waiting asked for its disk blocks.
        assert cache.prefetch_reads_pending("again") == DISK_TOKENS // 4
        _until(lambda: held.waiting > 0, "the prefetch's reads never reached the disk")
        for _ in range(3):
            _until_spilled(cache)
            finished += loop.step()
        stats = loop.statistics()
        waited = stats.queued_on_disk_seconds - before.queued_on_disk_seconds
        reading = stats.queued_on_disk_reading_seconds - before.queued_on_disk_reading_seconds
        # While "again" waited on the disk, the disk was reading for it all the time.
        assert waited > 0 and reading == waited, stats
        assert stats.waiting_now == 1 and stats.running_now == 1
        held.release()
        _until(lambda: cache.prefetch_reads_pending("again") == 0, "the prefetch never landed")
        while not loop.idle:
            _until_spilled(cache)
            finished += loop.step()
        done = {r.request_id: r for r in finished}
        again = done["again"]
        # Admitted after its prefetch landed: host hits, never parked.
        assert again.host_tokens == DISK_TOKENS and again.disk_tokens == 0, again
        parts = again.breakdown()
        assert parts is not None and parts.prefetch_s > 0 and parts.parked_s == 0, parts
        assert done["long"].prefetch_seconds == 0
        _check_parts(list(done.values()))
        summary = breakdown_summary(done.values())
        assert summary["breakdown_prefetched_requests"] == 1
        assert summary["breakdown_prefetch_s_mean"] > 0


def test_breakdown_summary_shows_disk_time_only_where_there_are_disk_hits(
        tmp_path: Path) -> None:
    model = PagedDecoder(preset("tiny"), device="cpu")
    held = HeldReads()
    with _disk_cache(tmp_path / "disk", model, held) as cache:
        loop = ServingLoop(model, cache, max_running=4, prefetch_ahead=2)
        push_prompt_to_disk(loop, cache, min_on_disk=DISK_TOKENS // 4)
        for req in _requests(salted=False):
            loop.submit(req)
        disk_tier = loop.drain(timeout=60)
    with BlockingCache(serving_config(tmp_path / "none", model, disk=False)) as cache:
        loop = ServingLoop(model, cache, max_running=4, prefetch_ahead=2)
        for req in _requests(salted=True):
            loop.submit(req)
        recompute = loop.drain(timeout=60)
    assert {r.request_id for r in disk_tier} == {r.request_id for r in recompute}
    _check_parts(disk_tier)
    _check_parts(recompute)
    with_disk, without = breakdown_summary(disk_tier), breakdown_summary(recompute)
    assert sum(r.disk_tokens for r in disk_tier) == DISK_TOKENS
    assert with_disk["breakdown_parked_s_mean"] + with_disk["breakdown_prefetch_s_mean"] > 0
    assert with_disk["breakdown_parked_requests"] + with_disk[
        "breakdown_prefetched_requests"] >= 1
    assert without["breakdown_parked_s_mean"] == without["breakdown_prefetch_s_mean"] == 0
    assert without["breakdown_parked_requests"] == without["breakdown_prefetched_requests"] == 0
    for summary in (with_disk, without):
        line = breakdown_line(summary)
        assert all(word in line for word in ("queue", "prefetch", "parked", "prefill",
                                             "ready-wait", "2 requests")), line
        assert summary["breakdown_requests"] == 2
        assert abs(summary["breakdown_parts_sum_s_mean"]
                   - summary["breakdown_ttft_s_mean"]) <= ROUNDING
        assert abs(sum(summary[f"breakdown_{p}_share"] for p in (
            "queue_s", "prefetch_s", "parked_s", "prefill_s", "ready_wait_s")) - 1) < 1e-6


def test_breakdown_summary_of_no_request_has_no_figures() -> None:
    summary = breakdown_summary([RequestResult(request_id="r", prompt_tokens=3)])
    assert summary["breakdown_requests"] == 0
    assert summary["breakdown_ttft_s_mean"] != summary["breakdown_ttft_s_mean"]  # NaN


def _served(rid: str, arrival: float, admitted: float | None, first: float | None,
            finished: float | None) -> RequestResult:
    return RequestResult(request_id=rid, prompt_tokens=4, arrival=arrival, admitted=admitted,
                         first_token=first, finished=finished)


def test_residency_summary_counts_pages_held_from_admission_to_the_last_token() -> None:
    window = (10.0, 20.0)
    results = [
        # warm-up, admitted before the window: held 10 -> 12 inside it, not a measured one
        _served("warm", 5.0, 6.0, 7.0, 12.0),
        _served("a", 10.0, 11.0, 12.0, 15.0),   # held 4 s, answering 3 s
        _served("b", 12.0, 14.0, 15.0, 16.0),   # held 2 s, answering 1 s
        # still running at the window's end: held 18 -> 20 in the window, not finished
        _served("c", 17.0, 18.0, 19.0, None),
        _served("queued", 19.0, None, None, None),  # never admitted: holds nothing
        _served("late", 21.0, 21.0, 22.0, 23.0),    # after the window
    ]
    summary = residency_summary(results, *window)
    assert summary["residency_requests"] == 2
    assert summary["residency_resident_s_mean"] == 3.0
    assert summary["residency_resident_s_p50"] == 3.0
    assert summary["residency_answer_s_mean"] == 2.0
    # 2 (warm) + 4 (a) + 2 (b) + 2 (c) seconds held over a 10 s window
    assert summary["residency_held_mean"] == 1.0
    line = residency_line(summary)
    assert "3.000 s" in line and "1.00 requests held" in line and "[2 requests]" in line, line
    line = residency_line({**summary, "residency_pool_requests": 3.6})
    assert "1.00 of the pool's 3.6 requests held" in line, line


def test_residency_of_a_loop_run_obeys_littles_law(tmp_path: Path) -> None:
    """Over a whole run of the real loop, the requests held at once on average are the
    requests finished over the run times the mean time each was held."""
    model = PagedDecoder(preset("tiny"), device="cpu")
    with BlockingCache(serving_config(tmp_path / "none", model, disk=False)) as cache:
        loop = ServingLoop(model, cache, max_running=4, prefetch_ahead=0)
        for req in _requests(salted=True):
            loop.submit(req)
        done = loop.drain(timeout=60)
    assert done and all(r.finished is not None for r in done)
    start = min(r.arrival for r in done)
    end = max(r.finished for r in done if r.finished is not None)
    summary = residency_summary(done, start, end + 1e-9)
    assert summary["residency_requests"] == len(done)
    little = len(done) / (end + 1e-9 - start) * summary["residency_resident_s_mean"]
    assert abs(summary["residency_held_mean"] - little) <= 1e-6 * max(1.0, little)


def test_residency_summary_of_no_request_has_no_figures() -> None:
    summary = residency_summary([_served("q", 1.0, None, None, None)], 0.0, 2.0)
    assert summary["residency_requests"] == 0
    assert summary["residency_held_mean"] == 0.0
    assert summary["residency_resident_s_mean"] != summary["residency_resident_s_mean"]
