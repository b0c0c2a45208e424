"""The seed's races, each made impossible: the test plays the executor and picks the timing.

The executor in tests.harness also checks the command contract on every step: never two
transfers on one slot, never a read of a slot that holds other content, never a FreeSlot
while a transfer on the slot is in flight.
"""

from __future__ import annotations

import pytest

from statekv import OutOfBlocks, UsageError
from statekv.lifecycle import BlockState
from statekv.messages import CopyHostToGpu, FreeSlot, ReadSlot, WriteSlot
from tests.harness import Executor, block_keys, fresh_tokens, make


def one_block() -> list[int]:
    return fresh_tokens(3)


def disk_cache(disk_blocks: int = 2, **overrides: object) -> Executor:
    return make(gpu_blocks=4, host_blocks=1, disk_blocks=disk_blocks, **overrides)


def reads_since(ex: Executor, start: int) -> list[ReadSlot]:
    return [c for c in ex.log[start:] if isinstance(c, ReadSlot)]


# ---------------------------------------------------------------------- release during onboard


def test_release_during_onboard_defers_free() -> None:
    ex = disk_cache()
    doc = one_block()
    ex.spill([doc])
    start = len(ex.log)
    ex.add("a", [*doc, 1])
    (read,) = reads_since(ex, start)
    free_before = ex.stats().gpu_free_pages
    assert ex.stats().parked_requests == 1
    ex.release("a")
    assert ex.stats().parked_requests == 0
    assert ex.tiers(doc) == ["ONBOARDING"]
    assert ex.stats().gpu_free_pages == free_before  # the page stays with the read
    # Take every page that can be had: the page being read into is not among them.
    stats = ex.stats()
    obtainable = stats.gpu_free_pages + stats.gpu_evictable_blocks
    assert obtainable == ex.cache.config.gpu_blocks - 1
    ex.add("hog", fresh_tokens(obtainable * ex.bs))
    ex.cache.allocate_nowait("hog", obtainable * ex.bs, now=ex.now)
    ex.pump()
    assert read.gpu_page not in ex.cache.block_table("hog")
    ex.add("more", [1])
    with pytest.raises(OutOfBlocks):
        ex.cache.allocate_nowait("more", 1, now=ex.now)
    ex.cache.check_invariants()


def test_after_the_deferred_read_lands_the_content_is_cached_on_gpu() -> None:
    ex = disk_cache()
    doc = one_block()
    ex.spill([doc])
    ex.add("a", [*doc, 1])
    ex.release("a")
    ex.land_read()
    assert ex.tiers(doc) == ["RELEASED"]
    assert ex.stats().gpu_evictable_blocks == 1
    match = ex.add("b", [*doc, 2])
    assert match.gpu_tokens == 2 and match.ready


def test_release_of_one_waiter_keeps_the_read_for_the_other() -> None:
    ex = disk_cache()
    doc = one_block()
    ex.spill([doc])
    ex.add("a", [*doc, 1])
    ex.add("b", [*doc, 2])
    ex.release("a")
    assert not ex.cache.is_ready("b")
    ex.land_read()
    assert ex.cache.is_ready("b")
    assert ex.stats().parked_requests == 0
    assert ex.tiers(doc) == ["ON_GPU"]


# ---------------------------------------------------------------------- slots with reads pending


def test_a_slot_with_a_pending_read_is_never_given_to_a_new_spill() -> None:
    ex = disk_cache(disk_blocks=1)
    doc = one_block()
    ex.spill([doc])
    ex.add("a", [*doc, 1])             # the read of the only slot is in flight
    start = len(ex.log)
    ex.serve("x", one_block())
    ex.serve("f", one_block())
    ex.churn("c")                      # x must leave the host: the disk is busy
    assert not any(isinstance(c, WriteSlot) for c in ex.log[start:])
    assert ex.stats().disk_busy_refusals == 1
    ex.land_read()                     # the slot is the block's disk copy now,
    assert ex.stats().disk_copy_blocks == 1  # displaceable at once (inclusive tiers)
    assert ex.cache._disk.slots.next_victim(True) is not None


def test_a_slot_with_a_pending_read_is_skipped_by_displacement() -> None:
    ex = disk_cache(disk_blocks=2)
    reading = one_block()
    (reading_write,) = ex.spill([reading])     # the oldest best-effort content...
    (other_write,) = ex.spill([one_block()])
    ex.add("a", [*reading, 1])                 # ...but its read is in flight
    (write,) = ex.spill([one_block()], land=False)
    assert write.slot == other_write.slot != reading_write.slot
    assert ex.tiers(reading) == ["ONBOARDING"]
    ex.land_read()
    assert ex.cache.is_ready("a")


# ---------------------------------------------------------------------- read failures


