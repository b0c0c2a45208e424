"""Retention write-through: content released with a TTL reaches disk at its release, and stays
where it is (statekv.config.CacheConfig.retention_write_through, specs/disk_persistence.md).

Written from the promise: a retained block is on disk once its write lands, without any
eviction; it is still a GPU (or host) hit meanwhile; a later eviction writes nothing; content
that left, or came back with another deadline, never adopts a slot written for it earlier.
"""

from __future__ import annotations

from typing import Any

from statekv import KVCacheManager
from statekv.messages import CopyGpuToHost, FreeSlot, PersistRetention, WriteSlot
from tests.harness import Executor, block_keys, config, fresh_tokens


def make(**overrides: Any) -> Executor:
    cfg = {"gpu_blocks": 8, "host_blocks": 4, "disk_blocks": 8,
           "retention_write_through": True, **overrides}
    return Executor(KVCacheManager(config(**cfg)))


def test_a_retained_release_writes_its_blocks_and_keeps_them_on_gpu() -> None:
    ex = make()
    tokens = fresh_tokens(3 * ex.bs + 1)
    ex.serve("a", tokens, ttl=600.0)
    writes = [c for c in ex.log if isinstance(c, WriteSlot)]
    keys = block_keys(tokens, ex.bs)
    assert [w.key for w in writes] == keys          # in prefix order, before any eviction
    assert all(w.retained and w.expiry == ex.now + 600.0 for w in writes)
    assert sum(isinstance(c, CopyGpuToHost) for c in ex.log) == 3   # staged through host
    assert ex.tiers(tokens) == ["RELEASED"] * 3
    ex.drain()
    cached = ex.cached()
    assert all(cached[k].has_disk_copy and cached[k].state.name == "RELEASED" for k in keys)
    assert {ex.slot_content[w.slot] for w in writes} == set(keys)
    s = ex.stats()
    assert (s.write_throughs, s.write_throughs_skipped, s.spills_completed) == (3, 0, 3)
    assert s.host_free_pages == 4                    # the staging pages came back
    # Still a GPU hit, and evictions later write nothing more (to host with the copy, and
    # from host to disk in the slot it has).
    assert ex.serve("b", tokens).gpu_tokens == 3 * ex.bs
    ex.churn("c")
    assert ex.tiers(tokens) == ["ON_HOST"] * 3
    for i in range(3):
        ex.serve(f"o{i}", fresh_tokens(2 * ex.bs))
        ex.churn(f"c{i}")
    assert ex.tiers(tokens) == ["ON_DISK"] * 3
    assert ex.stats().spills_saved_by_disk_copy == 3
    assert all(w.key != k for w in ex.writes.values() for k in keys)


def test_best_effort_content_and_a_cache_without_the_option_write_nothing_at_release() -> None:
    ex = make()
    ex.serve("a", fresh_tokens(2 * ex.bs + 1))
    assert ex.stats().spills == 0
    off = make(retention_write_through=False)
    off.serve("a", fresh_tokens(2 * off.bs + 1), ttl=600.0)
    assert off.stats().spills == 0


def test_retained_content_on_host_is_written_keeping_its_host_page() -> None:
    ex = make(gpu_blocks=4, host_blocks=2)
    tokens = fresh_tokens(ex.bs + 1)
    ex.add("a", tokens)
    ex.add("b", tokens, ttl=600.0)        # both compute it: b's block is a private duplicate
    ex.compute("a")
    ex.compute("b")
    ex.release("a")                       # best-effort: nothing written
    ex.churn("c", 2)                      # the cached block goes to host
    key = block_keys(tokens, ex.bs)[0]
    assert ex.cached()[key].state.name == "ON_HOST"
    before = len(ex.log)
    ex.release("b")                       # b's TTL stamps the twin on host: written through
    (write,) = ex.writes.values()
    assert write.key == key
    assert not any(isinstance(c, CopyGpuToHost) for c in ex.log[before:])   # no staging
    ex.drain()
    block = ex.cached()[key]
    assert block.state.name == "ON_HOST" and block.has_disk_copy
    assert ex.add("d", tokens).host_tokens == ex.bs   # still a host hit


