"""The disk displacement order (REQUIREMENTS section 5), rule by rule.

Empty slots first; then best-effort content, first in first out by the time it became
best-effort; then retained content in exact expiry order, a suffix before its prefix among
equal expiries, first in first out among equals -- and with protect_unexpired, a disk full of
live TTLs refuses the spill instead.  Slots are the evidence: the slot a new write goes to
is the slot of the content it displaced.
"""

from __future__ import annotations

import pytest

from statekv.block import Block
from statekv.ids import BlockId, SlotId
from statekv.messages import FreeSlot, ReadSlot, WriteSlot
from statekv.pools import DiskSlots
from tests.harness import Executor, block_keys, fresh_tokens, make


def one_block() -> list[int]:
    return fresh_tokens(3)  # bs 2: one full block and a private partial one


def disk_cache(disk_blocks: int, **overrides: object) -> Executor:
    """A cache that spills one block at a time (host tier of one page, no reserve)."""
    return make(gpu_blocks=4, host_blocks=1, disk_blocks=disk_blocks, **overrides)


def put_on_disk(ex: Executor, ttl: float | None = None) -> tuple[list[int], SlotId]:
    """Spill a new one-block prompt and land it; returns its tokens and slot."""
    tokens = one_block()
    (write,) = ex.spill([tokens], ttl=ttl)
    assert ex.tiers(tokens) == ["ON_DISK"]
    return tokens, write.slot


def test_empty_slots_are_used_before_any_content_is_displaced() -> None:
    ex = disk_cache(3)
    placed = [put_on_disk(ex, ttl) for ttl in (5.0, None, 1.0)]
    assert ex.stats().displacements == 0
    assert ex.stats().disk_empty_slots == 0
    assert len({slot for _tokens, slot in placed}) == 3
    assert all(ex.tiers(tokens) == ["ON_DISK"] for tokens, _slot in placed)


def test_fresh_spills_never_displace_each_other_while_a_slot_is_empty() -> None:
    ex = disk_cache(4)
    first, _ = put_on_disk(ex)
    second, _ = put_on_disk(ex)
    assert ex.stats().displacements == 0
    assert ex.tiers(first) == ex.tiers(second) == ["ON_DISK"]
    assert ex.stats().disk_empty_slots == 2


def test_best_effort_content_is_displaced_before_retained_content() -> None:
    ex = disk_cache(2)
    retained, _ = put_on_disk(ex, ttl=100.0)   # older, but retained
    best_effort, slot = put_on_disk(ex)
    (write,) = ex.spill([one_block()], ttl=100.0)
    assert write.slot == slot
    assert ex.tiers(best_effort) == [None]
    assert ex.tiers(retained) == ["ON_DISK"]
    assert ex.stats().displacements == 1


def test_best_effort_content_is_displaced_first_in_first_out() -> None:
    ex = disk_cache(3)
    placed = [put_on_disk(ex) for _ in range(3)]
    for tokens, slot in placed:
        (write,) = ex.spill([one_block()])
        assert write.slot == slot
        assert ex.tiers(tokens) == [None]


@pytest.mark.parametrize(
    "ttls",
    [(300.0, 100.0, 200.0), (100.002, 100.0, 100.001), (1.0, 2.0, 3.0)],
    ids=["coarse", "fine", "in-order"],
)
def test_retained_content_is_displaced_in_exact_expiry_order(
    ttls: tuple[float, float, float],
) -> None:
    ex = disk_cache(3)
    placed = [(ttl, *put_on_disk(ex, ttl)) for ttl in ttls]
    for _ttl, tokens, slot in sorted(placed):
        (write,) = ex.spill([one_block()], ttl=1000.0)
        assert write.slot == slot
        assert ex.tiers(tokens) == [None]
    assert ex.stats().displacements == 3


