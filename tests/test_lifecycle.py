"""The block lifecycle table: every entry, every pair outside it, and the generated spec."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest

from specs import lifecycle_doc
from statekv import IllegalTransition, InvariantViolation, KVCacheManager, RingTrace, StateKVError
from statekv.lifecycle import (
    COPY_STATES,
    EVENT_MEANINGS,
    TRANSITIONS,
    BlockEvent,
    BlockState,
    allowed_events,
    next_state,
)
from statekv.manager import RestoredBlock
from tests.engine_harness import EngineHarness, engine_config
from tests.harness import Executor, config, fresh_tokens

S = BlockState
E = BlockEvent

TABLE_ENTRIES = sorted(TRANSITIONS.items())
ILLEGAL_PAIRS = [(s, e) for s in BlockState for e in BlockEvent if (s, e) not in TRANSITIONS]


def _entry_id(entry: tuple[tuple[BlockState, BlockEvent], BlockState]) -> str:
    (state, event), _target = entry
    return f"{state.name}-{event.name}"


def _pair_id(pair: tuple[BlockState, BlockEvent]) -> str:
    return f"{pair[0].name}-{pair[1].name}"


# ---------------------------------------------------------------------- the table itself


@pytest.mark.parametrize("entry", TABLE_ENTRIES, ids=_entry_id)
def test_every_table_entry_moves_the_block_to_its_target(
    entry: tuple[tuple[BlockState, BlockEvent], BlockState],
) -> None:
    (state, event), target = entry
    assert next_state(7, state, event) is target
    assert event in allowed_events(state)


@pytest.mark.parametrize("pair", ILLEGAL_PAIRS, ids=_pair_id)
def test_event_outside_the_table_raises_illegal_transition_naming_block_state_and_event(
    pair: tuple[BlockState, BlockEvent],
) -> None:
    state, event = pair
    with pytest.raises(IllegalTransition) as info:
        next_state(42, state, event)
    err = info.value
    assert err.block == 42
    assert err.state == state.name
    assert err.event == event.name
    message = str(err)
    assert "42" in message and state.name in message and event.name in message
    assert event not in allowed_events(state)


def test_illegal_transition_is_an_invariant_violation_of_statekv() -> None:
    assert issubclass(IllegalTransition, InvariantViolation)
    assert issubclass(IllegalTransition, StateKVError)


def test_table_and_illegal_pairs_cover_every_state_event_pair_once() -> None:
    assert len(TABLE_ENTRIES) + len(ILLEGAL_PAIRS) == len(BlockState) * len(BlockEvent)
    assert len(ILLEGAL_PAIRS) > 0


def test_states_and_events_never_compare_equal() -> None:
    assert {int(s) for s in BlockState}.isdisjoint({int(e) for e in BlockEvent})


def test_every_state_and_event_takes_part_in_the_table() -> None:
    sources = {s for (s, _e) in TRANSITIONS}
    targets = set(TRANSITIONS.values())
    assert sources | targets == set(BlockState)
    assert {e for (_s, e) in TRANSITIONS} == set(BlockEvent)
    assert set(EVENT_MEANINGS) == set(BlockEvent)
    assert all(EVENT_MEANINGS[e].strip() for e in BlockEvent)


def _reachable(start: BlockState, edges: dict[BlockState, set[BlockState]]) -> set[BlockState]:
    seen = {start}
    todo = [start]
    while todo:
        for nxt in edges.get(todo.pop(), set()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_every_state_is_reachable_from_free_and_can_return_to_free() -> None:
    forward: dict[BlockState, set[BlockState]] = {}
    backward: dict[BlockState, set[BlockState]] = {}
    for (state, _event), target in TRANSITIONS.items():
        forward.setdefault(state, set()).add(target)
        backward.setdefault(target, set()).add(state)
    assert _reachable(S.FREE, forward) == set(BlockState)
    assert _reachable(S.FREE, backward) == set(BlockState)


def test_only_dropping_discarding_or_a_failed_read_frees_a_block() -> None:
    for (state, event), target in TRANSITIONS.items():
        if target is S.FREE:
            assert event in (E.DROPPED, E.DISCARDED, E.PREFETCH_FAILED, E.LOAD_FAILED), (
                state, event)


def test_a_free_record_can_only_be_allocated_restored_fetched_or_saved_into() -> None:
    # (or take the slot of a write-through whose content left the cache meanwhile)
    assert allowed_events(S.FREE) == {E.ALLOCATED, E.RESTORED, E.FETCH_STARTED, E.SAVED,
                                      E.STAGED_LANDED}
    assert TRANSITIONS[(S.FREE, E.SAVED)] is S.ON_HOST


def test_a_load_into_engine_pages_keeps_its_slot_until_the_last_read_reports() -> None:
    exits = {TRANSITIONS[(S.LOADING, e)] for e in allowed_events(S.LOADING)}
    assert exits == {S.LOADING, S.ON_DISK, S.FREE}
    assert allowed_events(S.LOADING) == {E.LOAD_STARTED, E.LOAD_LANDED, E.LOAD_FAILED}
    assert TRANSITIONS[(S.LOADING, E.LOAD_FAILED)] is S.FREE  # never served again
    # Only disk content is loaded; a copy out of a host page moves nothing.
    assert {s for (s, _e), t in TRANSITIONS.items() if t is S.LOADING} == {
        S.ON_DISK, S.LOADING}
    assert all(t is s for (s, e), t in TRANSITIONS.items() if e is E.COPIED_OUT)


def test_a_fetch_in_flight_keeps_its_gpu_page_until_it_reports() -> None:
    exits = {TRANSITIONS[(S.FETCHING, e)] for e in allowed_events(S.FETCHING)}
    assert exits == {S.FETCHING, S.ON_GPU, S.ERROR}
    assert TRANSITIONS[(S.FETCHING, E.FETCH_FAILED)] is S.ERROR  # never served
    assert [s for (s, _e), t in TRANSITIONS.items() if t is S.FETCHING and s is not t] == [S.FREE]



def test_a_read_in_flight_ends_only_by_landing_or_failing_never_freed() -> None:
    exits = {TRANSITIONS[(S.ONBOARDING, e)] for e in allowed_events(S.ONBOARDING)}
    assert exits == {S.ONBOARDING, S.ON_GPU, S.ERROR}
    assert E.RELEASED not in allowed_events(S.ONBOARDING)
    assert E.DISCARDED not in allowed_events(S.ONBOARDING)
    assert E.DROPPED not in allowed_events(S.ONBOARDING)


def test_a_write_in_flight_keeps_its_host_page_until_it_reports() -> None:
    exits = {TRANSITIONS[(S.SPILLING, e)] for e in allowed_events(S.SPILLING)}
    assert exits == {S.ON_DISK, S.ON_HOST, S.ON_GPU, S.SPILLING}  # copied out: page only read
    assert E.DROPPED not in allowed_events(S.SPILLING)


def test_content_reaches_disk_only_by_a_landed_write_or_a_restore_at_open() -> None:
    into_disk = [(s, e) for (s, e), t in TRANSITIONS.items() if t is S.ON_DISK]
    # A cancelled prefetch goes back to the disk copy it never gave up; an evicted block
    # whose disk copy is valid (kept since its onboard) goes back to it without a write.
    assert sorted(into_disk) == sorted([
        (S.FREE, E.RESTORED), (S.SPILLING, E.SPILL_LANDED),
        (S.PREFETCHED, E.PREFETCH_CANCELLED), (S.RELEASED, E.COPY_KEPT),
        (S.ON_HOST, E.COPY_KEPT), (S.LOADING, E.LOAD_LANDED),
        (S.FREE, E.STAGED_LANDED),      # a landed write-through of content that left
    ])


def test_a_disk_copy_is_kept_or_lost_only_in_a_state_with_no_transfer_on_its_slot() -> None:
    copy_rows = {(s, e): t for (s, e), t in TRANSITIONS.items()
                 if e in (E.COPY_KEPT, E.COPY_DISPLACED)}
    assert {s for s, _ in copy_rows} == COPY_STATES
    # A read or write in flight owns its slot: no copy event there, ever.
    for state in (S.ONBOARDING, S.SPILLING, S.PREFETCHING, S.PREFETCHED, S.FETCHING,
                  S.LOADING):
        assert not allowed_events(state) & {E.COPY_KEPT, E.COPY_DISPLACED}
    # Losing a copy moves nothing; keeping it is being on disk.
    assert all(t is s for (s, e), t in copy_rows.items() if e is E.COPY_DISPLACED)
    assert all(t is S.ON_DISK for (s, e), t in copy_rows.items() if e is E.COPY_KEPT)


def test_a_prefetch_in_flight_keeps_its_host_page_until_it_reports() -> None:
    exits = {TRANSITIONS[(S.PREFETCHING, e)] for e in allowed_events(S.PREFETCHING)}
    assert exits == {S.PREFETCHED, S.FREE, S.ONBOARDING}
    assert E.PREFETCH_CANCELLED not in allowed_events(S.PREFETCHING)
    assert E.DROPPED not in allowed_events(S.PREFETCHING)
    assert allowed_events(S.PREFETCHED) == {E.RECALLED, E.PREFETCH_CANCELLED}


def test_a_failed_read_is_never_served_only_discarded() -> None:
    assert allowed_events(S.ERROR) == {E.DISCARDED}
    assert TRANSITIONS[(S.ERROR, E.DISCARDED)] is S.FREE


# ---------------------------------------------------------------------- the manager obeys it


def test_manager_rejects_an_illegal_event_and_leaves_the_block_unchanged() -> None:
    cache = KVCacheManager(config())
    before = cache.statistics()
    record = cache._records.all[0]
    assert record.state is S.FREE
    with pytest.raises(IllegalTransition) as info:
        cache._records.move(record, E.RELEASED)
    assert info.value.block == record.id
    assert info.value.state == "FREE" and info.value.event == "RELEASED"
    assert record.state is S.FREE
    assert cache.statistics() == before
    cache.check_invariants()


def _seen(trace: RingTrace) -> Iterator[tuple[tuple[BlockState, BlockEvent], BlockState]]:
    for rec in trace.records():
        yield (rec.from_state, rec.event), rec.to_state


def _traced(**overrides: object) -> tuple[Executor, RingTrace]:
    trace = RingTrace(100_000)
    cfg = {"gpu_blocks": 4, "host_blocks": 1, "disk_blocks": 2, **overrides}
    return Executor(KVCacheManager(config(**cfg), trace=trace)), trace


def test_the_manager_exercises_every_table_entry_and_nothing_else() -> None:
    """Scenarios that together drive each entry of the table through the public API."""
    seen: set[tuple[tuple[BlockState, BlockEvent], BlockState]] = set()

    ex, trace = _traced()
    a = fresh_tokens(ex.bs + 1)
    ex.spill([a])                       # ALLOCATED .. SPILL_LANDED; the filler is DROPPED
    ex.add("r1", a)                     # ON_DISK READ_STARTED
    ex.add("r2", a)                     # ONBOARDING ACQUIRED
    ex.land_read()                      # ONBOARDING READ_LANDED
    ex.add("r3", a)                     # ON_GPU ACQUIRED
    for rid in ("r1", "r2", "r3"):
        ex.release(rid)                 # ON_GPU RELEASED
    ex.add("r4", a)                     # RELEASED ACQUIRED
    ex.release("r4")
    seen |= set(_seen(trace))

    ex, trace = _traced()
    b = fresh_tokens(ex.bs + 1)
    ex.spill([b])
    ex.add("r5", b)
    ex.land_read(ok=False)              # ONBOARDING READ_FAILED, ERROR DISCARDED
    seen |= set(_seen(trace))

    ex, trace = _traced()
    c = fresh_tokens(ex.bs + 1)
    ex.spill([c], land=False)
    ex.land_write(ok=False)             # SPILLING SPILL_FAILED
    ex.add("r6", c)                     # ON_HOST RECALLED
    seen |= set(_seen(trace))

    ex, trace = _traced()
    d = fresh_tokens(ex.bs + 1)
    ex.spill([d], land=False)
    ex.add("r7", d)                     # SPILLING RECALLED
    ex.drain()
    seen |= set(_seen(trace))

    ex, trace = _traced()
    for _ in range(3):                  # the third spill displaces: ON_DISK DROPPED
        ex.spill([fresh_tokens(ex.bs + 1)])
    assert ex.stats().displacements == 1
    seen |= set(_seen(trace))

    ex, _ = _traced()
    (write,) = ex.spill([fresh_tokens(ex.bs + 1)])
    trace = RingTrace(100)
    restored = KVCacheManager(ex.cache.config, trace=trace)
    assert write.parent is not None
    restored.restore([RestoredBlock(key=write.key, parent_key=write.parent, slot=write.slot,
                                    depth=write.depth, reuse_count=write.reuse_count,
                                    expiry=write.expiry, written_at=write.issued_at,
                                    sequence=write.transfer)], now=ex.now)  # FREE RESTORED
    seen |= set(_seen(trace))

    ex, trace = _traced()
    e = fresh_tokens(ex.bs + 1)
    ex.spill([e])
    ex.prefetch("q1", e)                # ON_DISK PREFETCH_STARTED
    ex.land_prefetch()                  # PREFETCHING PREFETCH_LANDED
    ex.release("q1")                    # PREFETCHED PREFETCH_CANCELLED
    ex.prefetch("q2", e)
    ex.land_prefetch()
    ex.add("q2", e)                     # PREFETCHED RECALLED
    ex.release("q2")
    seen |= set(_seen(trace))

    ex, trace = _traced()
    f = fresh_tokens(ex.bs + 1)
    ex.spill([f])
    ex.prefetch("q3", f)
    ex.add("q3", f)                     # PREFETCHING ACQUIRED (taken over as an onboard)
    ex.land_prefetch()
    ex.prefetch("q4", fresh_tokens(1) + f[1:])  # nothing matches: nothing started
    ex.release("q4")
    ex.release("q3")
    seen |= set(_seen(trace))

    ex, trace = _traced()
    h = fresh_tokens(ex.bs + 1)
    ex.spill([h])
    ex.prefetch("q5", h)
    ex.land_prefetch(ok=False)          # PREFETCHING PREFETCH_FAILED
    assert ex.tiers(h) == [None]
    seen |= set(_seen(trace))

    ex, trace = _traced(shared_tier=True)
    g = fresh_tokens(2 * ex.bs + 1)
    keys = ex.cache.remote_candidates(g)
    ex.add("f1", g, remote=keys)        # FREE FETCH_STARTED
    ex.add("f2", g, remote=keys)        # FETCHING ACQUIRED
    ex.release("f1")                    # release during the fetch: the page stays owned
    ex.land_fetch()                     # FETCHING FETCH_LANDED
    ex.land_fetch(ok=False)             # FETCHING FETCH_FAILED (f2 recomputes block 1)
    assert ex.cache.request_status("f2").num_computed_tokens == ex.bs
    ex.release("f2")
    seen |= set(_seen(trace))

    ex, trace = _traced(disk_blocks=0)
    ex.serve("x", fresh_tokens(ex.bs + 1))
    ex.serve("y", fresh_tokens(ex.bs + 1))
    ex.churn("c")                       # ON_HOST DROPPED
    seen |= set(_seen(trace))

    # Disk copies: a block read back keeps its slot.
    ex, trace = _traced(gpu_blocks=4, host_blocks=1, disk_blocks=2)
    d = fresh_tokens(ex.bs + 1)
    ex.spill([d])
    ex.serve("d1", d)
    ex.churn("c1")                      # d to host with its copy
    ex.serve("o1", fresh_tokens(ex.bs + 1))
    ex.churn("c2")                      # ON_HOST COPY_KEPT
    assert ex.tiers(d) == ["ON_DISK"]
    ex.serve("d2", d)
    ex.serve("o2", fresh_tokens(ex.bs + 1))
    ex.serve("d3", d)                   # d is the newest released
    ex.churn("c3")                      # RELEASED COPY_KEPT (no host page for d)
    assert ex.tiers(d) == ["ON_DISK"]
    seen |= set(_seen(trace))

    ex, trace = _traced(gpu_blocks=4, host_blocks=1, disk_blocks=1)
    d = fresh_tokens(ex.bs + 1)
    ex.spill([d])
    ex.add("h", d)
    ex.land_read()
    ex.serve("y", fresh_tokens(ex.bs + 1))
    ex.churn("c1")
    ex.serve("z", fresh_tokens(ex.bs + 1))
    ex.churn("c2")                      # ON_GPU COPY_DISPLACED (y's spill takes the slot)
    ex.drain()
    ex.release("h")
    seen |= set(_seen(trace))

    ex, trace = _traced(gpu_blocks=4, host_blocks=1, disk_blocks=1)
    d = fresh_tokens(ex.bs + 1)
    ex.spill([d])
    ex.serve("y", fresh_tokens(ex.bs + 1))
    ex.churn("c1")                      # y to host
    ex.serve("d1", d)                   # d read back, released after y
    ex.serve("z", fresh_tokens(ex.bs + 1))
    ex.churn("c2", ex.stats().gpu_free_pages + 1)  # RELEASED COPY_DISPLACED (d, the victim)
    seen |= set(_seen(trace))

    ex, trace = _traced(gpu_blocks=4, host_blocks=2, disk_blocks=1)
    d, w = fresh_tokens(ex.bs + 1), fresh_tokens(ex.bs + 1)
    ex.spill([d, w])        # d written; w finds the only slot busy; the filler stays on host
    ex.serve("d1", d)
    ex.churn("c2")                      # d to host with its copy, after the filler
    ex.serve("z", fresh_tokens(ex.bs + 1))
    ex.churn("c3")          # ON_HOST COPY_DISPLACED (the filler's spill takes d's slot)
    ex.drain()
    seen |= set(_seen(trace))

    # Beneath an engine (statekv.engine_tiers): saves, copies out, loads.
    trace = RingTrace(100_000)
    eh = EngineHarness(engine_config(host_blocks=1, reserved_host_blocks=1), trace=trace)
    a, b = list(range(eh.bs + 1)), list(range(500, 501 + eh.bs))
    eh.compute(a, [0])
    eh.save(a[: eh.bs], [0])            # FREE SAVED
    eh.load("h1", a, 0, [1])            # ON_HOST COPIED_OUT
    eh.compute(b, [2])
    eh.save(b[: eh.bs], [2])            # a spills
    eh.load("h2", a, 0, [3])            # SPILLING COPIED_OUT
    eh.drain()
    eh.load("l1", a, 0, [4])            # ON_DISK LOAD_STARTED
    eh.load("l2", a, 0, [5])            # LOADING LOAD_STARTED
    eh.land_load()
    eh.land_load()                      # LOADING LOAD_LANDED
    eh.load("l3", a, 0, [6])
    eh.land_load(ok=False)              # LOADING LOAD_FAILED
    seen |= set(_seen(trace))
    trace = RingTrace(100_000)
    eh = EngineHarness(engine_config(), trace=trace, write_through="all")
    eh.compute(a, [0])
    eh.save(a[: eh.bs], [0])
    eh.drain()                          # SPILLING COPY_WRITTEN
    seen |= set(_seen(trace))

    # Retention write-through (retention_write_through): staged from GPU, adopted on landing.
    ex, trace = _traced(retention_write_through=True, gpu_blocks=6, host_blocks=2,
                        disk_blocks=4)
    a, b, c = (fresh_tokens(ex.bs + 1) for _ in range(3))
    ex.serve("w1", a, ttl=100.0)
    ex.drain()                          # RELEASED COPY_ADOPTED
    ex.add("w2", b, ttl=100.0)
    ex.compute("w2")
    ex.add("w3", b)                     # b held by w3 as well
    ex.release("w2")
    ex.drain()                          # ON_GPU COPY_ADOPTED
    ex.release("w3")
    seen |= set(_seen(trace))
    ex, trace = _traced(retention_write_through=True, gpu_blocks=2, host_blocks=2,
                        disk_blocks=4)
    ex.serve("w4", c, ttl=100.0)        # c's write is in flight ...
    ex.churn("c1")                      # ... while c is evicted to host
    assert ex.tiers(c) == ["ON_HOST"]
    ex.drain()                          # ON_HOST COPY_ADOPTED
    seen |= set(_seen(trace))
    ex, trace = _traced(retention_write_through=True, gpu_blocks=3, host_blocks=3,
                        reserved_host_blocks=0, disk_blocks=4)
    d = fresh_tokens(2 * ex.bs + 1)
    ex.serve("w5", d, ttl=100.0)        # staged through two of the three host pages ...
    ex.churn("c2")                      # ... so one GPU victim is dropped
    assert None in ex.tiers(d)
    ex.drain()                          # FREE STAGED_LANDED
    assert sorted(map(str, ex.tiers(d))) == ["ON_DISK", "ON_HOST"]
    seen |= set(_seen(trace))

    assert seen == set(TRANSITIONS.items())


# ---------------------------------------------------------------------- the generated spec


def test_committed_spec_document_is_generated_from_the_table() -> None:
    assert lifecycle_doc.DOC_PATH.read_text() == lifecycle_doc.render()
    assert lifecycle_doc.main(["--check"]) == 0


def test_spec_document_lists_every_transition_of_the_table() -> None:
    text = lifecycle_doc.DOC_PATH.read_text()
    for (state, event), target in TRANSITIONS.items():
        assert f"| {state.name} | {event.name} | {target.name} |" in text
        assert f"{state.name} --> {target.name} : {event.name}" in text


def test_spec_check_fails_when_the_table_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    changed = dict(TRANSITIONS)
    changed[(S.ONBOARDING, E.RELEASED)] = S.FREE
    monkeypatch.setattr(lifecycle_doc, "TRANSITIONS", changed)
    assert lifecycle_doc.render() != lifecycle_doc.DOC_PATH.read_text()
    assert lifecycle_doc.main(["--check"]) == 1


def test_spec_check_command_passes_on_the_committed_document() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "specs.lifecycle_doc", "--check"],
        capture_output=True, text=True, cwd=lifecycle_doc.DOC_PATH.parent.parent, check=False,
    )
    assert result.returncode == 0, result.stderr
