"""Bad input at the boundary: a typed error naming the field, and nothing half-applied.

Each bad call is made against a busy cache (content on every tier, a parked request, a read
and a write in flight, a retained disk block whose deadline a moved clock would pass) with a
`now` later than the cache's clock; afterwards everything observable must be as before --
statistics, cached blocks, requests, the outbox, and the clock itself.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import attrs
import pytest

from statekv import KVCacheManager, OutOfBlocks, StateKVError, UsageError
from statekv.ids import BlockHash, BlockId, PageId, SlotId, TransferId
from statekv.messages import FreeSlot, SlotRead, SlotWritten, WriteSlot
from tests.harness import Executor, fresh_tokens, make

NOW = 10.0
LATER = 110.0  # past the retained block's deadline: a clock moved by a failed call shows
LIVE = ("parked", "live")


@attrs.define
class Busy:
    ex: Executor
    read: TransferId
    write: TransferId

    @property
    def cache(self) -> KVCacheManager:
        return self.ex.cache


def busy_cache() -> Busy:
    ex = make(gpu_blocks=8, host_blocks=1, disk_blocks=4, priority_levels=4)
    d1 = fresh_tokens(3)
    ex.spill([d1])
    ex.spill([fresh_tokens(3)], ttl=40.0)
    (write,) = ex.spill([fresh_tokens(3)], land=False)
    ex.add("parked", [*d1, 1])
    (read,) = ex.reads
    ex.add("live", fresh_tokens(5))
    ex.compute("live", 3)
    ex.serve("warm", fresh_tokens(3))
    ex.tick(NOW)
    assert ex.stats().disk_retained_blocks == 1
    return Busy(ex, read, write.transfer)


def snapshot(cache: KVCacheManager) -> tuple[Any, ...]:
    return (
        cache.statistics(),
        sorted(cache.cached_blocks(), key=lambda b: b.key),
        {rid: (cache.request_status(rid), cache.block_table(rid)) for rid in LIVE},
    )


def assert_refused(busy: Busy, call: Callable[[Any], object], field: str) -> None:
    cache = busy.cache
    before = snapshot(cache)
    with pytest.raises(UsageError) as info:
        call(cache)
    err = info.value
    assert err.field == field, str(err)
    assert str(err).startswith(f"{field}:")
    assert snapshot(cache) == before
    assert cache.take_commands() == []
    assert not cache.has_request("new")
    cache.check_invariants()
    # The clock did not move: an earlier time is still accepted, and nothing expired.
    cache.advance(NOW)
    assert cache.statistics() == before[0]
    # The transfers in flight are intact and complete normally.
    busy.ex.drain()
    assert cache.is_ready("parked")


TOO_MANY = 8 * 2 + 1

# The bad calls go through an untyped cache: they break the API's types on purpose.
BadCall = Callable[[Busy], Callable[[Any], object]]

BAD_CALLS: list[tuple[str, BadCall, str]] = [
    # add_request: ids
    ("duplicate-id", lambda b: lambda c: c.add_request("live", [1, 2], now=LATER), "request_id"),
    ("empty-id", lambda b: lambda c: c.add_request("", [1, 2], now=LATER), "request_id"),
    ("int-id", lambda b: lambda c: c.add_request(5, [1, 2], now=LATER), "request_id"),
    ("none-id", lambda b: lambda c: c.add_request(None, [1, 2], now=LATER), "request_id"),
    # add_request: tokens
    ("empty-tokens", lambda b: lambda c: c.add_request("new", [], now=LATER), "token_ids"),
    ("oversized-tokens",
     lambda b: lambda c: c.add_request("new", list(range(TOO_MANY)), now=LATER), "token_ids"),
    ("str-tokens", lambda b: lambda c: c.add_request("new", "abc", now=LATER), "token_ids"),
    ("bytes-tokens", lambda b: lambda c: c.add_request("new", b"ab", now=LATER), "token_ids"),
    ("none-tokens", lambda b: lambda c: c.add_request("new", None, now=LATER), "token_ids"),
    ("set-tokens", lambda b: lambda c: c.add_request("new", {1, 2}, now=LATER), "token_ids"),
    ("negative-token", lambda b: lambda c: c.add_request("new", [1, -1], now=LATER),
     "token_ids"),
    ("huge-token", lambda b: lambda c: c.add_request("new", [2**32], now=LATER), "token_ids"),
    ("bool-token", lambda b: lambda c: c.add_request("new", [5, True, 7], now=LATER),
     "token_ids"),
    ("bool-tokens", lambda b: lambda c: c.add_request("new", [False] * 3, now=LATER),
     "token_ids"),
    # add_request: priority, salt, lora, ttl
    ("priority-negative",
     lambda b: lambda c: c.add_request("new", [1], now=LATER, priority=-1), "priority"),
    ("priority-too-high",
     lambda b: lambda c: c.add_request("new", [1], now=LATER, priority=4), "priority"),
    ("priority-bool",
     lambda b: lambda c: c.add_request("new", [1], now=LATER, priority=True), "priority"),
    ("priority-float",
     lambda b: lambda c: c.add_request("new", [1], now=LATER, priority=1.0), "priority"),
    ("salt-int", lambda b: lambda c: c.add_request("new", [1], now=LATER, cache_salt=5),
     "cache_salt"),
    ("salt-bytes", lambda b: lambda c: c.add_request("new", [1], now=LATER, cache_salt=b"t"),
     "cache_salt"),
    ("request-id-surrogate",
     lambda b: lambda c: c.add_request("new\udc80", [1], now=LATER), "request_id"),
    ("salt-surrogate",
     lambda b: lambda c: c.add_request("new", [1], now=LATER, cache_salt="\ud800"),
     "cache_salt"),
    ("lora-negative", lambda b: lambda c: c.add_request("new", [1], now=LATER, lora_id=-1),
     "lora_id"),
    ("lora-bool", lambda b: lambda c: c.add_request("new", [1], now=LATER, lora_id=True),
     "lora_id"),
    ("lora-huge", lambda b: lambda c: c.add_request("new", [1], now=LATER, lora_id=2**63),
     "lora_id"),
    ("lora-str", lambda b: lambda c: c.add_request("new", [1], now=LATER, lora_id="1"),
     "lora_id"),
    ("ttl-negative",
     lambda b: lambda c: c.add_request("new", [1], now=LATER, ttl_seconds=-5), "ttl_seconds"),
    ("ttl-nan", lambda b: lambda c: c.add_request("new", [1], now=LATER, ttl_seconds=math.nan),
     "ttl_seconds"),
    ("ttl-str", lambda b: lambda c: c.add_request("new", [1], now=LATER, ttl_seconds="5"),
     "ttl_seconds"),
    # the clock
    ("add-clock-backwards", lambda b: lambda c: c.add_request("new", [1], now=NOW - 1), "now"),
    ("add-clock-nan", lambda b: lambda c: c.add_request("new", [1], now=math.nan), "now"),
    ("add-clock-inf", lambda b: lambda c: c.add_request("new", [1], now=math.inf), "now"),
    ("add-clock-bool", lambda b: lambda c: c.add_request("new", [1], now=True), "now"),
    ("add-clock-str", lambda b: lambda c: c.add_request("new", [1], now="11"), "now"),
    ("add-clock-huge-int", lambda b: lambda c: c.add_request("new", [1], now=10**400), "now"),
    ("advance-backwards", lambda b: lambda c: c.advance(NOW - 0.5), "now"),
    ("advance-nan", lambda b: lambda c: c.advance(math.nan), "now"),
    ("allocate-clock-backwards",
     lambda b: lambda c: c.allocate_nowait("live", 4, now=NOW - 1), "now"),
    ("commit-clock-backwards", lambda b: lambda c: c.commit("live", 3, now=NOW - 1), "now"),
    ("release-clock-backwards", lambda b: lambda c: c.release("live", now=NOW - 1), "now"),
    ("handle-clock-backwards",
     lambda b: lambda c: c.handle(SlotRead(transfer=b.read), now=NOW - 1), "now"),
    # unknown requests
    ("append-unknown", lambda b: lambda c: c.append_tokens("nope", [1]), "request_id"),
    ("allocate-unknown", lambda b: lambda c: c.allocate_nowait("nope", 1, now=LATER),
     "request_id"),
    ("commit-unknown", lambda b: lambda c: c.commit("nope", 1, now=LATER), "request_id"),
    ("release-unknown", lambda b: lambda c: c.release("nope", now=LATER), "request_id"),
    ("release-unhashable-id", lambda b: lambda c: c.release([1], now=LATER), "request_id"),
    ("is-ready-unknown", lambda b: lambda c: c.is_ready("nope"), "request_id"),
    ("block-table-unknown", lambda b: lambda c: c.block_table("nope"), "request_id"),
    ("status-unknown", lambda b: lambda c: c.request_status("nope"), "request_id"),
    # append_tokens
    ("append-str-tokens", lambda b: lambda c: c.append_tokens("live", "12"), "token_ids"),
    ("append-bad-token", lambda b: lambda c: c.append_tokens("live", [4, -4]), "token_ids"),
    ("append-bool-token", lambda b: lambda c: c.append_tokens("live", [True]), "token_ids"),
    # num_tokens / num_computed_tokens out of range
    ("allocate-below-computed", lambda b: lambda c: c.allocate_nowait("live", 2, now=LATER),
     "num_tokens"),
    ("allocate-above-known", lambda b: lambda c: c.allocate_nowait("live", 6, now=LATER),
     "num_tokens"),
    ("allocate-float", lambda b: lambda c: c.allocate_nowait("live", 4.0, now=LATER),
     "num_tokens"),
    ("allocate-bool", lambda b: lambda c: c.allocate_nowait("live", True, now=LATER),
     "num_tokens"),
    ("commit-below-computed", lambda b: lambda c: c.commit("live", 2, now=LATER),
     "num_computed_tokens"),
    ("commit-beyond-pages", lambda b: lambda c: c.commit("live", 5, now=LATER),
     "num_computed_tokens"),
    ("commit-str", lambda b: lambda c: c.commit("live", "4", now=LATER),
     "num_computed_tokens"),
    ("commit-while-parked", lambda b: lambda c: c.commit("parked", 2, now=LATER), "request_id"),
    # completions
    ("unknown-write", lambda b: lambda c: c.handle(SlotWritten(transfer=TransferId(999)),
                                                   now=LATER), "transfer"),
    ("unknown-read", lambda b: lambda c: c.handle(SlotRead(transfer=TransferId(999)),
                                                  now=LATER), "transfer"),
    ("read-id-as-write", lambda b: lambda c: c.handle(SlotWritten(transfer=b.read), now=LATER),
     "transfer"),
    ("write-id-as-read", lambda b: lambda c: c.handle(SlotRead(transfer=b.write), now=LATER),
     "transfer"),
    ("command-as-event",
     lambda b: lambda c: c.handle(
         WriteSlot(transfer=b.write, block=BlockId(0), key=BlockHash(b"k" * 32),
                   host_page=PageId(0), slot=SlotId(0), retained=False), now=LATER), "event"),
    ("free-slot-as-event",
     lambda b: lambda c: c.handle(FreeSlot(slot=SlotId(0)), now=LATER), "event"),
    ("string-as-event", lambda b: lambda c: c.handle("SlotRead", now=LATER), "event"),
]


@pytest.mark.parametrize(("make_call", "field"), [(m, f) for _n, m, f in BAD_CALLS],
                         ids=[n for n, _m, _f in BAD_CALLS])
def test_bad_input_raises_usage_error_naming_the_field_and_changes_nothing(
    make_call: BadCall, field: str,
) -> None:
    busy = busy_cache()
    assert_refused(busy, make_call(busy), field)


def test_a_completion_is_refused_the_second_time() -> None:
    busy = busy_cache()
    busy.cache.handle(SlotRead(transfer=busy.read), now=NOW)
    busy.ex.reads.pop(busy.read)
    busy.ex.pump()
    assert_refused(busy, lambda c: c.handle(SlotRead(transfer=busy.read), now=LATER),
                   "transfer")


def test_allocate_beyond_obtainable_pages_raises_out_of_blocks_and_changes_nothing() -> None:
    busy = busy_cache()
    cache = busy.cache
    cache.append_tokens("live", list(range(11)))
    before = snapshot(cache)
    with pytest.raises(OutOfBlocks) as info:
        cache.allocate_nowait("live", 16, now=LATER)
    err = info.value
    assert err.request_id == "live"
    assert err.needed > err.available
    assert snapshot(cache) == before
    assert cache.take_commands() == []
    cache.advance(NOW)
    cache.check_invariants()


def test_add_request_that_cannot_onboard_raises_out_of_blocks_and_changes_nothing() -> None:
    ex = make(gpu_blocks=4, host_blocks=1, disk_blocks=2)
    doc = fresh_tokens(3)
    ex.spill([doc])
    ex.add("hog", fresh_tokens(8))
    ex.cache.allocate_nowait("hog", 8, now=ex.now)
    ex.pump()
    before = (ex.stats(), ex.cache.cached_blocks())
    with pytest.raises(OutOfBlocks) as info:
        ex.cache.add_request("b", [*doc, 1], now=ex.now)
    assert (info.value.needed, info.value.available) == (1, 0)
    assert (ex.stats(), ex.cache.cached_blocks()) == before  # reuse count untouched too
    assert ex.cache.take_commands() == []
    assert not ex.cache.has_request("b")
    assert ex.tiers(doc) == ["ON_DISK"]
    ex.release("hog")
    assert ex.add("b", [*doc, 1]).disk_tokens == 2


def test_append_tokens_beyond_what_the_gpu_can_hold_raises_usage_error() -> None:
    ex = make(gpu_blocks=4)
    capacity = 4 * ex.bs
    ex.add("a", fresh_tokens(capacity - 1))
    ex.cache.append_tokens("a", [1])                 # exactly full: fine
    with pytest.raises(UsageError) as info:
        ex.cache.append_tokens("a", [2])
    assert info.value.field == "token_ids"
    assert ex.cache.request_status("a").num_tokens == capacity


def test_manager_needs_a_cache_config() -> None:
    with pytest.raises(UsageError) as info:
        KVCacheManager({"block_size": 16})  # type: ignore[arg-type]
    assert info.value.field == "config"


def test_has_request_answers_false_for_any_unknown_id() -> None:
    cache = busy_cache().cache
    assert cache.has_request("live")
    assert not cache.has_request("nope")
    assert not cache.has_request([1])  # type: ignore[arg-type]
    assert not cache.has_request(5)  # type: ignore[arg-type]


def test_usage_errors_are_value_errors_of_statekv() -> None:
    assert issubclass(UsageError, ValueError)
    assert issubclass(UsageError, StateKVError)
    assert issubclass(OutOfBlocks, StateKVError)


def test_the_busy_cache_really_is_busy() -> None:
    """Guards the fixture the tests above rely on."""
    busy = busy_cache()
    stats = busy.ex.stats()
    assert stats.reads_in_flight == 1 and stats.writes_in_flight == 1
    assert stats.parked_requests == 1 and stats.disk_cached_blocks == 1
    assert stats.disk_retained_blocks == 1
    assert busy.cache.request_status("live").num_computed_tokens == 3
    assert busy.cache.request_status("parked").num_computed_tokens == 2
