"""KVCacheManager.restore: adopting blocks an earlier process left on disk (pure, no I/O).

The evidence is behavioural: a restored cache serves the blocks as disk hits from their
slots, and displaces them in the order the old process would have.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import pytest

from statekv import KVCacheManager, UsageError
from statekv.ids import BlockHash, SlotId
from statekv.manager import RestoredBlock
from statekv.messages import ReadSlot, WriteSlot
from tests.harness import Executor, fresh_tokens, make


def entry(write: WriteSlot) -> RestoredBlock:
    """What an index rebuild reads back from the header of the slot `write` filled."""
    assert write.parent is not None
    return RestoredBlock(
        key=write.key, parent_key=write.parent, slot=write.slot, depth=write.depth,
        reuse_count=write.reuse_count, expiry=write.expiry, written_at=write.issued_at,
        sequence=write.transfer,
    )


def disk_cache(**overrides: object) -> Executor:
    return make(gpu_blocks=4, host_blocks=1, disk_blocks=4, **overrides)


def restart(old: Executor, writes: Sequence[WriteSlot], downtime: float) -> Executor:
    new = Executor(KVCacheManager(old.cache.config), now=old.now + downtime)
    new.cache.restore([entry(w) for w in writes], now=new.now)
    new.slot_content = {w.slot: w.key for w in writes}
    new.cache.check_invariants()
    return new


def fill(ex: Executor) -> tuple[list[list[int]], list[WriteSlot]]:
    """Four one-block prompts on disk: best-effort, TTL 5 s, best-effort, TTL 100 s."""
    prompts, writes = [], []
    for ttl in (None, 5.0, None, 100.0):
        tokens = fresh_tokens(3)
        (write,) = ex.spill([tokens], ttl=ttl)
        prompts.append(tokens)
        writes.append(write)
        ex.tick(1.0)
    return prompts, writes


def displaced_in_order(ex: Executor, newcomers: list[list[int]]) -> list[BlockHash]:
    """Spill each newcomer in turn; the keys whose slots they took, in order."""
    out = []
    for tokens in newcomers:
        before = dict(ex.slot_content)
        (write,) = ex.spill([tokens])
        out.append(before[write.slot])
    return out


@pytest.mark.parametrize("downtime", [0.0, 2.0, 500.0])
def test_a_restored_cache_displaces_in_the_order_the_old_one_would(downtime: float) -> None:
    old = disk_cache()
    _, writes = fill(old)
    new = restart(old, writes, downtime)
    old.tick(downtime)
    newcomers = [fresh_tokens(3) for _ in range(4)]
    expected = displaced_in_order(old, newcomers)
    assert displaced_in_order(new, newcomers) == expected
    # Best-effort content first, in the order it became best-effort (the 5 s TTL ran out
    # during 500 s of downtime, at t=6, after `third` was written at t=2); the newcomers
    # (best-effort too) go before content whose TTL still runs.
    first, ttl5, third, ttl100 = (w.key for w in writes)
    if downtime == 500.0:
        assert expected == [first, third, ttl5, ttl100]  # every TTL ran out
    elif downtime == 0.0:
        assert expected[:2] == [first, third]
        assert ttl5 not in expected and ttl100 not in expected


def test_restored_blocks_are_served_as_disk_hits_from_their_slots() -> None:
    old = disk_cache()
    prompts, writes = fill(old)
    new = restart(old, writes, 10.0)
    stats = new.stats()
    assert stats.restored_blocks == 4 and stats.disk_cached_blocks == 4
    assert stats.disk_empty_slots == 0
    # The 100 s TTL is still running after 10 s of downtime; the 5 s one ran out.
    assert stats.disk_retained_blocks == 1
    match = new.add("hit", prompts[3])
    assert match.disk_tokens == new.bs
    (read,) = [c for c in new.log if isinstance(c, ReadSlot)]
    assert (read.slot, read.key) == (writes[3].slot, writes[3].key)
    new.land_read(read.transfer)
    assert new.cache.is_ready("hit")
    new.cache.check_invariants()
    cached = {b.key: b for b in new.cache.cached_blocks()}
    assert cached[writes[1].key].expiry == writes[1].expiry


def test_a_deeper_block_goes_before_its_prefix_when_they_became_best_effort_together() -> None:
    ex = make(gpu_blocks=6, host_blocks=2, disk_blocks=2)
    writes = ex.spill([fresh_tokens(5)])  # two full blocks, spilled at the same moment
    assert sorted(w.depth for w in writes) == [0, 1]
    same_time = [attrs.evolve(entry(w), sequence=0) for w in writes]
    cache = KVCacheManager(ex.cache.config)
    cache.restore(same_time, now=ex.now)
    new = Executor(cache, now=ex.now)
    new.slot_content = {w.slot: w.key for w in writes}
    leaf = next(w for w in writes if w.depth == 1)
    newcomers = new.spill([fresh_tokens(5)])
    assert newcomers[0].slot == leaf.slot


def test_restore_only_on_a_fresh_cache() -> None:
    ex = disk_cache()
    fill(ex)
    with pytest.raises(UsageError) as info:
        ex.cache.restore([], now=ex.now)
    assert info.value.field == "restore"


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"slot": SlotId(4)}, "slot"),
        ({"slot": -1}, "slot"),
        ({"key": b"short"}, "key"),
        ({"parent_key": None}, "parent_key"),
        ({"depth": -1}, "depth"),
        ({"reuse_count": True}, "reuse_count"),
        ({"expiry": float("nan")}, "expiry"),
        ({"written_at": float("inf")}, "written_at"),
        ({"sequence": 1.5}, "sequence"),
    ],
)
def test_a_bad_entry_changes_nothing_and_names_the_field(
    change: dict[str, object], field: str
) -> None:
    old = disk_cache()
    _, writes = fill(old)
    cache = KVCacheManager(old.cache.config)
    entries = [entry(w) for w in writes]
    entries[2] = attrs.evolve(entries[2], **change)  # type: ignore[arg-type]
    with pytest.raises(UsageError) as info:
        cache.restore(entries, now=old.now)
    assert info.value.field == field
    assert "blocks[2]" in str(info.value)
    assert cache.statistics().disk_empty_slots == 4 and not cache.cached_blocks()
    cache.check_invariants()


def test_a_slot_or_key_restored_twice_is_refused() -> None:
    old = disk_cache()
    _, writes = fill(old)
    cache = KVCacheManager(old.cache.config)
    twice_slot = [entry(writes[0]), attrs.evolve(entry(writes[1]), slot=writes[0].slot)]
    with pytest.raises(UsageError, match="restored twice") as info:
        cache.restore(twice_slot, now=old.now)
    assert info.value.field == "slot"
    twice_key = [entry(writes[0]), attrs.evolve(entry(writes[1]), key=writes[0].key)]
    with pytest.raises(UsageError, match="restored twice") as info:
        cache.restore(twice_key, now=old.now)
    assert info.value.field == "key"
    assert not cache.cached_blocks()
