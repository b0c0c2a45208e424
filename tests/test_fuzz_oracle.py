"""The fuzz suite's oracle catches what it must: each corruption of the core's structures is
reported by ``check_invariants()`` with the invariant it breaks.

The machines call ``check_invariants()`` after every step; a clause of it that could never
fire would let its race through unnoticed.  Each test below builds a real state through the
public API (tests.harness plays the actors), breaks exactly one thing the way a bug would, and
checks that the matching clause -- not some other -- reports it.  Mutation testing (fuzz/README.md)
is what asked for these: it found clauses that no test could tell from their absence.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from statekv import InvariantViolation, KVCacheManager
from statekv.block import Block
from statekv.ids import BlockHash, PageId, RequestId, SlotId, TransferId
from statekv.lifecycle import BlockState
from statekv.orderings import BlockList, PriorityLRU, RetentionHeap
from statekv.pools import DiskSlots
from tests.harness import Executor, fresh_tokens, make


def parked() -> Executor:
    """A parked request (two reads in flight), retained and best-effort disk blocks,
    released GPU blocks, free records."""
    ex = make(gpu_blocks=8, host_blocks=2, disk_blocks=8)
    a, b, d = fresh_tokens(4), fresh_tokens(4), fresh_tokens(4)
    ex.spill([a], ttl=30.0)
    ex.spill([d])
    ex.spill([b])
    ex.serve("c", fresh_tokens(5))
    ex.add("pb", [*b, 0])
    return ex


def spilling() -> Executor:
    """Writes in flight (two of them recalled to GPU while they drain), a request holding
    GPU blocks, the host reserve handed out."""
    ex = make(gpu_blocks=4, host_blocks=2, reserved_host_blocks=1, disk_blocks=4)
    a, b = fresh_tokens(4), fresh_tokens(4)
    ex.serve("a", [*a, 0], ttl=30.0)
    ex.churn("x1")
    ex.serve("b", [*b, 0])
    ex.churn("x2")
    ex.add("ra", [*a, 0])
    return ex


def _forget_prefetchers(m: KVCacheManager) -> None:
    """The queued request forgets its blocks and they forget it: a PREFETCHED orphan."""
    for block in m._onboarding.queued[RequestId("q")]:
        block.prefetchers.clear()
    m._onboarding.queued[RequestId("q")] = {}


def prefetching() -> Executor:
    """One queued request: a block prefetched (landed) and one whose read is in flight."""
    ex = make(gpu_blocks=4, host_blocks=2, disk_blocks=4)
    doc = fresh_tokens(5)
    ex.spill([doc])
    ex.prefetch("q", doc)
    ex.land_prefetch()
    return ex


def blocks(m: KVCacheManager, state: BlockState) -> list[Block]:
    found = [b for b in m._records.all if b.state is state]
    assert found, f"the state has no {state.name} block"
    return found


def in_state(state: BlockState) -> Callable[[KVCacheManager], Block]:
    return lambda m: blocks(m, state)[0]


onboarding = in_state(BlockState.ONBOARDING)
released = in_state(BlockState.RELEASED)
on_disk = in_state(BlockState.ON_DISK)
on_gpu = in_state(BlockState.ON_GPU)
free = in_state(BlockState.FREE)


def retained(m: KVCacheManager) -> Block:
    return next(b for b in blocks(m, BlockState.ON_DISK) if b.heap_pos >= 0)


def best_effort(m: KVCacheManager) -> Block:
    return next(b for b in blocks(m, BlockState.ON_DISK) if b.heap_pos < 0)


def _hold_released_block(m: Any) -> None:
    req = m._requests.live["pb"]
    block = released(m)
    req.blocks[0] = block
    req.pages[0] = block.gpu_page


def _unhold_gpu_block(m: Any) -> None:
    req = m._requests.live["ra"]
    block = req.blocks.pop()
    req.pages.pop()
    block.ref_count -= 1
    req.num_computed = min(req.num_computed, len(req.blocks) * m.config.block_size)
    req.committed = min(req.committed, len(req.blocks))


def _alias_key(m: Any) -> None:
    block = released(m)
    m._index.blocks[BlockHash(b"\x01" * 32)] = block


def _overfill_reserve(m: Any) -> None:
    m._host.reserved.append(m._host.empty.pop())


def _reserve_short_with_free_pages(m: Any) -> None:
    m._host.empty.append(m._host.reserved.pop())


# The manager's private structures are reached through Any: each lambda breaks one of them.
CORRUPTIONS: list[tuple[str, Callable[[], Executor], Callable[[Any], object], str]] = [
    ("free GPU page listed twice", parked,
     lambda m: m._gpu.empty.append(m._gpu.empty[-1]),
     r"GPU page \d+ owned by 'gpu-empty' and 'gpu-empty'"),
    ("page of a read in flight on the free list", parked,
     lambda m: m._gpu.empty.append(onboarding(m).gpu_page),
     r"GPU page \d+ owned by 'gpu-empty' and <Block \d+ ONBOARDING"),
    ("slot of disk content on the empty list", parked,
     lambda m: m._disk.slots.empty.append(on_disk(m).disk_slot),
     r"slot \d+ owned by 'disk-empty' and <Block \d+ ON_DISK"),
    ("read points at another block", parked,
     lambda m: m._onboarding.reads.__setitem__(next(iter(m._onboarding.reads)), released(m)),
     "points at"),
    ("block table out of step", parked,
     lambda m: m._requests.live["pb"].pages.append(PageId(0)), "block table out of step"),
    ("stale page in a block table", parked,
     lambda m: m._requests.live["pb"].pages.__setitem__(0, released(m).gpu_page),
     "page 0 is stale"),
    ("request holds a released block", parked, _hold_released_block, "holds"),
    ("request's key differs from its block's", parked,
     lambda m: m._requests.live["pb"].keys.__setitem__(0, released(m).key), "has another key"),
    ("pending count wrong", parked,
     lambda m: setattr(m._requests.live["pb"], "pending", 1), "pending=1"),
    ("computed tokens without pages", parked,
     lambda m: setattr(m._requests.live["pb"], "num_computed", 99), "computed tokens without"),
    ("parked gauge wrong", parked,
     lambda m: setattr(m._requests, "parked", 2), "parked gauge"),
    ("free record listed twice", parked,
     lambda m: m._records.free.append(m._records.free[-1]), "free list twice"),
    ("reference count wrong", parked,
     lambda m: setattr(onboarding(m), "ref_count", 2), "ref_count 2, held 1"),
    ("waiter that does not wait", parked,
     lambda m: onboarding(m).waiters.append(RequestId("ghost")), "waiters"),
    ("disk block with a GPU page", parked,
     lambda m: setattr(on_disk(m), "gpu_page", 7), "gpu_page=7 in state ON_DISK"),
    ("released block with a host page", parked,
     lambda m: setattr(released(m), "host_page", 1), "host_page=1 in state RELEASED"),
    # A RELEASED block may own a slot (its disk copy), but only one no one else owns.
    ("released block with a slot it does not own", parked,
     lambda m: setattr(released(m), "disk_slot", 7), "slot 7 owned by 'disk-empty' and"),
    ("disk block with a transfer", parked,
     lambda m: setattr(on_disk(m), "transfer", 99), "transfer=99 in state ON_DISK"),
    ("free record off the free list", parked,
     lambda m: m._records.free.remove(free(m)), "free list membership wrong"),
    ("released block not evictable", parked,
     lambda m: m._gpu.evictable.remove(released(m)), "GPU evictable membership wrong"),
    ("disk block out of the displacement order", parked,
     lambda m: m._disk.slots.unfile(best_effort(m)), "disk order membership wrong"),
    ("expired block left in the deadline set", parked,
     lambda m: setattr(retained(m), "expiry", m._records.now), "expired but still in the deadline"),
    ("live TTL filed as best-effort", parked,
     lambda m: setattr(best_effort(m), "expiry", m._records.now + 60.0), "live TTL filed as"),
    ("cached block without a key", parked,
     lambda m: setattr(released(m), "key", None), "cached without a key"),
    ("free record with a key", parked,
     lambda m: setattr(free(m), "key", BlockHash(b"\x02" * 32)), "indexed in state FREE"),
    ("free record with an old expiry", parked,
     lambda m: setattr(free(m), "expiry", 5.0), "kept old fields"),
    ("free record with an old reuse count", parked,
     lambda m: setattr(free(m), "reuse_count", 1), "kept old fields"),
    ("key indexed to another block", parked,
     lambda m: m._index.blocks.pop(released(m).key), "key not indexed to it"),
    ("index maps a key to a block with another key", parked, _alias_key,
     "index maps a key"),
    ("state counts wrong", parked,
     lambda m: m._records.state_counts.__setitem__(BlockState.FREE, 0), "state counts"),
    ("a GPU page lost", parked,
     lambda m: m._gpu.empty.pop(), r"GPU pages: owned \d+, unowned \[\d+\]"),
    ("a slot lost", parked,
     lambda m: m._disk.slots.empty.pop(), r"slots: owned \d+, unowned \[\d+\]"),
    ("a stray slot id", parked,
     lambda m: m._disk.slots.empty.__setitem__(0, None), r"stray \[None\]"),
    ("child counts wrong", parked,
     lambda m: m._index.children.__setitem__(next(iter(m._index.children)), 99), "child counts"),
    ("write points at another block", spilling,
     lambda m: setattr(next(w for w in m._disk.writes.values() if w.block is not None), "block",
                       on_gpu(m)), "points at"),
    ("recalled write shares a slot", spilling,
     lambda m: setattr(m._disk.writes[TransferId(1)], "slot", m._disk.writes[TransferId(2)].slot),
     r"slot \d+ owned by 'write 1' and 'write 2'"),
    ("recalled write shares a host page", spilling,
     lambda m: setattr(m._disk.writes[TransferId(1)], "host_page",
                       m._disk.writes[TransferId(2)].host_page),
     r"host page \d+ owned by 'write 1' and 'write 2'"),
    ("spilling block pointed at by no write", spilling,
     lambda m: setattr(blocks(m, BlockState.SPILLING)[0], "transfer", TransferId(1)),
     "points at"),
    ("a host page lost", lambda: make(reserved_host_blocks=1),
     lambda m: m._host.empty.pop(), r"host pages: owned \d+, unowned \[\d+\]"),
    ("held block with no holder", spilling, _unhold_gpu_block, "on GPU with no holder"),
    ("host reserve above its target", lambda: make(reserved_host_blocks=1), _overfill_reserve,
     "reserve above its target"),
    ("free host page beside an unfilled reserve", lambda: make(reserved_host_blocks=1),
     _reserve_short_with_free_pages, "outside an unfilled reserve"),
    ("prefetched block out of the prefetched order", prefetching,
     lambda m: m._eviction.prefetched.remove(blocks(m, BlockState.PREFETCHED)[0]),
     "prefetched order membership wrong"),
    ("prefetch reads miscounted", prefetching,
     lambda m: m._onboarding.queued_reading.__setitem__(RequestId("q"), 2),
     "1 found"),
    ("prefetch reads counted for a request gone", prefetching,
     lambda m: m._onboarding.queued_reading.__setitem__(RequestId("gone"), 0),
     "no longer queued"),
    ("prefetched block wanted by nobody", prefetching,
     lambda m: m._onboarding.queued.pop(RequestId("q")), "prefetchers .* disagree"),
    ("prefetched block with no queued request", prefetching, _forget_prefetchers,
     "prefetched for no queued request"),
    ("prefetch read pointing at another block", prefetching,
     lambda m: setattr(blocks(m, BlockState.PREFETCHING)[0], "transfer", TransferId(999)),
     "prefetch .* points at"),
    ("prefetching host page on the free list", prefetching,
     lambda m: m._host.empty.append(blocks(m, BlockState.PREFETCHING)[0].host_page),
     r"host page \d+ owned by 'host-free'"),
    ("prefetch record of a request no longer queued", prefetching,
     lambda m: m._onboarding.queued_records.__setitem__(
         RequestId("gone"), next(iter(m._onboarding.queued_records.values()))),
     "prefetch records kept for requests not queued"),
    ("queued request also admitted", prefetching,
     lambda m: m._requests.live.__setitem__(RequestId("q"),
                                            next(iter(m._requests.live.values()), None)
                                            or object()),
     "both admitted and queued"),
]


@pytest.mark.parametrize(("build", "corrupt", "message"),
                         [c[1:] for c in CORRUPTIONS], ids=[c[0] for c in CORRUPTIONS])
def test_check_invariants_reports_the_broken_invariant(
    build: Callable[[], Executor], corrupt: Callable[[Any], object], message: str
) -> None:
    ex = build()
    ex.cache.check_invariants()
    corrupt(ex.cache)
    with pytest.raises(InvariantViolation, match=message):
        ex.cache.check_invariants()


# ------------------------------------------------------------------ the order structures


def _block(i: int) -> Block:
    return Block(i)  # type: ignore[arg-type]


def test_block_list_check_reports_a_broken_back_link_and_a_wrong_size() -> None:
    lst = BlockList()
    a, b = _block(0), _block(1)
    lst.append(a)
    lst.append(b)
    lst.check()
    b.prev = None
    with pytest.raises(InvariantViolation, match="broken back link"):
        lst.check()
    b.prev = a
    lst.size = 3
    with pytest.raises(InvariantViolation, match="list size 3 but 2"):
        lst.check()
    lst.size = 1
    with pytest.raises(InvariantViolation, match="longer than its size"):
        lst.check()


def test_priority_lru_check_reports_mask_level_and_size() -> None:
    lru = PriorityLRU(2)
    a = _block(0)
    a.priority = 1
    lru.push(a)
    lru.check()
    lru._mask = 0b01
    with pytest.raises(InvariantViolation, match="mask disagrees"):
        lru.check()
    lru._mask = 0b10
    a.priority = 0
    with pytest.raises(InvariantViolation, match="filed under priority 1"):
        lru.check()
    a.priority = 1
    lru.size = 2
    with pytest.raises(InvariantViolation, match="size 2 but 1"):
        lru.check()


def test_retention_heap_check_reports_position_and_order() -> None:
    heap = RetentionHeap()
    a, b = _block(0), _block(1)
    a.heap_key = (1.0, 0, 1)
    b.heap_key = (2.0, 0, 2)
    heap.push(a)
    heap.push(b)
    heap.check()
    b.heap_pos = 0
    with pytest.raises(InvariantViolation, match="thinks it is at 0, not 1"):
        heap.check()
    b.heap_pos = 1
    b.heap_key = (0.5, 0, 2)
    with pytest.raises(InvariantViolation, match="heap order broken at 1"):
        heap.check()


def test_disk_slots_check_reports_a_slot_listed_twice() -> None:
    disk = DiskSlots(2)
    disk.check()
    disk.empty.append(SlotId(0))
    with pytest.raises(InvariantViolation, match="empty list twice"):
        disk.check()
