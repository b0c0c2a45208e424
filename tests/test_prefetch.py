"""Prefetch for queued requests, and cost-aware onboarding (issue 12), on the bare core.

Every step goes through the harness, which checks the command contract (one transfer per
slot, reads of the content the slot holds) and runs ``check_invariants()`` -- whose pool
accounting fails on any host page or slot that is leaked or owned twice.
"""

from __future__ import annotations

import math

import pytest

from statekv import OutOfBlocks, UsageError
from statekv.ids import RequestId
from statekv.messages import CopyHostToGpu, FreeSlot, PrefetchSlot, ReadSlot
from tests.harness import Executor, count_encodings, fresh_tokens, make


def on_disk(**overrides: object) -> tuple[Executor, list[int]]:
    """A cache whose two full blocks of `doc` are on disk, and nothing else is cached."""
    ex = make(**{"gpu_blocks": 4, "host_blocks": 2, "disk_blocks": 4, **overrides})
    doc = fresh_tokens(5)  # two full blocks and one token
    ex.spill([doc])
    assert ex.tiers(doc) == ["ON_DISK", "ON_DISK"]
    assert ex.stats().host_free_pages == 2
    return ex, doc


# ---------------------------------------------------------------------- prefetch


def test_a_prefetch_turns_a_disk_hit_into_a_host_hit() -> None:
    ex, doc = on_disk()
    start = len(ex.log)
    started = ex.prefetch("q", doc)
    assert (started.started_tokens, started.shared_tokens, started.unfetched_tokens) == (4, 0, 0)
    prefetches = [c for c in ex.log[start:] if isinstance(c, PrefetchSlot)]
    assert len(prefetches) == 2 and len({c.host_page for c in prefetches}) == 2
    assert ex.tiers(doc) == ["PREFETCHING", "PREFETCHING"]
    assert ex.stats().host_free_pages == 0
    ex.land_prefetch()
    ex.land_prefetch()
    assert ex.tiers(doc) == ["PREFETCHED", "PREFETCHED"]

    start = len(ex.log)
    match = ex.add("q", doc)
    assert match.ready and (match.host_tokens, match.disk_tokens) == (4, 0)
    kinds = [type(c) for c in ex.log[start:]]
    # The slots are kept: the blocks on GPU keep their disk copies.
    assert kinds.count(CopyHostToGpu) == 2 and kinds.count(FreeSlot) == 0
    assert ex.stats().disk_copy_blocks == 2
    assert ReadSlot not in kinds
    stats = ex.stats()
    assert (stats.prefetches, stats.prefetches_completed, stats.prefetch_hits) == (2, 2, 2)
    assert stats.hit_blocks_host == 2 and stats.onboards == 0
    assert stats.host_free_pages == 2 and stats.prefetching_requests == 0
    assert stats.disk_empty_slots == 2  # the slots stay, as an onboard keeps them


def test_leaving_the_queue_gives_the_pages_back_and_the_content_stays_on_disk() -> None:
    ex, doc = on_disk()
    ex.prefetch("q", doc)
    ex.land_prefetch()
    ex.land_prefetch()
    ex.release("q")
    assert ex.tiers(doc) == ["ON_DISK", "ON_DISK"]
    stats = ex.stats()
    assert stats.prefetches_cancelled == 2 and stats.prefetched_blocks == 0
    assert stats.host_free_pages == 2 and stats.prefetching_requests == 0
    assert not ex.cache.has_request("q")
    # The slots were never rewritten: a later request reads them back as usual.
    match = ex.add("r", doc)
    assert match.disk_tokens == 4
    ex.land_read()
    ex.land_read()
    assert ex.cache.is_ready("r")


def test_a_release_during_the_prefetch_keeps_the_page_until_the_read_lands() -> None:
    ex, doc = on_disk()
    ex.prefetch("q", doc)
    ex.release("q")  # both reads still in flight: their pages stay theirs
    assert ex.tiers(doc) == ["PREFETCHING", "PREFETCHING"]
    assert ex.stats().host_free_pages == 0
    ex.land_prefetch()
    ex.land_prefetch()
    assert ex.tiers(doc) == ["ON_DISK", "ON_DISK"]
    stats = ex.stats()
    assert stats.host_free_pages == 2 and stats.prefetches_cancelled == 2