def test_content_dropped_while_its_write_is_in_flight_is_on_disk_when_it_lands() -> None:
    ex = make(gpu_blocks=3, host_blocks=3, reserved_host_blocks=0, disk_blocks=4)
    tokens = fresh_tokens(2 * ex.bs + 1)
    ex.serve("a", tokens, ttl=600.0)      # two staged writes in flight: one host page left
    assert len(ex.writes) == 2
    ex.churn("c")                         # one GPU victim gets it, the other is dropped
    assert None in ex.tiers(tokens)
    ex.drain()
    # Nothing retained is lost to the staging: the dropped content is on disk when its
    # write lands, with its deadline (and the other, on host, has its disk copy).
    assert sorted(map(str, ex.tiers(tokens))) == ["ON_DISK", "ON_HOST"]
    assert all(b.has_disk_copy or b.state.name == "ON_DISK" for b in ex.cached().values())
    assert {b.expiry for b in ex.cached().values()} == {600.0}
    assert ex.add("b", tokens).matched_tokens == 2 * ex.bs


def test_staging_never_takes_the_last_host_page_a_gpu_victim_could_have() -> None:
    ex = make(gpu_blocks=3, host_blocks=1, reserved_host_blocks=1, disk_blocks=4)
    tokens = fresh_tokens(ex.bs + 1)
    ex.serve("a", tokens, ttl=600.0)
    s = ex.stats()
    assert (s.write_throughs, s.write_throughs_skipped) == (0, 1)
    ex.churn("c")                         # the retained block gets the host page ...
    assert ex.tiers(tokens) == ["ON_HOST"]


def test_content_cached_again_with_a_shorter_deadline_does_not_adopt_the_old_write() -> None:
    ex = make(gpu_blocks=3, host_blocks=3, reserved_host_blocks=0, disk_blocks=4)
    tokens = fresh_tokens(2 * ex.bs + 1)
    ex.serve("a", tokens, ttl=600.0)
    ex.churn("c")                         # one of a's blocks dropped, its write in flight
    (gone,) = [k for k, t in zip(block_keys(tokens, ex.bs), ex.tiers(tokens), strict=True)
               if t is None]
    ex.add("b", tokens)                   # recomputed from there, best-effort
    ex.compute("b")
    ex.release("b")
    ex.drain()
    block = ex.cached()[gone]
    # The slot written with a's deadline is not adopted by best-effort content (a restart
    # would bring it back with a deadline nobody gave it): it is freed.
    assert block.expiry is None and not block.has_disk_copy
    assert len(ex.freed) >= 1


def test_a_deadline_lengthened_while_the_write_is_in_flight_reaches_the_slot_header() -> None:
    ex = make()
    tokens = fresh_tokens(ex.bs + 1)
    ex.serve("a", tokens, ttl=60.0)
    (write,) = ex.writes.values()
    ex.serve("b", tokens, ttl=600.0)      # the same content, a longer stamp; no second write
    assert len(ex.writes) == 1
    ex.land_write(write.transfer)
    (persist,) = [r for r in ex.retention if r.slot == write.slot]
    assert persist.expiry == ex.now + 600.0
    assert ex.cached()[write.key].has_disk_copy


def test_a_failed_write_through_leaves_the_block_on_gpu_without_a_copy() -> None:
    ex = make()
    tokens = fresh_tokens(ex.bs + 1)
    ex.serve("a", tokens, ttl=600.0)
    (write,) = ex.writes.values()
    ex.land_write(write.transfer, ok=False)
    assert write.slot in ex.freed
    block = ex.cached()[write.key]
    assert block.state.name == "RELEASED" and not block.has_disk_copy
    assert ex.stats().host_free_pages == 4
    ex.serve("b", tokens, ttl=600.0)      # the next retained release writes it again
    assert len(ex.writes) == 1


