"""Every counter of statistics() moves when its event happens; RingTrace records transitions."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import pytest

from statekv import CacheStatistics, ConfigError, KVCacheManager, RingTrace, SpillMode
from statekv.ids import BlockId, RequestId
from statekv.lifecycle import TRANSITIONS, BlockEvent, BlockState
from statekv.manager import RestoredBlock
from tests.harness import Executor, config, fresh_tokens, make

Trigger = Callable[[], object]
Setup = Callable[[], tuple[Executor, Trigger]]

BS = 2
BLOCK_BYTES = config().block_bytes


def _cache(**overrides: Any) -> Executor:
    return make(**{"gpu_blocks": 4, "host_blocks": 1, "disk_blocks": 2, **overrides})


def _doc() -> list[int]:
    return fresh_tokens(3)


# ---------------------------------------------------------------------- scenarios


def add_request() -> tuple[Executor, Trigger]:
    ex = _cache()
    return ex, lambda: ex.add("r", _doc())


def release_request() -> tuple[Executor, Trigger]:
    ex = _cache()
    ex.add("r", _doc())
    ex.compute("r")
    return ex, lambda: ex.release("r")


def commit_two_blocks() -> tuple[Executor, Trigger]:
    ex = _cache()
    ex.add("r", fresh_tokens(5))
    ex.cache.allocate_nowait("r", 5, now=ex.now)
    return ex, lambda: ex.cache.commit("r", 5, now=ex.now)


def allocate_two_blocks() -> tuple[Executor, Trigger]:
    ex = _cache()
    ex.add("r", fresh_tokens(3))
    return ex, lambda: ex.cache.allocate_nowait("r", 3, now=ex.now)


def release_two_cached_blocks() -> tuple[Executor, Trigger]:
    ex = _cache()
    ex.add("r", fresh_tokens(5))
    ex.compute("r")
    return ex, lambda: ex.release("r")


def gpu_hit() -> tuple[Executor, Trigger]:
    ex = _cache()
    doc = fresh_tokens(5)
    ex.serve("a", doc)
    return ex, lambda: ex.add("b", [*doc, 1])


def host_hit() -> tuple[Executor, Trigger]:
    ex = _cache()
    doc = _doc()
    ex.serve("a", doc)
    ex.churn("c")
    assert ex.tiers(doc) == ["ON_HOST"]
    return ex, lambda: ex.add("b", [*doc, 1])


def evict_a_host_copy() -> tuple[Executor, Trigger]:
    """A block recalled from host (its host page kept as a host copy) and released; the
    trigger evicts it from GPU again."""
    ex = _cache()
    doc = _doc()
    ex.serve("a", doc)
    ex.churn("c1")
    ex.serve("b", doc)
    assert ex.tiers(doc) == ["RELEASED"]
    return ex, lambda: ex.churn("c2")


def disk_hit(ttl: float | None = None) -> tuple[Executor, Trigger]:
    ex = _cache()
    doc = _doc()
    ex.spill([doc], ttl=ttl)
    return ex, lambda: ex.add("b", [*doc, 1])


def read_lands(ok: bool) -> Setup:
    def setup() -> tuple[Executor, Trigger]:
        ex, add = disk_hit()
        add()
        return ex, lambda: ex.land_read(ok=ok)
    return setup


def evict_one_to_host() -> tuple[Executor, Trigger]:
    ex = _cache()
    ex.serve("a", _doc())
    return ex, lambda: ex.churn("c")


def evict_host_victim(**overrides: Any) -> tuple[Executor, Trigger]:
    """One block on host, one on GPU; the trigger evicts the GPU one, which evicts the host
    one (spilled if the disk takes it: no reserve, so the GPU victim finds no page)."""
    ex = _cache(**overrides)
    ex.serve("a", _doc())
    ex.churn("c1")
    ex.serve("b", _doc())
    return ex, lambda: ex.churn("c2")


def spilling(ttl: float | None = None) -> Setup:
    def setup() -> tuple[Executor, Trigger]:
        ex = _cache()
        ex.spill([_doc()], ttl=ttl, land=False)
        return ex, ex.land_write
    return setup


def failing_write() -> tuple[Executor, Trigger]:
    ex = _cache()
    ex.spill([_doc()], land=False)
    return ex, lambda: ex.land_write(ok=False)


def pressure_drop() -> tuple[Executor, Trigger]:
    ex = _cache(host_blocks=2, drop_on_pressure=True, write_queue_depth=1)
    ex.serve("a", _doc())
    ex.serve("b", _doc())
    ex.serve("f", _doc())
    return ex, lambda: ex.churn("c")


def admission_refusal() -> tuple[Executor, Trigger]:
    ex = _cache(disk_blocks=1, protect_unexpired=True)
    ex.spill([_doc()], ttl=100.0)
    ex.serve("a", _doc())
    ex.serve("f", _doc())
    return ex, lambda: ex.churn("c")


def disk_busy() -> tuple[Executor, Trigger]:
    ex = _cache(disk_blocks=1)
    doc = _doc()
    ex.spill([doc])
    ex.add("reader", [*doc, 1])  # the only slot has a read in flight
    ex.serve("a", _doc())
    ex.serve("f", _doc())
    return ex, lambda: ex.churn("c")


def displacement() -> tuple[Executor, Trigger]:
    ex = _cache(disk_blocks=1)
    ex.spill([_doc()])
    ex.serve("a", _doc())
    ex.serve("f", _doc())
    return ex, lambda: ex.churn("c")


def expiry() -> tuple[Executor, Trigger]:
    ex = _cache()
    ex.spill([_doc()], ttl=10.0)
    return ex, lambda: ex.tick(10.0)


def restore_two() -> tuple[Executor, Trigger]:
    old = _cache(host_blocks=2, gpu_blocks=6)
    writes = old.spill([fresh_tokens(5)])
    ex = Executor(KVCacheManager(old.cache.config), now=old.now)
    entries = [
        RestoredBlock(key=w.key, parent_key=w.parent or w.key, slot=w.slot, depth=w.depth,
                      reuse_count=w.reuse_count, expiry=w.expiry, written_at=w.issued_at,
                      sequence=w.transfer)
        for w in writes
    ]
    return ex, lambda: ex.cache.restore(entries, now=ex.now)


def queued_on_disk() -> tuple[Executor, list[int]]:
    ex = _cache()
    doc = _doc()
    ex.spill([doc])
    return ex, doc


def prefetch_issued() -> tuple[Executor, Trigger]:
    ex, doc = queued_on_disk()
    return ex, lambda: ex.prefetch("q", [*doc, 1])


def prefetch_lands(ok: bool) -> Setup:
    def setup() -> tuple[Executor, Trigger]:
        ex, doc = queued_on_disk()
        ex.prefetch("q", [*doc, 1])
        return ex, lambda: ex.land_prefetch(ok=ok)
    return setup


def prefetched(then: str) -> Setup:
    """One block prefetched and landed; the trigger admits the request, lets it leave the
    queue, or evicts a GPU block (whose host page is the prefetched one's)."""
    def setup() -> tuple[Executor, Trigger]:
        ex, doc = queued_on_disk()
        ex.serve("a", _doc())
        ex.prefetch("q", [*doc, 1])
        ex.land_prefetch()
        if then == "admit":
            return ex, lambda: ex.add("q", [*doc, 1])
        if then == "leave":
            return ex, lambda: ex.release("q")
        return ex, lambda: ex.churn("c")
    return setup


def prefetch_taken_over() -> tuple[Executor, Trigger]:
    ex, doc = queued_on_disk()
    ex.prefetch("q", [*doc, 1])
    return ex, lambda: ex.add("q", [*doc, 1])


def onboard_too_slow() -> tuple[Executor, Trigger]:
    ex, doc = queued_on_disk()
    ex.cache.report_disk_read(BLOCK_BYTES, 10.0)
    ex.cache.report_prefill(2, 0.001, context_tokens=3)
    return ex, lambda: ex.add("b", [*doc, 1])


def cost_probe() -> tuple[Executor, Trigger]:
    """PROBE_EVERY - 1 requests dropped their slow disk hits: the next reads them anyway."""
    from statekv.cost import PROBE_EVERY

    ex, trigger = onboard_too_slow()
    for _ in range(PROBE_EVERY - 1):
        trigger()
        ex.release("b")
    assert ex.stats().onboards_skipped_as_too_slow == PROBE_EVERY - 1
    return ex, trigger


def remote_hit() -> tuple[Executor, Trigger]:
    """A shared-tier cache; the trigger adds a request whose one full block the shared tier
    holds."""
    ex = _cache(shared_tier=True)
    doc = _doc()
    keys = ex.cache.remote_candidates(doc)
    return ex, lambda: ex.add("r", doc, remote=keys)


def fetch_lands(ok: bool) -> Setup:
    def setup() -> tuple[Executor, Trigger]:
        ex, trigger = remote_hit()
        trigger()
        return ex, lambda: ex.land_fetch(ok=ok)
    return setup


def fetch_too_slow() -> tuple[Executor, Trigger]:
    ex, trigger = remote_hit()
    ex.cache.report_fetch(BLOCK_BYTES, 10.0)
    ex.cache.report_prefill(2, 0.001, context_tokens=3)
    return ex, trigger


def publish(**overrides: Any) -> Setup:
    def setup() -> tuple[Executor, Trigger]:
        ex = _cache(shared_tier=True, **overrides)
        ex.serve("a", _doc())
        return ex, lambda: ex.churn("c")
    return setup


def evict_a_disk_copy() -> tuple[Executor, Trigger]:
    """A block read back from disk (its slot kept) on host; the trigger evicts it from host."""
    ex = _cache()
    doc = _doc()
    ex.spill([doc])
    ex.serve("back", doc)
    ex.churn("c1")
    ex.serve("other", _doc())
    return ex, lambda: ex.churn("c2")


def write_through(write_queue_depth: int = 64) -> Setup:
    def setup() -> tuple[Executor, Trigger]:
        ex = _cache(retention_write_through=True, write_queue_depth=write_queue_depth,
                    host_blocks=3)
        doc = fresh_tokens(2 * BS + 1)
        ex.add("a", doc, ttl=100.0)
        ex.compute("a")
        return ex, lambda: ex.release("a")
    return setup


def write_through_backlog() -> tuple[Executor, Trigger]:
    """Two retained blocks released with room for one write: the trigger lands it, and the
    backlog's block is written then."""
    ex, release = write_through(write_queue_depth=1)()
    release()
    return ex, ex.land_write


CASES: list[tuple[str, Setup, int]] = [
    ("write_throughs_retried", write_through_backlog, 1),
    ("write_throughs", write_through(), 2),
    ("prefix_cache_queries", add_request, 3),
    ("prefix_cache_hits", remote_hit, BS),
    ("write_throughs_skipped", write_through(write_queue_depth=1), 1),
    ("spills_saved_by_disk_copy", evict_a_disk_copy, 1),
    ("disk_copy_blocks", read_lands(True), 1),
    ("requests_added", add_request, 1),
    ("requests_released", release_request, 1),
    ("requests_parked", disk_hit, 1),
    ("parked_requests", disk_hit, 1),
    ("requests_fallen_back", read_lands(False), 1),
    ("hit_blocks_gpu", gpu_hit, 2),
    ("hit_tokens_gpu", gpu_hit, 2 * BS),
    ("hit_blocks_host", host_hit, 1),
    ("hit_tokens_host", host_hit, BS),
    ("hit_blocks_disk", disk_hit, 1),
    ("hit_blocks_disk_retained", lambda: disk_hit(ttl=100.0), 1),
    ("hit_tokens_disk", disk_hit, BS),
    ("gpu_evictions", evict_one_to_host, 1),
    ("host_offloads", evict_one_to_host, 1),
    ("host_recalls", host_hit, 1),
    ("host_copies_kept", host_hit, 1),
    ("host_copy_pages", host_hit, 1),
    ("offloads_saved_by_host_copy", evict_a_host_copy, 1),
    ("host_copy_pages", evict_a_host_copy, -1),
    ("offloads_skipped", evict_host_victim, 1),
    ("host_drops", lambda: evict_host_victim(disk_blocks=0), 1),
    ("spills", evict_host_victim, 1),
    ("spills_completed", spilling(), 1),
    ("spill_failures", failing_write, 1),
    ("bytes_written", spilling(), BLOCK_BYTES),
    ("writes_in_flight", evict_host_victim, 1),
    ("onboards", disk_hit, 1),
    ("onboards_completed", read_lands(True), 1),
    ("onboard_failures", read_lands(False), 1),
    ("bytes_read", read_lands(True), BLOCK_BYTES),
    ("reads_in_flight", disk_hit, 1),
    ("gate_drops", lambda: evict_host_victim(spill_mode=SpillMode.RETAINED_ONLY), 1),
    ("pressure_drops", pressure_drop, 1),
    ("admission_refusals", admission_refusal, 1),
    ("disk_busy_refusals", disk_busy, 1),
    ("displacements", displacement, 1),
    ("expirations", expiry, 1),
    ("restored_blocks", restore_two, 2),
    ("io_errors", failing_write, 1),
    ("io_errors", read_lands(False), 1),
    ("cached_blocks", commit_two_blocks, 2),
    ("gpu_free_pages", allocate_two_blocks, -2),
    ("gpu_evictable_blocks", release_two_cached_blocks, 2),
    ("host_free_pages", evict_one_to_host, -1),
    ("host_reserved_pages", lambda: evict_host_victim(reserved_host_blocks=1), -1),
    ("host_cached_blocks", evict_one_to_host, 1),
    ("disk_empty_slots", evict_host_victim, -1),
    ("disk_cached_blocks", spilling(), 1),
    ("disk_retained_blocks", spilling(ttl=100.0), 1),
    ("prefetches", prefetch_issued, 1),
    ("prefetch_reads_in_flight", prefetch_issued, 1),
    ("prefetching_requests", prefetch_issued, 1),
    ("prefetches_completed", prefetch_lands(True), 1),
    ("prefetched_blocks", prefetch_lands(True), 1),
    ("bytes_read", prefetch_lands(True), BLOCK_BYTES),
    ("prefetch_failures", prefetch_lands(False), 1),
    ("io_errors", prefetch_lands(False), 1),
    ("prefetch_hits", prefetched("admit"), 1),
    ("prefetches_cancelled", prefetched("leave"), 1),
    ("prefetches_reclaimed", prefetched("pressure"), 1),
    ("prefetches_taken_over", prefetch_taken_over, 1),
    ("onboards_skipped_as_too_slow", onboard_too_slow, 1),
    ("cost_probes", cost_probe, 1),
    ("onboard_tokens_skipped_as_too_slow", onboard_too_slow, BS),
    ("hit_blocks_remote", remote_hit, 1),
    ("hit_tokens_remote", remote_hit, BS),
    ("fetches", remote_hit, 1),
    ("fetches_in_flight", remote_hit, 1),
    ("parked_requests", remote_hit, 1),
    ("fetches_completed", fetch_lands(True), 1),
    ("bytes_fetched", fetch_lands(True), BLOCK_BYTES),
    ("fetch_failures", fetch_lands(False), 1),
    ("requests_fallen_back", fetch_lands(False), 1),
    ("fetches_skipped_as_too_slow", fetch_too_slow, 1),
    ("publishes_offered", publish(), 1),
    ("publishes_not_admitted", publish(spill_mode=SpillMode.RETAINED_ONLY), 1),
]


@pytest.mark.parametrize(("field", "setup", "delta"), CASES,
                         ids=[f"{f}-{i}" for i, (f, _s, _d) in enumerate(CASES)])
def test_counter_moves_when_its_event_happens(field: str, setup: Setup, delta: int) -> None:
    ex, trigger = setup()
    before = getattr(ex.stats(), field)
    trigger()
    ex.pump()
    ex.cache.check_invariants()
    assert getattr(ex.stats(), field) - before == delta


def test_every_statistics_field_has_a_case() -> None:
    fields = {f.name for f in attrs.fields(CacheStatistics)}
    covered = {name for name, _setup, _delta in CASES} | {"blocks_by_state"}
    assert covered == fields


def test_blocks_by_state_counts_every_record_in_its_state() -> None:
    ex, trigger = allocate_two_blocks()
    before = dict(ex.stats().blocks_by_state)
    trigger()
    after = dict(ex.stats().blocks_by_state)
    assert after["ON_GPU"] - before["ON_GPU"] == 2
    assert before["FREE"] - after["FREE"] == 2
    assert list(after) == [s.name for s in BlockState]
    cfg = ex.cache.config
    assert sum(after.values()) == (
        cfg.gpu_blocks + cfg.host_blocks + cfg.reserved_host_blocks + cfg.disk_blocks
    )


def test_statistics_is_a_frozen_snapshot() -> None:
    ex, trigger = add_request()
    snap = ex.stats()
    trigger()
    assert snap.requests_added == 0
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        snap.requests_added = 5  # type: ignore[misc]


def test_counters_belong_to_one_manager() -> None:
    one, trigger = add_request()
    two = _cache()
    trigger()
    assert one.stats().requests_added == 1
    assert two.stats().requests_added == 0


# ---------------------------------------------------------------------- RingTrace


def _record(trace: RingTrace, i: int) -> None:
    trace.record(float(i), BlockId(i), None, BlockState.FREE, BlockState.ON_GPU,
                 BlockEvent.ALLOCATED)


def test_ring_trace_keeps_only_the_last_n_records_oldest_first() -> None:
    trace = RingTrace(3)
    for i in range(5):
        _record(trace, i)
    assert len(trace) == 3 and trace.recorded == 5
    assert [r.block for r in trace.records()] == [2, 3, 4]
    assert [r.time for r in trace.records()] == [2.0, 3.0, 4.0]


def test_ring_trace_below_capacity_keeps_everything() -> None:
    trace = RingTrace(10)
    for i in range(4):
        _record(trace, i)
    assert [r.block for r in trace.records()] == [0, 1, 2, 3]


@pytest.mark.parametrize("capacity", [0, -1, True, 2.5, "8"])
def test_ring_trace_with_a_bad_capacity_raises_config_error(capacity: object) -> None:
    with pytest.raises(ConfigError) as info:
        RingTrace(capacity)  # type: ignore[arg-type]
    assert info.value.field == "capacity"


def test_manager_records_time_block_request_from_to_and_event() -> None:
    trace = RingTrace(100)
    cache = KVCacheManager(config(), trace=trace)
    cache.add_request("r1", [1, 2, 3], now=1.0)
    cache.allocate_nowait("r1", 3, now=2.0)
    cache.commit("r1", 3, now=2.5)
    cache.release("r1", now=3.0)
    got = [(r.time, r.block, r.request, r.from_state, r.to_state, r.event)
           for r in trace.records()]
    r1 = RequestId("r1")
    assert got == [
        (2.0, 0, r1, BlockState.FREE, BlockState.ON_GPU, BlockEvent.ALLOCATED),
        (2.0, 1, r1, BlockState.FREE, BlockState.ON_GPU, BlockEvent.ALLOCATED),
        (3.0, 1, r1, BlockState.ON_GPU, BlockState.FREE, BlockEvent.DISCARDED),
        (3.0, 0, r1, BlockState.ON_GPU, BlockState.RELEASED, BlockEvent.RELEASED),
    ]


def _busy_workload(trace: RingTrace | None) -> Executor:
    """A deterministic workload through every tier, with failures (same records each run)."""
    ex = Executor(KVCacheManager(config(gpu_blocks=4, host_blocks=1, disk_blocks=2),
                                 trace=trace))
    docs = [[10 + i, 20 + i, 30 + i] for i in range(4)]
    ex.spill([docs[0]], ttl=50.0)
    ex.add("a", [*docs[0], 1])
    ex.add("b", [*docs[0], 2])
    ex.land_read()
    ex.release("a")
    ex.release("b")
    ex.churn("c1")
    ex.tick(1.0)
    ex.serve("d1", docs[1])
    ex.churn("c2")
    ex.serve("d2", docs[2])
    ex.churn("c3")
    ex.drain()
    ex.add("e", [*docs[0], 3])
    ex.land_read(ok=False)
    ex.compute("e")
    ex.release("e")
    ex.tick(100.0)
    return ex


def test_every_transition_is_recorded_replaying_them_gives_the_state_counts() -> None:
    trace = RingTrace(100_000)
    ex = _busy_workload(trace)
    cfg = ex.cache.config
    counts = dict.fromkeys(BlockState, 0)
    counts[BlockState.FREE] = (
        cfg.gpu_blocks + cfg.host_blocks + cfg.reserved_host_blocks + cfg.disk_blocks
    )
    states: dict[int, BlockState] = {}
    for rec in trace.records():
        assert states.get(rec.block, BlockState.FREE) is rec.from_state
        assert TRANSITIONS[(rec.from_state, rec.event)] is rec.to_state
        states[rec.block] = rec.to_state
        counts[rec.from_state] -= 1
        counts[rec.to_state] += 1
    assert tuple((s.name, n) for s, n in counts.items()) == ex.stats().blocks_by_state
    assert trace.recorded == len(trace) > 30


def test_a_small_ring_keeps_the_last_n_of_the_same_records() -> None:
    big, small = RingTrace(100_000), RingTrace(7)
    _busy_workload(big)
    _busy_workload(small)
    assert small.recorded == big.recorded
    assert list(small.records()) == list(big.records())[-7:]


def test_completion_transitions_name_no_request_and_request_calls_name_theirs() -> None:
    trace = RingTrace(100_000)
    ex = _busy_workload(trace)
    assert ex.stats().onboard_failures == 1
    by_event: dict[BlockEvent, set[RequestId | None]] = {}
    for rec in trace.records():
        by_event.setdefault(rec.event, set()).add(rec.request)
    for event in (BlockEvent.SPILL_LANDED, BlockEvent.READ_LANDED, BlockEvent.READ_FAILED):
        assert by_event[event] == {None}
    assert None not in by_event[BlockEvent.ALLOCATED]
    assert None not in by_event[BlockEvent.READ_STARTED]
    # Evictions name the request whose allocation caused them.
    assert None not in by_event[BlockEvent.OFFLOADED]
    assert RequestId("c1") in by_event[BlockEvent.OFFLOADED]


def test_a_manager_without_a_trace_behaves_the_same() -> None:
    traced = _busy_workload(RingTrace(10))
    plain = _busy_workload(None)
    assert traced.stats() == plain.stats()
    assert sorted(traced.cache.cached_blocks(), key=lambda b: b.key) == \
        sorted(plain.cache.cached_blocks(), key=lambda b: b.key)