def test_host_pressure_reclaims_the_newest_prefetched_page_first() -> None:
    ex, doc = on_disk()
    ex.prefetch("q", doc)
    ex.land_prefetch()  # block 0 lands first
    ex.land_prefetch()  # block 1: the newest
    other = fresh_tokens(3)
    ex.serve("o", other)  # one cached GPU block
    offloads = ex.stats().host_offloads
    ex.churn("c")  # evicts it: its host page is a reclaimed prefetched page
    stats = ex.stats()
    assert stats.prefetches_reclaimed == 1 and stats.host_offloads == offloads + 1
    assert ex.tiers(doc) == ["PREFETCHED", "ON_DISK"]
    assert ex.tiers(other) == ["ON_HOST"]
    # The queued request is admitted anyway: one host hit, one onboard.
    match = ex.add("q", doc)
    assert (match.host_tokens, match.disk_tokens) == (2, 2)


def test_a_block_reclaimed_and_asked_for_again_is_listed_once() -> None:
    """The host tier reclaimed a queued request's prefetched block; the request's next call
    prefetches it again.  The request lists the block once (the invariants compare each
    block's prefetchers with the requests that list it), and leaving gives it back once."""
    ex, doc = on_disk()
    ex.prefetch("q", doc)
    ex.land_prefetch()
    ex.land_prefetch()
    ex.serve("o", fresh_tokens(3))
    ex.churn("c")                             # reclaims the newest prefetched page
    assert ex.tiers(doc) == ["PREFETCHED", "ON_DISK"]
    for _ in range(3):                        # asks again (a serving loop does, each step)
        ex.prefetch("q", doc)
        ex.drain()
    listed = ex.cache._onboarding.queued[RequestId("q")]
    assert len(listed) == len(set(listed)) <= 2
    ex.release("q")
    assert ex.tiers(doc).count("PREFETCHED") == 0
    ex.cache.check_invariants()


def test_with_reclaim_last_host_victims_go_before_prefetched_pages() -> None:
    ex = make(gpu_blocks=4, host_blocks=2, disk_blocks=4, spill_mode="retained_only",
              reclaim_prefetched_first=False)
    doc = fresh_tokens(5)
    ex.spill([doc], ttl=100.0)  # retained: the spill mode writes it
    ex.prefetch("q", doc[:3])  # one block: one host page, the other stays free
    ex.drain()
    other = fresh_tokens(3)
    ex.serve("o", other)
    ex.churn("c1")  # its GPU victim takes the free host page
    assert ex.tiers(other) == ["ON_HOST"]
    ex.serve("o2", fresh_tokens(3))
    ex.churn("c2")  # the next victim evicts the host victim (dropped), not the prefetch
    stats = ex.stats()
    assert stats.prefetches_reclaimed == 0 and stats.gate_drops == 1
    assert ex.tiers(doc) == ["PREFETCHED", "ON_DISK"]
    assert ex.tiers(other) == [None]


def test_an_admission_while_the_prefetch_is_in_flight_takes_it_over() -> None:
    ex, doc = on_disk()
    ex.prefetch("q", doc)
    start = len(ex.log)
    match = ex.add("q", doc)
    assert not match.ready and match.disk_tokens == 4
    assert not any(isinstance(c, ReadSlot) for c in ex.log[start:])  # no second read
    assert ex.stats().prefetches_taken_over == 2
    start = len(ex.log)
    ex.land_prefetch()
    ex.land_prefetch()
    assert ex.cache.is_ready("q")
    assert [type(c) for c in ex.log[start:]].count(CopyHostToGpu) == 2
    stats = ex.stats()
    assert stats.host_free_pages == 2 and stats.onboards_completed == 2
    assert ex.tiers(doc) == ["ON_GPU", "ON_GPU"]