def test_among_equal_expiries_a_suffix_is_displaced_before_its_prefix() -> None:
    ex = make(gpu_blocks=4, host_blocks=2, disk_blocks=2)
    doc = fresh_tokens(5)
    prefix_key, suffix_key = block_keys(doc, ex.bs)
    writes = {w.key: w for w in ex.spill([doc], ttl=100.0, land=False)}
    # The prefix lands first, so first-in-first-out alone would pick it.
    ex.land_write(writes[prefix_key].transfer)
    ex.land_write(writes[suffix_key].transfer)
    assert ex.tiers(doc) == ["ON_DISK", "ON_DISK"]
    cached = ex.cached()
    assert cached[prefix_key].expiry == cached[suffix_key].expiry

    new = ex.spill([one_block(), one_block()], ttl=1000.0, land=False)
    assert [w.slot for w in new] == [writes[suffix_key].slot, writes[prefix_key].slot]


@pytest.mark.parametrize("ttl", [100.0, None], ids=["retained", "best-effort"])
@pytest.mark.parametrize("first_landed", [0, 1])
def test_equal_content_is_displaced_in_the_order_it_landed(
    ttl: float | None, first_landed: int,
) -> None:
    ex = make(gpu_blocks=4, host_blocks=2, disk_blocks=2)
    docs = [one_block(), one_block()]
    writes = ex.spill(docs, ttl=ttl, land=False)
    order = [writes[first_landed], writes[1 - first_landed]]
    for write in order:
        ex.land_write(write.transfer)
    new = ex.spill([one_block(), one_block()], ttl=1000.0, land=False)
    assert [w.slot for w in new] == [w.slot for w in order]


def test_protect_unexpired_refuses_the_spill_instead_of_displacing_live_ttls() -> None:
    ex = disk_cache(2, protect_unexpired=True)
    kept = [put_on_disk(ex, ttl=100.0)[0] for _ in range(2)]
    before = ex.stats()
    start = len(ex.log)
    newcomer = one_block()
    writes = ex.spill([newcomer], ttl=1000.0)
    after = ex.stats()
    assert writes == []
    assert not any(isinstance(c, WriteSlot | FreeSlot) for c in ex.log[start:])
    assert after.admission_refusals == before.admission_refusals + 1
    assert after.host_drops == before.host_drops + 1
    assert after.displacements == before.displacements == 0
    assert ex.tiers(newcomer) == [None]
    assert all(ex.tiers(tokens) == ["ON_DISK"] for tokens in kept)
    assert after.disk_retained_blocks == 2


def test_without_protection_a_disk_full_of_live_ttls_displaces_the_earliest_deadline() -> None:
    ex = disk_cache(2)
    late, _ = put_on_disk(ex, ttl=200.0)
    early, slot = put_on_disk(ex, ttl=100.0)
    (write,) = ex.spill([one_block()], ttl=300.0)
    assert write.slot == slot
    assert ex.tiers(early) == [None] and ex.tiers(late) == ["ON_DISK"]
    assert ex.stats().admission_refusals == 0


def test_a_best_effort_spill_never_displaces_content_whose_ttl_is_running() -> None:
    ex = disk_cache(2)
    kept = [put_on_disk(ex, ttl=100.0)[0], put_on_disk(ex, ttl=200.0)[0]]
    assert ex.spill([one_block()]) == []             # dropped from host instead
    assert all(ex.tiers(tokens) == ["ON_DISK"] for tokens in kept)
    assert ex.stats().admission_refusals == 1


def test_protect_unexpired_displaces_content_whose_ttl_ran_out() -> None:
    ex = disk_cache(2, protect_unexpired=True)
    short, slot = put_on_disk(ex, ttl=10.0)
    long, _ = put_on_disk(ex, ttl=1000.0)
    ex.tick(10.0)
    assert ex.stats().expirations == 1
    (write,) = ex.spill([one_block()], ttl=1000.0)
    assert write.slot == slot
    assert ex.tiers(short) == [None] and ex.tiers(long) == ["ON_DISK"]
    assert ex.stats().admission_refusals == 0


