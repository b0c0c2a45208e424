"""Retention TTLs: stamping, the expiry boundary, eviction order, the deadline set, bad TTLs."""

from __future__ import annotations

import math

import pytest

from statekv import UsageError
from statekv.arith import expiry_after, is_live
from statekv.messages import CopyGpuToHost
from tests.harness import Executor, block_keys, fresh_tokens, make


def one_block() -> list[int]:
    return fresh_tokens(3)


def disk_cache(disk_blocks: int = 2, **overrides: object) -> Executor:
    return make(gpu_blocks=4, host_blocks=1, disk_blocks=disk_blocks, **overrides)


# ---------------------------------------------------------------------- stamping


def test_ttl_is_stamped_at_release_as_now_plus_ttl() -> None:
    ex = make()
    doc = fresh_tokens(5)
    ex.now = 5.0
    ex.add("a", doc, ttl=100.0)
    ex.compute("a")
    assert all(b.expiry is None for b in ex.cached().values())
    ex.now = 50.0
    ex.release("a")
    assert [ex.cached()[k].expiry for k in block_keys(doc, ex.bs)] == [150.0, 150.0]


def test_a_later_stamp_extends_and_an_earlier_one_never_shortens() -> None:
    ex = make()
    doc = one_block()
    (key,) = block_keys(doc, ex.bs)
    ex.serve("a", doc, ttl=100.0)
    assert ex.cached()[key].expiry == 100.0
    ex.now = 5.0
    ex.serve("b", doc, ttl=10.0)      # 15 < 100: kept at 100
    assert ex.cached()[key].expiry == 100.0
    ex.serve("c", doc)                # no TTL: kept
    assert ex.cached()[key].expiry == 100.0
    ex.serve("d", doc, ttl=200.0)     # 205 > 100: extended
    assert ex.cached()[key].expiry == 205.0


def test_zero_ttl_stamps_nothing() -> None:
    ex = make()
    doc = one_block()
    ex.serve("a", doc, ttl=0)
    assert [b.expiry for b in ex.cached().values()] == [None]


def test_ttl_of_exactly_max_ttl_seconds_is_accepted() -> None:
    ex = make(max_ttl_seconds=60.0)
    doc = one_block()
    ex.serve("a", doc, ttl=60.0)
    assert [b.expiry for b in ex.cached().values()] == [60.0]


def test_a_tiny_ttl_far_from_time_zero_still_stamps_a_future_deadline() -> None:
    assert expiry_after(1e14, 1e-6) > 1e14
    assert expiry_after(0.0, 1e-300) > 0.0


# ---------------------------------------------------------------------- the boundary


def test_content_is_live_strictly_before_its_deadline() -> None:
    assert is_live(10.0, 9.999)
    assert not is_live(10.0, 10.0)
    assert not is_live(None, 0.0)


def test_disk_content_expires_exactly_at_its_deadline() -> None:
    ex = disk_cache()
    doc = one_block()
    ex.spill([doc], ttl=10.0)
    stats = ex.stats()
    assert stats.disk_retained_blocks == 1 and stats.expirations == 0
    ex.tick(math.nextafter(10.0, 0.0))
    assert ex.stats().disk_retained_blocks == 1
    ex.tick(10.0 - ex.now)
    stats = ex.stats()
    assert ex.now == 10.0
    assert stats.disk_retained_blocks == 0 and stats.expirations == 1
    assert ex.tiers(doc) == ["ON_DISK"]  # still cached, now best-effort


def test_content_landing_after_its_deadline_is_filed_best_effort() -> None:
    ex = disk_cache()
    doc = one_block()
    ex.spill([doc], ttl=10.0, land=False)
    ex.now = 10.0
    ex.land_write()
    stats = ex.stats()
    assert stats.disk_retained_blocks == 0
    assert ex.tiers(doc) == ["ON_DISK"]


def test_any_call_that_takes_the_clock_expires_content() -> None:
    ex = disk_cache(disk_blocks=3)
    ex.spill([one_block()], ttl=10.0)
    ex.now = 11.0
    ex.add("late", fresh_tokens(3))   # no advance() call: add_request's `now` suffices
    assert ex.stats().expirations == 1


# ---------------------------------------------------------------------- eviction order


def _offload_order(ttl_first: float | None) -> list[list[int]]:
    """Serve two prompts (the first with `ttl_first`), evict both from GPU to host, then
    evict both from host (no disk): the keys in GPU-eviction and host-drop order."""
    ex = make(host_blocks=2, disk_blocks=0)
    first, second = one_block(), one_block()
    ex.serve("a", first, ttl=ttl_first)
    ex.serve("b", second)
    start = len(ex.log)
    ex.churn("c1")
    offloaded = [c.block for c in ex.log[start:] if isinstance(c, CopyGpuToHost)]
    order_to_host = [int(b) for b in offloaded]
    ex.serve("x", one_block())
    ex.churn("c2")  # x to host: the oldest host block is dropped
    survivors = [i for i, d in enumerate((first, second)) if ex.tiers(d) == ["ON_HOST"]]
    return [order_to_host, survivors]