def test_a_failed_prefetch_is_never_served() -> None:
    ex, doc = on_disk()
    ex.prefetch("q", doc)
    ex.land_prefetch(ok=False)
    ex.land_prefetch()
    assert ex.tiers(doc) == [None, "PREFETCHED"]  # block 1 is orphaned from its prefix
    stats = ex.stats()
    assert stats.prefetch_failures == 1 and stats.io_errors == 1
    assert ex.add("q", doc).matched_tokens == 0  # recomputes from the start
    assert ex.tiers(doc) == [None, "ON_DISK"]
    assert ex.stats().host_free_pages == 2


def test_a_second_call_starts_what_the_first_could_not() -> None:
    ex, doc = on_disk()
    hold = ex.prefetch("q", doc[:3])  # one block: one host page
    assert hold.started_tokens == 2
    again = ex.prefetch("q", doc)
    assert (again.started_tokens, again.shared_tokens) == (2, 2)
    ex.drain()
    ex.release("q")
    assert ex.tiers(doc) == ["ON_DISK", "ON_DISK"]
    assert ex.stats().host_free_pages == 2


def test_a_prefetch_could_start_exactly_while_a_host_page_can_be_had() -> None:
    """prefetch_could_start() is a serving loop's cue to ask again for a stalled prefetch: it
    is false only while an ask would start no read and evict nothing, and turns true when a
    page comes back."""
    ex, a = on_disk()
    b = fresh_tokens(5)
    ex.spill([b])  # a's two blocks and b's two on disk; the two host pages empty
    cache = ex.cache
    assert cache.prefetch_could_start()
    assert ex.prefetch("qa", a).started_tokens == 4  # both host pages, reads in flight
    assert not cache.prefetch_could_start()
    start, before = len(ex.log), ex.stats()
    stalled = ex.prefetch("qb", b)
    assert (stalled.started_tokens, stalled.unfetched_tokens) == (0, 4)
    assert len(ex.log) == start  # no read, no eviction, no command of any kind
    after = ex.stats()
    assert (after.prefetches, after.host_drops, after.spills) == (
        before.prefetches, before.host_drops, before.spills)
    ex.drain()  # landed, the pages are still prefetched for "qa": nothing to evict
    assert not cache.prefetch_could_start()
    ex.release("qa")  # "qa" leaves the queue: its pages come back
    assert cache.prefetch_could_start()
    assert ex.prefetch("qb", b).started_tokens == 4
    assert not cache.prefetch_could_start()
    ex.drain()
    ex.release("qb")
    assert cache.prefetch_could_start()
    assert ex.tiers(a) == ex.tiers(b) == ["ON_DISK", "ON_DISK"]


def test_a_host_victim_to_evict_lets_a_prefetch_start() -> None:
    """No empty host page, but cached host content a prefetch may evict: it could start,
    and an ask evicts the victim."""
    ex, a = on_disk()
    ex.serve("warm", fresh_tokens(5))  # two blocks cached on GPU ...
    ex.churn("push")  # ... pushed down to host, where they are cached and evictable
    before = ex.stats()
    assert before.host_free_pages == 0 and before.host_cached_blocks == 2, before
    assert ex.cache.prefetch_could_start()
    ex.prefetch("q", a)
    after = ex.stats()
    assert (after.host_drops + after.spills) > (before.host_drops + before.spills)
    ex.drain()
    ex.release("q")


