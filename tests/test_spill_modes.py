"""Which host victims reach the disk: spill modes, drop-on-pressure, the host reserve."""

from __future__ import annotations

import pytest

from statekv import SpillMode
from statekv.ids import PageId
from statekv.messages import CopyGpuToHost, WriteSlot
from tests.harness import Executor, block_keys, fresh_tokens, make


def one_block() -> list[int]:
    return fresh_tokens(3)


def writes_since(ex: Executor, start: int) -> list[WriteSlot]:
    return [c for c in ex.log[start:] if isinstance(c, WriteSlot)]


def push_to_host_and_evict(ex: Executor, tokens: list[int], *, ttl: float | None = None,
                           expire_after: float = 0.0) -> None:
    """Serve `tokens`, push it to a one-page host tier, then evict it from there."""
    ex.serve(ex.rid(), tokens, ttl=ttl)
    ex.serve(ex.rid("filler"), fresh_tokens(3))
    if expire_after:
        ex.tick(expire_after)
    ex.churn(ex.rid("churn"))


# ---------------------------------------------------------------------- spill modes


@pytest.mark.parametrize("ttl", [None, 100.0])
def test_spill_mode_all_spills_every_reusable_victim(ttl: float | None) -> None:
    ex = make(host_blocks=1, spill_mode=SpillMode.ALL)
    doc = one_block()
    (write,) = ex.spill([doc], ttl=ttl)
    assert write.retained is (ttl is not None)
    assert ex.tiers(doc) == ["ON_DISK"]
    assert ex.stats().gate_drops == 0


def test_retained_only_spills_a_block_with_a_running_ttl() -> None:
    ex = make(host_blocks=1, spill_mode=SpillMode.RETAINED_ONLY)
    doc = one_block()
    (write,) = ex.spill([doc], ttl=60.0)
    assert write.retained
    assert ex.tiers(doc) == ["ON_DISK"]


def test_retained_only_drops_best_effort_victims_at_the_gate() -> None:
    ex = make(host_blocks=1, spill_mode=SpillMode.RETAINED_ONLY)
    doc = one_block()
    start = len(ex.log)
    push_to_host_and_evict(ex, doc)
    assert writes_since(ex, start) == []
    stats = ex.stats()
    assert stats.gate_drops == 1 and stats.host_drops == 1 and stats.spills == 0
    assert ex.tiers(doc) == [None]


def test_retained_only_drops_a_victim_whose_ttl_ran_out() -> None:
    ex = make(host_blocks=1, spill_mode=SpillMode.RETAINED_ONLY)
    doc = one_block()
    start = len(ex.log)
    push_to_host_and_evict(ex, doc, ttl=5.0, expire_after=5.0)
    assert writes_since(ex, start) == []
    assert ex.stats().gate_drops == 1
    assert ex.tiers(doc) == [None]


@pytest.mark.parametrize(("hits", "spilled"), [(0, False), (1, False), (2, True), (3, True)])
def test_reuse_gate_spills_only_blocks_reused_at_least_k_times(hits: int, spilled: bool) -> None:
    ex = make(host_blocks=1, spill_mode=SpillMode.REUSED, spill_min_reuse=2)
    doc = one_block()
    for _ in range(hits):
        ex.serve(ex.rid(), doc)
    start = len(ex.log)
    push_to_host_and_evict(ex, doc)
    assert (len(writes_since(ex, start)) == 1) is spilled
    assert ex.stats().gate_drops == (0 if spilled else 1)
    assert ex.tiers(doc) == (["SPILLING"] if spilled else [None])


def test_reuse_counter_survives_moves_between_tiers() -> None:
    ex = make(host_blocks=1, spill_mode=SpillMode.REUSED, spill_min_reuse=2)
    doc = one_block()
    (key,) = block_keys(doc, ex.bs)
    ex.serve("a", doc)
    ex.serve("b", doc)                          # hit on GPU: 1
    ex.churn("c1")
    assert ex.tiers(doc) == ["ON_HOST"] and ex.cached()[key].reuse_count == 1
    ex.serve("d", doc)                          # hit on host: 2
    assert ex.cached()[key].reuse_count == 2
    ex.churn("c2")
    ex.serve("f", fresh_tokens(3))
    ex.churn("c3")                              # evicted from host: 2 >= 2, spilled
    ex.drain()
    assert ex.tiers(doc) == ["ON_DISK"] and ex.cached()[key].reuse_count == 2
    assert ex.stats().gate_drops == 0
    ex.add("e", [*doc, 1])                      # hit on disk: 3
    ex.land_read()
    assert ex.cached()[key].reuse_count == 3


# ---------------------------------------------------------------------- drop on pressure