def test_retention_stamp_never_changes_gpu_or_host_eviction_order() -> None:
    with_ttl = _offload_order(1000.0)
    without = _offload_order(None)
    assert with_ttl == without
    assert with_ttl[1] == [1]  # the retained block was the older one: dropped first


def test_higher_priority_content_is_evicted_later_on_gpu_and_host() -> None:
    ex = make(host_blocks=2, disk_blocks=0, priority_levels=2)
    high, low = one_block(), one_block()
    ex.serve("h", high, priority=1)
    ex.serve("l", low, priority=0)       # newer, but lower priority
    ex.churn("c1", 3)                    # two empty pages and one eviction
    assert ex.tiers(low) == ["ON_HOST"] and ex.tiers(high) == ["RELEASED"]
    ex.churn("c2")
    ex.serve("x", one_block(), priority=1)
    ex.churn("c3")                       # the host tier is full: one of them is dropped
    assert ex.tiers(low) == [None] and ex.tiers(high) == ["ON_HOST"]


def test_ttl_request_whose_content_another_committed_first_still_stamps_that_content() -> None:
    ex = make()
    doc = one_block()
    (key,) = block_keys(doc, ex.bs)
    ex.add("plain", doc)
    ex.add("paid", doc, ttl=100.0)
    ex.compute("plain")
    ex.compute("paid")      # the same full block: "paid" keeps a private duplicate
    ex.release("paid")
    assert ex.cached()[key].expiry == 100.0


# ---------------------------------------------------------------------- the deadline set


def test_deadline_set_forgets_a_block_when_it_is_onboarded() -> None:
    ex = disk_cache()
    doc = one_block()
    ex.spill([doc], ttl=100.0)
    assert ex.stats().disk_retained_blocks == 1
    ex.add("b", [*doc, 1])
    assert ex.stats().disk_retained_blocks == 0
    assert len(ex.cache._disk.slots.retained) == 0
    ex.land_read()
    # The slot is kept as a disk copy and filed again with its deadline: once, not stale.
    assert ex.stats().disk_retained_blocks == 1 and ex.stats().disk_copy_blocks == 1
    assert len(ex.cache._disk.slots.retained) == 1


def test_deadline_set_forgets_a_block_when_it_is_displaced() -> None:
    ex = disk_cache(disk_blocks=1)
    ex.spill([one_block()], ttl=100.0)
    first = ex.cache._disk.slots.retained.peek()
    ex.spill([one_block()], ttl=200.0)  # displaces it: the disk is full, a TTL may displace
    assert ex.stats().displacements == 1
    assert ex.stats().disk_retained_blocks == 1          # the newcomer only
    assert ex.cache._disk.slots.retained.peek() is not first


def test_deadline_set_forgets_a_block_when_it_expires() -> None:
    ex = disk_cache()
    ex.spill([one_block()], ttl=100.0)
    ex.tick(100.0)
    assert ex.stats().disk_retained_blocks == 0
    assert len(ex.cache._disk.slots.retained) == 0
    assert len(ex.cache._disk.slots.unmarked) == 1


def test_deadline_set_forgets_a_block_whose_read_failed() -> None:
    ex = disk_cache()
    doc = one_block()
    ex.spill([doc], ttl=100.0)
    ex.add("b", [*doc, 1])
    ex.land_read(ok=False)
    assert ex.stats().disk_retained_blocks == 0
    assert ex.tiers(doc) == [None]


def test_deadline_set_counts_exactly_the_live_disk_blocks() -> None:
    ex = disk_cache(disk_blocks=4)
    for ttl in (10.0, 20.0, None, 30.0):
        ex.spill([one_block()], ttl=ttl)
    assert ex.stats().disk_retained_blocks == 3
    ex.tick(15.0)
    assert ex.stats().disk_retained_blocks == 2
    ex.tick(15.0)
    assert ex.stats().disk_retained_blocks == 0
    assert ex.stats().expirations == 3
    assert ex.stats().disk_cached_blocks == 4


# ---------------------------------------------------------------------- bad TTLs


@pytest.mark.parametrize(
    "ttl",
    [-1.0, -1e-9, math.nan, math.inf, -math.inf, 3600.5, "60", True, [60], 10**400],
    ids=["negative", "tiny-negative", "nan", "inf", "-inf", "above-max", "str", "bool",
         "list", "huge-int"],
)
def test_bad_ttl_raises_usage_error_naming_ttl_seconds_and_changes_nothing(ttl: object) -> None:
    ex = make(max_ttl_seconds=3600.0)
    ex.serve("warm", fresh_tokens(5))
    before = (ex.stats(), ex.cache.cached_blocks())
    with pytest.raises(UsageError) as info:
        ex.cache.add_request("a", fresh_tokens(5), now=1.0, ttl_seconds=ttl)  # type: ignore[arg-type]
    assert info.value.field == "ttl_seconds"
    assert (ex.stats(), ex.cache.cached_blocks()) == before
    assert not ex.cache.has_request("a")
    assert ex.cache.take_commands() == []
    ex.cache.advance(0.0)  # the clock did not move to the failed call's `now`
    ex.cache.check_invariants()