def test_write_throughs_stop_at_the_write_queue_depth_and_say_so() -> None:
    ex = make(write_queue_depth=2)
    ex.serve("a", fresh_tokens(4 * ex.bs + 1), ttl=600.0)
    s = ex.stats()
    assert (s.write_throughs, s.write_throughs_skipped, s.writes_in_flight) == (2, 2, 2)


def test_what_the_queue_depth_held_back_is_written_as_earlier_writes_land() -> None:
    """A crash loses at most the writes in flight: retained content a full queue held back
    at its release reaches disk as the queue drains, not at its eviction."""
    ex = make(write_queue_depth=2)
    tokens = fresh_tokens(4 * ex.bs + 1)
    ex.serve("a", tokens, ttl=600.0)
    keys = block_keys(tokens, ex.bs)
    first = sorted(w.key for w in ex.writes.values())
    assert first == sorted(keys[:2])     # prefix order
    ex.land_write()                      # a place in the queue: the third block goes
    assert sorted(w.key for w in ex.writes.values()) == sorted(keys[1:3])
    ex.drain()
    s = ex.stats()
    assert (s.write_throughs, s.write_throughs_skipped, s.write_throughs_retried) == (4, 2, 2)
    assert all(ex.cached()[k].has_disk_copy for k in keys)
    assert all(ex.cached()[k].state.name == "RELEASED" for k in keys)  # still GPU hits
    ex.cache.check_invariants()


def test_the_backlog_forgets_content_that_left_or_reached_disk_otherwise() -> None:
    ex = make(write_queue_depth=1, gpu_blocks=8)
    tokens = fresh_tokens(3 * ex.bs + 1)
    ex.serve("a", tokens, ttl=600.0)     # one written, two in the backlog
    keys = block_keys(tokens, ex.bs)
    ex.tick(1000.0)                      # their TTL ran out: best-effort now
    ex.drain()
    s = ex.stats()
    assert (s.write_throughs, s.write_throughs_retried) == (1, 0)
    assert [ex.cached()[k].has_disk_copy for k in keys] == [True, False, False]
    assert not ex.cache._eviction.write_backlog
    ex.cache.check_invariants()


def test_no_persist_command_for_an_unchanged_deadline_and_free_slots_only_for_leavers() -> None:
    ex = make()
    tokens = fresh_tokens(2 * ex.bs + 1)
    ex.serve("a", tokens, ttl=600.0)
    ex.drain()
    assert not ex.retention
    assert not any(isinstance(c, FreeSlot) for c in ex.log)
    assert not any(isinstance(c, PersistRetention) for c in ex.log)


def test_content_whose_write_through_is_in_flight_is_never_written_twice() -> None:
    # Two writes of one key would leave two slots holding it if the process died before the
    # second one's slot was freed (the kill loop found one).  Evicted from host while its
    # staged write is in flight, the content is dropped there, and is on disk when it lands.
    ex = make(gpu_blocks=3, host_blocks=3, reserved_host_blocks=1, disk_blocks=8)
    tokens = fresh_tokens(ex.bs + 1)
    ex.serve("a", tokens, ttl=600.0)
    (write,) = ex.writes.values()
    ex.churn("c1")                        # to host, with its write still in flight
    assert ex.tiers(tokens) == ["ON_HOST"]
    for i in range(4):                    # host pressure: evicted from host
        ex.serve(f"o{i}", fresh_tokens(2 * ex.bs))
        ex.churn(f"c{i + 2}")
    assert ex.tiers(tokens) == [None]
    assert [w.key for w in ex.writes.values()].count(write.key) == 1
    ex.drain()
    assert ex.tiers(tokens) == ["ON_DISK"]
    assert sum(1 for c in ex.log if isinstance(c, WriteSlot) and c.key == write.key) == 1
    assert ex.add("b", tokens).disk_tokens == ex.bs