def test_read_failure_never_publishes_the_block_and_the_request_recomputes() -> None:
    ex = disk_cache()
    doc = one_block()
    (key,) = block_keys(doc, ex.bs)
    ex.spill([doc])
    ex.add("a", [*doc, 1])
    assert ex.stats().parked_requests == 1
    ex.land_read(ok=False)
    status = ex.cache.request_status("a")
    assert status.ready and ex.cache.is_ready("a")
    assert status.num_computed_tokens == 0 and status.num_blocks == 0
    assert key not in ex.cached()
    stats = ex.stats()
    assert stats.onboard_failures == 1 and stats.io_errors == 1
    assert stats.requests_fallen_back == 1 and stats.parked_requests == 0
    assert stats.onboards_completed == 0 and stats.bytes_read == 0
    assert dict(stats.blocks_by_state)["ERROR"] == 0
    # It recomputes, and the recomputed content is cached again.
    ex.compute("a")
    ex.release("a")
    assert ex.tiers(doc) == ["RELEASED"]


def test_read_failure_of_a_later_block_rewinds_to_that_block() -> None:
    ex = make(gpu_blocks=4, host_blocks=2, disk_blocks=2)
    doc = fresh_tokens(5)
    prefix_key, suffix_key = block_keys(doc, ex.bs)
    ex.spill([doc])
    start = len(ex.log)
    ex.add("a", [*doc, 1])
    reads = {r.key: r for r in reads_since(ex, start)}
    ex.land_read(reads[prefix_key].transfer)
    assert not ex.cache.is_ready("a")
    ex.land_read(reads[suffix_key].transfer, ok=False)
    status = ex.cache.request_status("a")
    assert status.ready and status.num_computed_tokens == ex.bs and status.num_blocks == 1
    assert ex.tiers(doc) == ["ON_GPU", None]


def test_read_failure_of_an_earlier_block_drops_the_later_ones_too() -> None:
    ex = make(gpu_blocks=4, host_blocks=2, disk_blocks=2)
    doc = fresh_tokens(5)
    prefix_key, suffix_key = block_keys(doc, ex.bs)
    ex.spill([doc])
    start = len(ex.log)
    ex.add("a", [*doc, 1])
    reads = {r.key: r for r in reads_since(ex, start)}
    ex.land_read(reads[prefix_key].transfer, ok=False)
    status = ex.cache.request_status("a")
    assert status.ready and status.num_computed_tokens == 0 and status.num_blocks == 0
    assert ex.tiers(doc) == [None, "ONBOARDING"]  # its read still owns page and slot
    ex.land_read(reads[suffix_key].transfer)
    assert ex.tiers(doc) == [None, "RELEASED"]


def test_read_failure_sends_every_waiting_request_back_to_recompute() -> None:
    ex = disk_cache()
    doc = one_block()
    ex.spill([doc])
    ex.add("a", [*doc, 1])
    ex.add("b", [*doc, 2])
    ex.land_read(ok=False)
    for rid in ("a", "b"):
        assert ex.cache.is_ready(rid)
        assert ex.cache.request_status(rid).num_computed_tokens == 0
    assert ex.stats().requests_fallen_back == 2
    assert ex.stats().onboard_failures == 1


def test_read_failure_after_every_holder_left_frees_the_block() -> None:
    ex = disk_cache()
    doc = one_block()
    ex.spill([doc])
    ex.add("a", [*doc, 1])
    ex.release("a")
    free = ex.stats().gpu_free_pages
    ex.land_read(ok=False)
    assert ex.stats().gpu_free_pages == free + 1
    assert ex.tiers(doc) == [None]
    assert ex.stats().requests_fallen_back == 0


def test_read_failure_also_gives_back_pages_allocated_while_parked() -> None:
    ex = make(gpu_blocks=6, host_blocks=1, disk_blocks=2)
    doc = one_block()
    ex.spill([doc])
    ex.add("a", [*doc, *fresh_tokens(5)])
    ex.cache.allocate_nowait("a", 8, now=ex.now)   # allowed while parked: 3 more pages
    ex.pump()
    assert ex.cache.request_status("a").num_blocks == 4
    free = ex.stats().gpu_free_pages
    ex.land_read(ok=False)
    status = ex.cache.request_status("a")
    assert status.num_blocks == 0 and status.num_computed_tokens == 0 and status.ready
    assert ex.stats().gpu_free_pages == free + 4
    ex.compute("a")
    ex.release("a")


# ---------------------------------------------------------------------- shared reads


def test_a_second_request_hitting_an_onboarding_block_waits_on_the_same_read() -> None:
    ex = disk_cache()
    doc = one_block()
    ex.spill([doc])
    start = len(ex.log)
    first = ex.add("a", [*doc, 1])
    second = ex.add("b", [*doc, 2])
    assert len(reads_since(ex, start)) == 1
    assert first.disk_tokens == second.disk_tokens == 2
    assert not first.ready and not second.ready
    stats = ex.stats()
    assert stats.onboards == 1 and stats.hit_blocks_disk == 2
    assert stats.parked_requests == 2 and stats.requests_parked == 2
    assert ex.cache.block_table("a") == ex.cache.block_table("b")
    ex.land_read()
    assert ex.cache.is_ready("a") and ex.cache.is_ready("b")
    assert ex.stats().parked_requests == 0