def test_a_repeat_call_with_the_same_tuple_checks_and_keys_the_prompt_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A serving loop asks again each step for the reads that could not start: with the same
    tuple (immutable, checked at the first call) the cache does not check, encode and key
    the prompt again; any other argument is checked anew, and the record ends with the
    queued request."""
    ex, doc = on_disk()
    encoded = count_encodings(monkeypatch)
    prompt = tuple(doc)
    assert ex.prefetch("q", prompt).started_tokens == 4 and len(encoded) == 1
    ex.drain()
    assert ex.prefetch("q", prompt).shared_tokens == 4 and len(encoded) == 1  # not again
    assert ex.prefetch("q", list(prompt)).shared_tokens == 4 and len(encoded) == 2
    with pytest.raises(UsageError) as info:  # a list is checked again: a bool is refused
        ex.cache.prefetch("q", [True, *prompt[1:]], now=ex.now)
    assert info.value.field == "token_ids"
    assert ex.prefetch("q", prompt).shared_tokens == 4 and len(encoded) == 4
    assert ex.prefetch("q", prompt).shared_tokens == 4 and len(encoded) == 4
    salted = ex.cache.prefetch("q", prompt, now=ex.now, cache_salt="tenant")
    assert salted.started_tokens == 0 and len(encoded) == 5  # another tenant's: not cached
    assert ex.prefetch("q", prompt).shared_tokens == 4 and len(encoded) == 6
    # Admitted with the same tuple: the prefetch's record serves, and goes with the queue.
    match = ex.add("q", prompt)
    assert match.host_tokens == 4 and len(encoded) == 6
    assert not ex.cache._onboarding.queued_records
    ex.release("q")
    ex.cache.check_invariants()


@pytest.mark.parametrize("admitted_with", ["same tuple", "equal list", "other salt"])
def test_admission_after_a_prefetch_keys_the_prompt_as_a_fresh_request_would(
        admitted_with: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """add_request takes a prefetched request's checked, encoded and keyed prompt only for
    the very tuple (and salt) the prefetch was given; the record it makes is the one a
    fresh check would make, and the request grows from it as any other does."""
    ex, doc = on_disk()
    encoded = count_encodings(monkeypatch)
    prompt = tuple(doc)
    ex.prefetch("q", prompt)
    ex.drain()
    queued = ex.cache._onboarding.queued_records[RequestId("q")].request
    queued_keys, queued_bytes = list(queued.keys), bytes(queued.encoded)
    fresh = ex.cache._requests.new_record(RequestId("q"), list(doc), None, None, 60.0, 3)
    ex.cache._index.lookup(fresh)
    tokens, salt = {"same tuple": (prompt, None), "equal list": (list(doc), None),
                    "other salt": (prompt, "tenant")}[admitted_with]
    encoded.clear()
    match = ex.add("q", tokens, ttl=60.0, priority=3, salt=salt)
    assert len(encoded) == (0 if admitted_with == "same tuple" else 1)
    assert match.host_tokens == (0 if admitted_with == "other salt" else 4)
    req = ex.cache._requests.live[RequestId("q")]
    if salt is None:
        assert req.keys[:len(fresh.keys)] == fresh.keys and bytes(req.encoded) == bytes(
            fresh.encoded)
        assert (req.root, req.ttl, req.priority) == (fresh.root, 60.0, 3)
    # The queued record was copied, not taken: growing the request leaves it as it was.
    assert queued.keys == queued_keys and bytes(queued.encoded) == queued_bytes
    ex.cache.allocate_nowait("q", len(doc), now=ex.now)
    ex.cache.commit("q", len(doc), now=ex.now)
    ex.cache.append_tokens("q", [9, 9, 9])
    assert bytes(queued.encoded) == queued_bytes
    ex.cache.check_invariants()
    ex.release("q")
    ex.cache.check_invariants()


def test_an_admission_refused_for_pages_leaves_the_prefetch_as_it_was() -> None:
    """OutOfBlocks changes nothing: the queued request keeps its prefetch and its record,
    and a later admission with the same tuple takes the prefetched blocks."""
    ex, doc = on_disk()
    prompt = tuple(doc)
    ex.prefetch("q", prompt)
    ex.drain()
    hog = ex.add("hog", fresh_tokens(8))  # all four GPU pages, held by a running request
    ex.cache.allocate_nowait("hog", 8, now=ex.now)
    assert hog.matched_tokens == 0
    record = ex.cache._onboarding.queued_records[RequestId("q")]
    with pytest.raises(OutOfBlocks):
        ex.cache.add_request("q", prompt, now=ex.now)
    assert ex.cache._onboarding.queued_records[RequestId("q")] is record
    assert RequestId("q") not in ex.cache._requests.live
    ex.release("hog")
    match = ex.add("q", prompt)
    assert match.host_tokens == 4
    ex.release("q")
    ex.cache.check_invariants()


def test_two_queued_requests_share_a_prefetch() -> None:
    ex, doc = on_disk()
    ex.prefetch("q1", doc)
    shared = ex.prefetch("q2", [*doc[:4], 7, 7])
    assert (shared.started_tokens, shared.shared_tokens) == (0, 4)
    ex.drain()
    ex.release("q1")
    assert ex.tiers(doc) == ["PREFETCHED", "PREFETCHED"]  # q2 still wants them
    ex.release("q2")
    assert ex.tiers(doc) == ["ON_DISK", "ON_DISK"]
    assert ex.stats().host_free_pages == 2


def test_a_queued_request_counts_its_prefetch_reads_until_they_land() -> None:
    ex, doc = on_disk()
    cache = ex.cache
    assert cache.prefetch_reads_pending("q") == 0 and cache.disk_reads_in_flight() == 0
    ex.prefetch("q", doc)
    ex.prefetch("q2", doc[:4])  # shares the first block's read
    assert cache.prefetch_reads_pending("q") == 2 and cache.prefetch_reads_pending("q2") == 1
    assert cache.disk_reads_in_flight() == 2  # one read per block, however many want it
    ex.land_prefetch(ok=False)  # the first block's read fails: nobody waits for it any more
    assert cache.prefetch_reads_pending("q") == 1 and cache.prefetch_reads_pending("q2") == 0
    ex.land_prefetch()
    assert cache.prefetch_reads_pending("q") == 0 and cache.disk_reads_in_flight() == 0
    ex.release("q2")
    ex.release("q")


def test_a_read_taken_over_by_an_admission_is_no_other_queued_requests_read() -> None:
    ex, doc = on_disk()
    cache = ex.cache
    ex.prefetch("q", doc)
    ex.prefetch("q2", doc)  # shares both reads
    assert cache.prefetch_reads_pending("q2") == 2
    assert ex.add("q", doc).disk_tokens == 4  # takes both reads over, parked on them
    assert cache.prefetch_reads_pending("q2") == 0 and cache.prefetch_reads_pending("q") == 0
    assert cache.disk_reads_in_flight() == 2
    again = ex.prefetch("q2", doc)  # the blocks are q's onboards now: nothing to read
    assert again.started_tokens == 0 and cache.prefetch_reads_pending("q2") == 0
    ex.land_prefetch()  # the reads were issued as prefetches, and land as such
    ex.land_prefetch()
    assert cache.is_ready("q") and cache.prefetch_reads_pending("q2") == 0
    ex.release("q2")
    ex.release("q")


def test_onboard_reads_are_disk_reads_in_flight_but_no_prefetch() -> None:
    ex, doc = on_disk()
    cache = ex.cache
    assert ex.add("r", doc).disk_tokens == 4
    assert cache.disk_reads_in_flight() == 2 and cache.prefetch_reads_pending("r") == 0
    ex.land_read()
    ex.land_read()
    assert cache.disk_reads_in_flight() == 0 and cache.is_ready("r")


def test_prefetch_rejects_bad_calls_and_changes_nothing() -> None:
    ex, doc = on_disk()
    ex.prefetch("q", doc)
    ex.add("a", fresh_tokens(3))
    before = ex.stats()
    for rid in ("a", ""):
        with pytest.raises(UsageError) as info:
            ex.cache.prefetch(rid, doc, now=ex.now)
        assert info.value.field == "request_id"
    with pytest.raises(UsageError) as info:
        ex.cache.prefetch("z", [], now=ex.now)
    assert info.value.field == "token_ids"
    with pytest.raises(UsageError) as info:
        ex.cache.prefetch("z", doc, now=math.nan)
    assert info.value.field == "now"
    assert ex.stats() == before
    ex.cache.check_invariants()


# ---------------------------------------------------------------------- cost-aware onboarding


def slow_disk_fast_model(ex: Executor) -> None:
    block_bytes = ex.cache.config.block_bytes
    ex.cache.report_disk_read(block_bytes, 1.0)  # one block a second
    ex.cache.report_prefill(4, 0.0004, context_tokens=5)  # 0.1 ms a token


def test_a_slow_disk_is_not_read_when_recomputing_is_faster() -> None:
    ex, doc = on_disk()
    slow_disk_fast_model(ex)
    start = len(ex.log)
    match = ex.add("r", doc)
    assert match.matched_tokens == 0 and match.skipped_disk_tokens == 4 and match.ready
    assert not any(isinstance(c, ReadSlot) for c in ex.log[start:])
    stats = ex.stats()
    assert stats.onboards_skipped_as_too_slow == 2
    assert stats.onboard_tokens_skipped_as_too_slow == 4
    assert stats.onboards == 0
    assert ex.tiers(doc) == ["ON_DISK", "ON_DISK"]  # the content stays cached


def test_a_fast_disk_is_read() -> None:
    ex, doc = on_disk()
    ex.cache.report_disk_read(ex.cache.config.block_bytes * 1000, 0.001)
    ex.cache.report_prefill(4, 0.0004, context_tokens=5)
    match = ex.add("r", doc)
    assert match.disk_tokens == 4 and match.skipped_disk_tokens == 0
    assert ex.stats().onboards_skipped_as_too_slow == 0


def test_without_estimates_or_with_the_switch_off_disk_hits_are_read() -> None:
    ex, doc = on_disk()
    ex.cache.report_disk_read(ex.cache.config.block_bytes, 1.0)  # no prefill rate yet
    assert ex.add("r", doc).disk_tokens == 4
    off, doc2 = on_disk(cost_aware_onboarding=False)
    slow_disk_fast_model(off)
    assert off.add("r", doc2).disk_tokens == 4
    assert off.stats().onboards_skipped_as_too_slow == 0


def test_the_cut_keeps_the_hits_before_a_slow_run() -> None:
    ex = make(gpu_blocks=4, host_blocks=1, reserved_host_blocks=1, disk_blocks=4)
    doc = fresh_tokens(7)
    ex.serve("a", doc)
    ex.churn("c1", 2)
    ex.churn("c2", 3)
    ex.drain()
    assert ex.tiers(doc) == ["RELEASED", "ON_HOST", "ON_DISK"]
    slow_disk_fast_model(ex)
    match = ex.add("b", [*doc[:6], 42, 43])
    assert (match.gpu_tokens, match.host_tokens, match.disk_tokens) == (2, 2, 0)
    assert match.skipped_disk_tokens == 2
    assert ex.cache.request_status("b").num_computed_tokens == 4


def test_prefetched_blocks_are_host_hits_whatever_the_disk_rate() -> None:
    ex, doc = on_disk()
    slow_disk_fast_model(ex)
    ex.prefetch("q", doc)  # hidden behind the queue: worth it even on a slow disk
    ex.drain()
    match = ex.add("q", doc)
    assert match.host_tokens == 4 and match.skipped_disk_tokens == 0


@pytest.mark.parametrize(
    ("call", "field"),
    [
        (lambda c: c.report_disk_read(-1, 1.0), "num_bytes"),
        (lambda c: c.report_disk_read(1.5, 1.0), "num_bytes"),
        (lambda c: c.report_disk_read(100, math.nan), "seconds"),
        (lambda c: c.report_disk_read(100, 0.0), "seconds"),
        (lambda c: c.report_disk_read(100, -2.0), "seconds"),
        (lambda c: c.report_prefill(0, 1.0, context_tokens=4), "num_tokens"),
        (lambda c: c.report_prefill(4, math.inf, context_tokens=4), "seconds"),
        (lambda c: c.report_prefill(4, 1.0, context_tokens=0), "context_tokens"),
        (lambda c: c.report_prefill(4, 1.0, context_tokens=True), "context_tokens"),
    ],
)
def test_bad_measurements_are_typed_errors_naming_the_field(call: object, field: str) -> None:
    ex, _doc = on_disk()
    before = ex.cache.cost_estimates()
    with pytest.raises(UsageError) as info:
        call(ex.cache)  # type: ignore[operator]
    assert info.value.field == field
    assert ex.cache.cost_estimates() == before