def test_drop_on_pressure_sheds_best_effort_spills_while_the_queue_is_full() -> None:
    ex = make(host_blocks=2, drop_on_pressure=True, write_queue_depth=1)
    first, second = one_block(), one_block()
    writes = ex.spill([first, second], land=False)
    assert [w.key for w in writes] == block_keys(first, ex.bs)
    stats = ex.stats()
    assert stats.pressure_drops == 1 and stats.host_drops == 1
    assert ex.tiers(second) == [None]
    assert ex.tiers(first) == ["SPILLING"]


def test_drop_on_pressure_never_sheds_a_retained_spill() -> None:
    ex = make(host_blocks=2, drop_on_pressure=True, write_queue_depth=1)
    first, second = one_block(), one_block()
    writes = ex.spill([first, second], ttl=100.0, land=False)
    assert len(writes) == 2 and all(w.retained for w in writes)
    assert ex.stats().pressure_drops == 0
    assert ex.stats().writes_in_flight == 2


def test_retained_spill_goes_through_behind_a_full_queue_that_sheds_best_effort() -> None:
    ex = make(host_blocks=2, drop_on_pressure=True, write_queue_depth=1)
    retained, best_effort = one_block(), one_block()
    ex.serve("r", retained, ttl=100.0)
    ex.serve("b", best_effort)
    ex.serve("f", fresh_tokens(3))
    ex.churn("c")   # host victims in order: retained (spilled), best-effort (shed)
    assert ex.tiers(retained) == ["SPILLING"]
    assert ex.tiers(best_effort) == [None]
    assert ex.stats().pressure_drops == 1


def test_without_drop_on_pressure_a_full_queue_sheds_nothing() -> None:
    ex = make(host_blocks=2, drop_on_pressure=False, write_queue_depth=1)
    writes = ex.spill([one_block(), one_block()], land=False)
    assert len(writes) == 2
    assert ex.stats().pressure_drops == 0


def test_pressure_is_measured_by_writes_still_in_flight() -> None:
    ex = make(host_blocks=1, drop_on_pressure=True, write_queue_depth=1)
    first, second = one_block(), one_block()
    ex.spill([first])       # lands: the queue is empty again
    ex.spill([second])
    assert ex.tiers(first) == ex.tiers(second) == ["ON_DISK"]
    assert ex.stats().pressure_drops == 0


# ---------------------------------------------------------------------- reserved host pages


def test_reserved_host_page_is_handed_out_at_once_while_the_victim_drains() -> None:
    ex = make(host_blocks=1, reserved_host_blocks=1, disk_blocks=4)
    a, b = one_block(), one_block()
    ex.serve("a", a)
    ex.churn("c1")
    assert ex.tiers(a) == ["ON_HOST"]
    assert ex.stats().host_reserved_pages == 1
    ex.serve("b", b)
    start = len(ex.log)
    ex.churn("c2")
    (copy,) = [c for c in ex.log[start:] if isinstance(c, CopyGpuToHost)]
    assert copy.host_page == PageId(1)  # the reserved page: host pages are 0 .. host_blocks-1
    assert ex.tiers(a) == ["SPILLING"] and ex.tiers(b) == ["ON_HOST"]
    stats = ex.stats()
    assert stats.host_reserved_pages == 0 and stats.offloads_skipped == 0

    ex.land_write()   # one out, one in: the drained page refills the reserve
    stats = ex.stats()
    assert stats.host_reserved_pages == 1 and stats.host_free_pages == 0
    assert ex.tiers(a) == ["ON_DISK"]


def test_empty_reserve_means_the_gpu_victim_waits_for_no_page_and_is_dropped() -> None:
    ex = make(host_blocks=1, reserved_host_blocks=1, disk_blocks=4)
    a, b, c = one_block(), one_block(), one_block()
    ex.serve("a", a)
    ex.churn("c1")
    ex.serve("b", b)
    ex.churn("c2")    # a spills, b takes the reserved page
    ex.serve("c", c)
    ex.churn("c3")    # b spills, the reserve is empty: c finds no host page
    assert ex.tiers(a) == ex.tiers(b) == ["SPILLING"]
    assert ex.tiers(c) == [None]
    assert ex.stats().offloads_skipped == 1
    ex.drain()
    stats = ex.stats()
    assert stats.host_reserved_pages == 1 and stats.host_free_pages == 1


def test_a_page_coming_back_refills_the_reserve_before_the_free_list() -> None:
    ex = make(host_blocks=1, reserved_host_blocks=1, disk_blocks=4)
    a, b = one_block(), one_block()
    ex.serve("a", a)
    ex.churn("c1")
    ex.serve("b", b)
    ex.churn("c2")    # a spilling from page 0, b on the reserved page 1
    ex.serve("hit", [*b, 7])  # b recalled to GPU: its page comes back
    stats = ex.stats()
    assert stats.host_reserved_pages == 1 and stats.host_free_pages == 0
    ex.land_write()
    stats = ex.stats()
    assert stats.host_reserved_pages == 1 and stats.host_free_pages == 1