def test_a_parked_request_cannot_commit_until_its_reads_land() -> None:
    ex = disk_cache()
    doc = one_block()
    ex.spill([doc])
    ex.add("a", [*doc, 1])
    ex.cache.allocate_nowait("a", 3, now=ex.now)
    with pytest.raises(UsageError) as info:
        ex.cache.commit("a", 3, now=ex.now)
    assert info.value.field == "request_id"
    ex.land_read()
    ex.cache.commit("a", 3, now=ex.now)
    ex.cache.check_invariants()


# ---------------------------------------------------------------------- writes in flight


def test_recall_of_a_block_whose_spill_write_is_in_flight() -> None:
    ex = disk_cache()
    doc = one_block()
    (write,) = ex.spill([doc], land=False)
    start = len(ex.log)
    match = ex.add("a", [*doc, 1])
    assert match.host_tokens == 2 and match.ready
    (copy,) = [c for c in ex.log[start:] if isinstance(c, CopyHostToGpu)]
    assert copy.host_page == write.host_page  # the intact page the writer reads
    assert ex.tiers(doc) == ["ON_GPU"]
    assert ex.stats().writes_in_flight == 1
    ex.land_write(write.transfer)
    # The bytes in the slot belong to nobody: the slot is freed, the content stays on GPU.
    assert ex.freed[-1] == write.slot
    assert ex.tiers(doc) == ["ON_GPU"]
    stats = ex.stats()
    assert stats.disk_cached_blocks == 0 and stats.disk_empty_slots == 2
    assert stats.host_free_pages == 1


def test_recall_during_a_write_that_then_fails_frees_slot_and_page() -> None:
    ex = disk_cache()
    doc = one_block()
    (write,) = ex.spill([doc], land=False)
    ex.add("a", [*doc, 1])
    ex.land_write(write.transfer, ok=False)
    assert ex.tiers(doc) == ["ON_GPU"]
    stats = ex.stats()
    assert stats.spill_failures == 1 and stats.disk_empty_slots == 2
    assert stats.host_free_pages == 1


def test_write_failure_keeps_the_content_on_host() -> None:
    ex = disk_cache()
    doc = one_block()
    (write,) = ex.spill([doc], land=False)
    ex.land_write(write.transfer, ok=False)
    assert ex.tiers(doc) == ["ON_HOST"]
    stats = ex.stats()
    assert stats.spill_failures == 1 and stats.io_errors == 1
    assert stats.spills_completed == 0 and stats.bytes_written == 0
    assert stats.disk_empty_slots == 2
    assert ex.freed[-1] == write.slot
    match = ex.add("a", [*doc, 1])
    assert match.host_tokens == 2


def test_write_failure_puts_the_block_back_as_the_newest_host_content() -> None:
    ex = make(gpu_blocks=4, host_blocks=2, disk_blocks=2)
    failed, landed = one_block(), one_block()
    writes = ex.spill([failed, landed], land=False)
    ex.land_write(writes[0].transfer, ok=False)
    ex.land_write(writes[1].transfer)
    assert ex.tiers(failed) == ["ON_HOST"]
    cached = {k: b.state for k, b in ex.cached().items()}
    assert cached[block_keys(landed, ex.bs)[0]] is BlockState.ON_DISK


# ---------------------------------------------------------------------- no wedging


def test_completions_free_slots_at_once_so_spills_never_wedge() -> None:
    ex = disk_cache(disk_blocks=1)
    kept: list[int] = []
    for _ in range(20):
        kept = one_block()
        assert len(ex.spill([kept])) == 1
        assert ex.tiers(kept) == ["ON_DISK"]
    stats = ex.stats()
    assert stats.spills == stats.spills_completed == 20
    assert stats.displacements == 19
    assert stats.disk_busy_refusals == 0
    assert ex.tiers(kept) == ["ON_DISK"]


def test_an_onboarded_slot_is_reusable_without_any_reap_or_clock_tick() -> None:
    ex = disk_cache(disk_blocks=1)
    doc = one_block()
    (first,) = ex.spill([doc])
    ex.add("a", [*doc, 1])
    ex.land_read()
    # Inclusive tiers: the slot is kept as doc's disk copy (never freed), and is displaceable
    # at once: the next spill takes it with no reap and no clock tick.
    assert first.slot not in ex.freed
    assert ex.stats().disk_copy_blocks == 1 and ex.stats().disk_empty_slots == 0
    ex.serve("x", one_block())
    ex.churn("c")  # x goes to the host tier; the next eviction spills it
    ex.serve("y", one_block())
    start = len(ex.log)
    ex.churn("c2")
    new = [c for c in ex.log[start:] if isinstance(c, WriteSlot)]
    assert [w.slot for w in new] == [first.slot]
    assert ex.stats().displacements == 1 and ex.stats().disk_copy_blocks == 0
    assert ex.tiers(doc) == ["ON_GPU"]  # held by "a": only the copy went
    assert not any(isinstance(c, FreeSlot) for c in ex.log[start:])
    ex.drain()
    ex.release("a")