def test_expired_content_becomes_best_effort_behind_content_that_already_was() -> None:
    ex = disk_cache(3)
    expiring, expiring_slot = put_on_disk(ex, ttl=10.0)  # landed first
    best_effort, best_effort_slot = put_on_disk(ex)
    retained, _ = put_on_disk(ex, ttl=1000.0)
    ex.tick(10.0)  # `expiring` becomes best-effort now, after `best_effort` did
    assert ex.stats().disk_retained_blocks == 1
    first = ex.spill([one_block()], ttl=2000.0)
    second = ex.spill([one_block()], ttl=2000.0)
    assert [first[0].slot, second[0].slot] == [best_effort_slot, expiring_slot]
    assert ex.tiers(best_effort) == ex.tiers(expiring) == [None]
    assert ex.tiers(retained) == ["ON_DISK"]


def test_content_expiring_together_becomes_best_effort_in_deadline_order() -> None:
    ex = disk_cache(3)
    later, later_slot = put_on_disk(ex, ttl=20.0)
    sooner, sooner_slot = put_on_disk(ex, ttl=10.0)
    put_on_disk(ex, ttl=1000.0)
    ex.tick(30.0)
    assert ex.stats().expirations == 2
    slots = [ex.spill([one_block()], ttl=2000.0)[0].slot for _ in range(2)]
    assert slots == [sooner_slot, later_slot]
    assert ex.tiers(sooner) == ex.tiers(later) == [None]


def test_displaced_content_leaves_the_prefix_index_in_the_same_step() -> None:
    ex = disk_cache(1)
    old, slot = put_on_disk(ex)
    (old_key,) = block_keys(old, ex.bs)
    (write,) = ex.spill([one_block()], land=False)
    assert write.slot == slot
    # The write has not landed, yet the old content is already gone from the index.
    assert old_key not in ex.cached()
    assert ex.tiers(old) == [None]
    start = len(ex.log)
    match = ex.add("again", [*old, 5])
    assert match.matched_tokens == 0
    assert not any(isinstance(c, ReadSlot) for c in ex.log[start:])
    ex.land_write(write.transfer)
    assert ex.slot_content[slot] == write.key


def test_displacement_hands_the_slot_straight_to_the_new_write() -> None:
    ex = disk_cache(1)
    _, slot = put_on_disk(ex)
    start = len(ex.log)
    ex.spill([one_block()], land=False)
    new = ex.log[start:]
    assert not any(isinstance(c, FreeSlot) and c.slot == slot for c in new)
    assert ex.stats().disk_empty_slots == 0


# ---------------------------------------------------------------------- DiskSlots alone


def _block(i: int, expiry: float | None = None, depth: int = 0) -> Block:
    return Block(BlockId(i), expiry=expiry, depth=depth)


def test_disk_slots_file_live_ttls_as_retained_and_the_rest_as_best_effort() -> None:
    disk = DiskSlots(4)
    live, dead, none = _block(0, 50.0), _block(1, 5.0), _block(2)
    for seq, block in enumerate((live, dead, none)):
        disk.file(block, now=10.0, seq=seq)
    assert list(disk.retained) == [live]
    assert list(disk.unmarked) == [dead, none]
    assert disk.next_victim(True) is dead
    disk.check()


def test_disk_slots_next_victim_never_offers_live_content_when_protected() -> None:
    disk = DiskSlots(1)
    live = _block(0, 50.0)
    disk.file(live, now=0.0, seq=1)
    assert disk.next_victim(False) is None
    assert disk.next_victim(True) is live


def test_disk_slots_expire_moves_content_exactly_at_its_deadline() -> None:
    disk = DiskSlots(2)
    block = _block(0, 10.0)
    disk.file(block, now=0.0, seq=1)
    assert disk.expire(9.999) == []
    assert disk.expire(10.0) == [block]
    assert block not in disk.retained
    assert list(disk.unmarked) == [block]
    disk.check()


def test_disk_slots_unfile_forgets_retained_and_best_effort_content() -> None:
    disk = DiskSlots(2)
    live, plain = _block(0, 50.0), _block(1)
    disk.file(live, now=0.0, seq=1)
    disk.file(plain, now=0.0, seq=2)
    disk.unfile(live)
    disk.unfile(plain)
    assert len(disk.retained) == 0 and len(disk.unmarked) == 0
    assert disk.next_victim(True) is None
    disk.check()
