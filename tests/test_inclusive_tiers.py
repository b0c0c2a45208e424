"""Inclusive lower tiers: a block read back from disk keeps its slot as a valid copy.

A full block is immutable, so the bytes in its slot stay right when the block moves up.  The
promise: onboarding leaves the slot holding the content (only displacement, in the usual
order, reclaims it); evicting the same content again writes nothing; displacing the slot
while the block is up-tier drops only the copy; a TTL prefix read back after a restart is
still there after the next restart, and the one after.
"""

from __future__ import annotations

from pathlib import Path

from io_actors.embed import BlockingCache
from statekv.lifecycle import BlockState
from statekv.messages import FreeSlot, PersistRetention, ReadSlot, WriteSlot
from tests.harness import Executor, block_keys, fresh_tokens, make
from tests.io_helpers import compute, small_config, wait_quiet, wait_ready


def _cache(**overrides: object) -> Executor:
    return make(**{"gpu_blocks": 4, "host_blocks": 1, "disk_blocks": 2, **overrides})


def _doc() -> list[int]:
    return fresh_tokens(3)  # one full block (block size 2) and one token


def _onboarded(ex: Executor, doc: list[int], *, ttl: float | None = None) -> None:
    """`doc` pushed to disk, then served again: read back from its slot."""
    ex.spill([doc], ttl=ttl)
    assert ex.tiers(doc) == ["ON_DISK"]
    match = ex.serve("back", doc)
    assert match.disk_tokens == ex.bs


def _copy(ex: Executor, doc: list[int]) -> bool:
    (key,) = block_keys(doc, ex.bs)
    return ex.cached()[key].has_disk_copy


def _kinds(ex: Executor, start: int) -> list[type]:
    return [type(c) for c in ex.log[start:]]


def test_an_onboarded_block_keeps_its_slot_and_frees_nothing() -> None:
    ex = _cache()
    doc = _doc()
    ex.spill([doc])
    empty = ex.stats().disk_empty_slots
    start = len(ex.log)
    ex.serve("back", doc)
    assert ReadSlot in _kinds(ex, start) and FreeSlot not in _kinds(ex, start)
    assert ex.tiers(doc) == ["RELEASED"] and _copy(ex, doc)
    stats = ex.stats()
    assert stats.disk_empty_slots == empty  # the slot still holds the content
    assert stats.disk_copy_blocks == 1 and stats.disk_cached_blocks == 0


def test_evicting_an_onboarded_block_again_writes_nothing_and_counts_the_saved_spill() -> None:
    ex = _cache()
    doc = _doc()
    _onboarded(ex, doc)
    spills = ex.stats().spills
    start = len(ex.log)
    ex.churn("c1")                       # GPU -> host: the copy stays
    assert ex.tiers(doc) == ["ON_HOST"] and _copy(ex, doc)
    ex.serve("other", _doc())
    ex.churn("c2")                       # host -> disk: the copy is the disk content
    assert ex.tiers(doc) == ["ON_DISK"] and not _copy(ex, doc)
    writes = [c for c in ex.log[start:] if isinstance(c, WriteSlot)]
    (key,) = block_keys(doc, ex.bs)
    assert all(w.key != key for w in writes)
    stats = ex.stats()
    assert stats.spills_saved_by_disk_copy == 1
    assert stats.spills == spills + len(writes)
    # And it is served from that slot again.
    assert ex.serve("again", doc).disk_tokens == ex.bs


def test_a_gpu_victim_with_a_copy_and_no_host_page_goes_back_to_disk() -> None:
    ex = _cache()
    doc = _doc()
    _onboarded(ex, doc)
    ex.serve("x", _doc())
    ex.serve("doc-again", doc)           # a GPU hit: doc is now the newest released
    start, skipped = len(ex.log), ex.stats().offloads_skipped
    ex.churn("c1")     # x to host; doc finds no host page (x's spill keeps it): to disk
    assert WriteSlot in _kinds(ex, start)
    assert ex.stats().offloads_skipped == skipped + 1
    assert ex.tiers(doc) == ["ON_DISK"]
    assert ex.stats().spills_saved_by_disk_copy == 1
    ex.cache.check_invariants()


def test_displacing_the_slot_of_a_block_on_gpu_drops_only_the_copy() -> None:
    ex = _cache(disk_blocks=1)
    doc = _doc()
    ex.spill([doc])
    ex.add("holder", doc)          # read back, and held on GPU
    ex.land_read()
    assert ex.tiers(doc) == ["ON_GPU"] and _copy(ex, doc)
    y, z = _doc(), _doc()
    ex.serve("y", y)
    ex.churn("c1")                       # y to host
    ex.serve("z", z)
    start = len(ex.log)
    ex.churn("c2")                       # z needs y's host page: y spills into doc's slot
    assert ex.stats().displacements == 1
    writes = [c for c in ex.log[start:] if isinstance(c, WriteSlot)]
    assert [w.key for w in writes] == block_keys(y, ex.bs)
    assert ex.tiers(doc) == ["ON_GPU"] and not _copy(ex, doc)  # still cached, on GPU
    assert ex.cache.request_status("holder").ready
    ex.drain()
    ex.release("holder")
    # Its next eviction writes it again, normally.
    saved = ex.stats().spills_saved_by_disk_copy
    ex.churn("c3")
    assert ex.tiers(doc) == ["ON_HOST"]
    start = len(ex.log)
    ex.serve("w", _doc())
    ex.churn("c4")
    writes = [c for c in ex.log[start:] if isinstance(c, WriteSlot)]
    assert block_keys(doc, ex.bs)[0] in [w.key for w in writes]
    assert ex.stats().spills_saved_by_disk_copy == saved


def test_a_release_during_the_onboard_keeps_page_and_slot_until_it_lands() -> None:
    ex = _cache(disk_blocks=1)
    doc = _doc()
    ex.spill([doc])
    ex.add("b", doc)
    ex.release("b")                      # the read is still in flight
    assert ex.tiers(doc) == ["ONBOARDING"]
    # A spill meanwhile finds no slot: the only one has a read in flight.
    ex.serve("y", _doc())
    ex.churn("c1")
    ex.serve("z", _doc())
    ex.churn("c2")
    assert ex.stats().displacements == 0 and ex.stats().disk_busy_refusals >= 1
    start = len(ex.log)
    ex.land_read()
    assert FreeSlot not in _kinds(ex, start)
    assert ex.tiers(doc) == ["RELEASED"] and _copy(ex, doc)
    ex.cache.check_invariants()


def _two_held_retained_copies(**overrides: object) -> tuple[Executor, list[int], list[int], int]:
    """a (deadline 500) and b (deadline 100) read back from a full disk, held on GPU; then a
    best-effort block is spilled and needs a slot."""
    ex = _cache(disk_blocks=2, host_blocks=2, gpu_blocks=5, **overrides)
    a, b = _doc(), _doc()
    ex.spill([a, b], ttl=100.0)
    ex.serve("a", a, ttl=500.0)          # a's deadline lengthens: b's is now the earlier
    ex.add("ha", a)
    ex.add("hb", b)
    ex.drain()
    assert _copy(ex, a) and _copy(ex, b) and ex.stats().disk_empty_slots == 0
    assert ex.stats().disk_retained_blocks == 2
    displaced = ex.stats().displacements
    for name in ("x", "y", "z"):         # x and y fill the host; z's eviction spills x
        ex.serve(name, _doc(), ttl=1000.0)  # (best-effort spills never displace live TTLs)
        ex.churn("c" + name)
    return ex, a, b, displaced


def test_without_protection_the_earlier_deadline_copy_is_displaced_first() -> None:
    ex, a, b, before = _two_held_retained_copies()
    slot_of = {c.key: c.slot for c in ex.log if isinstance(c, ReadSlot)}
    (ka,), (kb,) = block_keys(a, ex.bs), block_keys(b, ex.bs)
    # z's eviction spills x, then y (no reserve: a spill yields no page at once): the first
    # write takes b's slot (deadline 100), the second a's (deadline 500).
    assert ex.stats().displacements == before + 2
    writes = [c.slot for c in ex.log if isinstance(c, WriteSlot)][-2:]
    assert writes == [slot_of[kb], slot_of[ka]]
    assert not _copy(ex, a) and not _copy(ex, b)
    assert ex.tiers(a) == ex.tiers(b) == ["ON_GPU"]  # only the copies went
    ex.cache.check_invariants()


def test_protect_unexpired_keeps_retained_copies_as_it_keeps_retained_disk_content() -> None:
    ex, a, b, before = _two_held_retained_copies(protect_unexpired=True)
    stats = ex.stats()
    assert stats.displacements == before and stats.admission_refusals >= 1
    assert _copy(ex, a) and _copy(ex, b)
    ex.cache.check_invariants()


def test_a_copy_expires_into_the_best_effort_order_and_is_displaced_before_live_ones() -> None:
    ex, a, b, before = _two_held_retained_copies(protect_unexpired=True)
    ex.tick(200.0)                       # b's deadline passed, a's runs
    assert ex.stats().disk_retained_blocks == 1
    ex.serve("w", _doc())
    ex.churn("cw")                       # the next spill may now displace b's copy
    assert ex.stats().displacements == before + 1
    assert _copy(ex, a) and not _copy(ex, b)
    ex.cache.check_invariants()


def test_a_lengthened_deadline_of_a_copy_reaches_its_slot() -> None:
    ex = _cache()
    doc = _doc()
    _onboarded(ex, doc, ttl=100.0)
    start = len(ex.log)
    ex.serve("longer", doc, ttl=1000.0)
    persisted = [c for c in ex.log[start:] if isinstance(c, PersistRetention)]
    assert [p.key for p in persisted] == block_keys(doc, ex.bs)
    assert ex.stats().disk_retained_blocks == 1


# ------------------------------------------------------------------ the real disk


def test_a_retained_prefix_read_back_after_a_restart_survives_the_next_restarts(
    tmp_path: Path,
) -> None:
    cfg = small_config(tmp_path, gpu=4, host=4, reserved_host=2, disk=32)
    bs = cfg.block_size
    prompt = list(range(1000, 1000 + 3 * bs + 1))   # three full blocks and one token
    prefix = 3 * bs
    with BlockingCache(cfg) as cache:
        cache.add_request("ttl", prompt, ttl_seconds=3600.0)
        wait_ready(cache, "ttl")
        compute(cache, "ttl", prompt)
        cache.release("ttl")
        for i in range(6):                # churn: push it through host to disk
            other = [10_000 * (i + 1) + t for t in range(3 * bs + 1)]
            cache.add_request(f"churn{i}", other)
            compute(cache, f"churn{i}", other)
            cache.release(f"churn{i}")
            wait_quiet(cache)
        on_disk = [b for b in cache.cached_blocks() if b.state is BlockState.ON_DISK]
        assert len(on_disk) >= 3
    served = []
    for restart in range(3):
        with BlockingCache(cfg) as cache:
            match = cache.add_request(f"back{restart}", prompt)
            wait_ready(cache, f"back{restart}")
            compute(cache, f"back{restart}", prompt)
            cache.release(f"back{restart}")
            wait_quiet(cache)
            served.append(match.disk_tokens)
            assert cache.statistics().cache.onboard_failures == 0
            cache.check_invariants()
    assert served == [prefix, prefix, prefix]
